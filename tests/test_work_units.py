"""Restartable work units (runtime/work_units.py) and the run directory's atomic Parquet writer: no Ray."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale.io.rundir import ConfigMismatchError, RunDir
from clusterscale.runtime.work_units import load_or_make_plan, split_done

PLAN = "out/_plan.json"


def _plan(n: int) -> dict:
    return {"units": [{"output": f"out/part-{i}.parquet"} for i in range(n)], "note": "x"}


def test_write_parquet_is_atomic_and_readable(tmp_path):
    run = RunDir(str(tmp_path))
    table = pa.table({"pair_id": pa.array([3, 1, 2], pa.int64())})
    run.write_parquet("out/part-0.parquet", table, row_group_size=2)
    with run.fs.open_input_file(run.path("out/part-0.parquet")) as f:
        parquet = pq.ParquetFile(f)
        assert parquet.read().equals(table) and parquet.metadata.num_row_groups == 2
    assert run.listdir("out") == ["part-0.parquet"]  # no temporary name left behind


def test_a_rerun_keeps_the_plan_and_redoes_only_missing_units(tmp_path):
    run = RunDir(str(tmp_path))
    plan = load_or_make_plan(run, "out", PLAN, "fp1", "test work", lambda: _plan(3))
    assert plan["fingerprint"] == "fp1" and plan["note"] == "x" and len(plan["units"]) == 3
    run.write_parquet("out/part-1.parquet", pa.table({"a": [1]}))
    run.write_bytes("out/.tmp-abc-part-2.parquet", b"half")  # a write cut short by a kill
    again = load_or_make_plan(run, "out", PLAN, "fp1", "test work", lambda: pytest.fail("plan remade"))
    done, todo = split_done(run, "out", again["units"])
    assert [u["output"] for u in done] == ["out/part-1.parquet"]
    assert [u["output"] for u in todo] == ["out/part-0.parquet", "out/part-2.parquet"]
    assert not any(name.startswith(".tmp-") for name in run.listdir("out"))


def test_another_config_is_refused_and_a_fresh_plan_clears_leftovers(tmp_path):
    run = RunDir(str(tmp_path))
    load_or_make_plan(run, "out", PLAN, "fp1", "test work", lambda: _plan(2))
    with pytest.raises(ConfigMismatchError, match="interrupted test work made with a different config"):
        load_or_make_plan(run, "out", PLAN, "fp2", "test work", lambda: _plan(2))
    run.remove(PLAN)
    run.write_parquet("out/stale.parquet", pa.table({"a": [1]}))
    load_or_make_plan(run, "out", PLAN, "fp2", "test work", lambda: _plan(1))
    assert run.listdir("out") == ["_plan.json"]

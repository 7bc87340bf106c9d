"""The evaluation distractor pool: chosen per row group (Ray tasks), the same however pairs/ is split."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from clusterscale.stages.evaluate import EVAL_SALT, distractor_passages, merge_candidates, unit_candidates
from clusterscale.runtime.hashing import hash_unit
from clusterscale.io.rundir import RunDir

NUM_DISTRACTORS = 40


def _pairs(n: int = 700) -> pa.Table:
    ids = np.random.default_rng(1).choice(10**9, size=n, replace=False).astype(np.int64)
    return pa.table({"pair_id": ids, "query": [f"q{i}" for i in ids], "passage": [f"passage {i}" for i in ids],
                     "source": [None] * n})


def _write(tmp_path, name: str, table: pa.Table, cuts: list[int], row_group_size: int) -> RunDir:
    folder = tmp_path / name / "pairs"
    folder.mkdir(parents=True)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        pq.write_table(table.slice(a, b - a), folder / f"part-{i:05d}-00000.parquet", row_group_size=row_group_size)
    return RunDir(str(tmp_path / name))


def _choice_before_the_distributed_pass(table: pa.Table) -> list[str]:
    """build_eval_set's pick until now: every pair_id read on the driver, the smallest keys, in pairs/ order."""
    pick = np.sort(np.argsort(hash_unit(table.column("pair_id").to_numpy(), salt=EVAL_SALT))[:NUM_DISTRACTORS])
    return table.take(pa.array(pick)).column("passage").to_pylist()


def test_pool_is_the_same_for_one_or_three_files_and_equals_the_old_choice(tmp_path):
    table = _pairs()
    one = _write(tmp_path, "one", table, [0, 700], row_group_size=700)
    three = _write(tmp_path, "three", table, [0, 100, 450, 700], row_group_size=64)
    expected = _choice_before_the_distributed_pass(table)
    assert len(expected) == NUM_DISTRACTORS
    assert distractor_passages(one, NUM_DISTRACTORS) == expected
    assert distractor_passages(three, NUM_DISTRACTORS) == expected
    assert distractor_passages(three, 10_000) == table.column("passage").to_pylist()  # D > N: every pair, in order


def test_a_unit_returns_at_most_d_candidates_and_the_merge_stays_bounded(tmp_path):
    run = _write(tmp_path, "run", _pairs(), [0, 700], row_group_size=300)
    candidates = [unit_candidates(run.uri, (0, run.files("pairs")[0], g), 25) for g in range(3)]
    assert [c.num_rows for c in candidates] == [25, 25, 25]
    assert candidates[1].column("row").to_numpy().min() >= 300  # positions count from the file's start
    best = None
    for c in candidates:
        best = merge_candidates(best, c, 25)
        assert best.num_rows == 25
    keys = hash_unit(_pairs().column("pair_id").to_numpy(), salt=EVAL_SALT)
    assert np.array_equal(np.sort(best.column("key").to_numpy()), np.sort(keys)[:25])


def test_ray_tasks_pick_the_same_pool(tmp_path, ray_local):
    table = _pairs()
    three = _write(tmp_path, "three", table, [0, 100, 450, 700], row_group_size=64)
    assert distractor_passages(three, NUM_DISTRACTORS) == _choice_before_the_distributed_pass(table)

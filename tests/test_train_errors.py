"""Bad training input fails before any Ray work, with a message that names the problem and the fix."""
from __future__ import annotations

import importlib.util

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale import config as config_mod
from clusterscale.config import ConfigError
from clusterscale.io.rundir import StageMissingError
from clusterscale.io.layout import TrainDataError
from clusterscale.pipeline import run_stage
from tests.train_data import make_sharded_run, train_overrides


def _cfg(model: str, *extra: str, k: int = 4, global_batch_size: int = 16):
    return config_mod.load(None, train_overrides(model, k, global_batch_size) + list(extra))


def test_batch_not_divisible_by_workers(tiny_model):
    with pytest.raises(ConfigError, match=r"global_batch_size \(15\) must be divisible by train.num_workers \(2\)"):
        _cfg(tiny_model, global_batch_size=15)


def test_batch_larger_than_every_cluster(tmp_path, tiny_model):
    run = make_sharded_run(tmp_path / "run", global_batch_size=64)  # shards of 40 rows
    with pytest.raises(TrainDataError, match="larger than every shard .largest 40 rows.: lower it or cluster.k"):
        run_stage("train", _cfg(tiny_model, global_batch_size=64), run)


def test_batch_size_other_than_planned_by_shard(tmp_path, tiny_model):
    run = make_sharded_run(tmp_path / "run", global_batch_size=16)
    with pytest.raises(TrainDataError, match="planned for train.global_batch_size=16, not 32"):
        run_stage("train", _cfg(tiny_model, global_batch_size=32), run)


def test_missing_shards_names_the_verb(tmp_path, tiny_model):
    from clusterscale.io.rundir import RunDir

    with pytest.raises(StageMissingError, match="run `clusterscale shard`"):
        run_stage("train", _cfg(tiny_model), RunDir(str(tmp_path / "empty")))


def test_missing_manifest_or_shard_file(tmp_path, tiny_model):
    run = make_sharded_run(tmp_path / "a")
    run.remove("shards/k=4/manifest.json")
    with pytest.raises(StageMissingError, match="manifest.json is missing.*`clusterscale shard --run-dir .* --replace`"):
        run_stage("train", _cfg(tiny_model), run)
    run = make_sharded_run(tmp_path / "b")
    run.remove("shards/k=4/cluster=2/part-00001.parquet")
    with pytest.raises(StageMissingError, match="cluster=2/part-00001.parquet is missing.*`clusterscale shard "):
        run_stage("train", _cfg(tiny_model), run)


def test_manifest_from_another_k(tmp_path, tiny_model):
    run = make_sharded_run(tmp_path / "run")
    manifest = run.read_json("shards/k=4/manifest.json")
    run.write_json("shards/k=4/manifest.json", manifest | {"k": 8})
    with pytest.raises(TrainDataError, match="written for cluster.k=8, not cluster.k=4"):
        run_stage("train", _cfg(tiny_model), run)


def test_source_sampler_needs_a_source_column(tmp_path, tiny_model):
    run = make_sharded_run(tmp_path / "a", with_source=False)
    with pytest.raises(TrainDataError, match="needs a `source` column.*data.source_column"):
        run_stage("train", _cfg(tiny_model, "train.sampler=source"), run)
    run = make_sharded_run(tmp_path / "b")
    for f in run.files("shards/k=4"):
        table = pq.read_table(f)
        pq.write_table(table.set_column(table.schema.get_field_index("source"), "source",
                                        pa.nulls(table.num_rows, pa.string())), f)
    done = run.read_json("shards/k=4/_DONE.json")
    run.write_json("shards/k=4/_DONE.json", done | {"files": run.listed_files("shards/k=4")})  # rewritten so on purpose
    with pytest.raises(TrainDataError, match="every row's `source` is empty"):
        run_stage("train", _cfg(tiny_model, "train.sampler=source"), run)


def test_source_strata_smaller_than_a_batch(tmp_path, tiny_model):
    run = make_sharded_run(tmp_path / "run", k=2, global_batch_size=48)  # 2 shards of 80, sources of 40
    with pytest.raises(ConfigError, match="sampler=source finds no stratum with a full global batch of 48"):
        run_stage("train", _cfg(tiny_model, "train.sampler=source", k=2, global_batch_size=48), run)


def test_resume_without_an_earlier_run(tmp_path, tiny_model):
    run = make_sharded_run(tmp_path / "run")
    with pytest.raises(StageMissingError, match="--resume: no earlier run"):
        run_stage("train", _cfg(tiny_model), run, resume=True)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_without_the_package(tmp_path, tiny_model):
    run = make_sharded_run(tmp_path / "run")
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        run_stage("train", _cfg(tiny_model, "train.tensorboard=true"), run)


def test_bad_knob_values():
    with pytest.raises(ConfigError, match="train.sampler must be one of clustered, random, random_clusters, source"):
        config_mod.load(None, ["train.sampler=topics"])
    with pytest.raises(ConfigError, match="train.grad_cache_chunk must be >= 0"):
        config_mod.load(None, ["train.grad_cache_chunk=-1"])
    with pytest.raises(ConfigError, match="train.cluster_weighting must be one of proportional, uniform"):
        config_mod.load(None, ["train.cluster_weighting=sqrt"])

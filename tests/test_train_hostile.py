"""Hostile input on the training side (round 5's probe, on a tiny run): values and folders that trained something
useless or wrong with exit 0, or failed in a worker after Ray Train started, are refused on the driver, naming the
key. Ray-free: each check runs before any worker does."""
from __future__ import annotations

import json
import shutil

import pytest

from clusterscale import config, pipeline
from clusterscale.config import ConfigError
from clusterscale.io.layout import NEGATIVES, train_dir
from clusterscale.io.negatives import mine_fingerprint
from clusterscale.io.rundir import RunDir
from clusterscale.stages import train as train_stage


@pytest.mark.parametrize("key, value, said", [
    ("train.weight_decay", "-1", "train.weight_decay"),  # torch refused it in every worker, ~19 s in
    ("train.seed", "-1", "train.seed"),  # numpy refused it in the prefetch thread
    ("train.name", "frozen", "train.name=frozen is the name of the frozen encoder's evaluation"),
])
def test_values_a_worker_refused_are_refused_at_load(key, value, said):
    with pytest.raises(ConfigError, match=said):
        config.load(None, [f"{key}={value}"])


def test_a_prompt_may_hold_a_newline_but_not_a_nul():
    """Instruction-tuned embedders' prompts span lines ("Instruct: ...\\nQuery: "); a path still may not."""
    cfg = config.load(None, ["train.query_prompt=Instruct: find passages\nQuery: ", "embed.query_prompt=a\tb\n"])
    assert cfg.train.student.query_prompt == "Instruct: find passages\nQuery: "
    with pytest.raises(ConfigError, match="NUL|control character"):
        config.load(None, ["train.query_prompt=a\x00b"])
    with pytest.raises(ConfigError, match="newline"):
        config.load(None, ["data.path=/data/a\nb.parquet"])


def test_a_student_folder_is_checked_before_ray_train_starts(tmp_path, tiny_model):
    """train.init: a folder that is not there, or that holds weights but no tokenizer files (AutoTokenizer made a
    5-token vocabulary of it and the model trained to NDCG 0.04, exit 0), or a Matryoshka dimension not below the
    model's: refused on the driver, naming the key."""
    def check(*keys: str) -> None:
        train_stage.check_student(config.load(None, list(keys)).train)

    check(f"train.init={tiny_model}")  # a whole folder: fine
    with pytest.raises(ConfigError, match=rf"train.init={tmp_path}/nope: The folder .* does not exist"):
        check(f"train.init={tmp_path}/nope")
    no_tokenizer = tmp_path / "weights-only"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{tiny_model}/{name}", no_tokenizer / name)
    with pytest.raises(ConfigError, match=r"train.init=.*weights-only: No usable tokenizer .*none of tokenizer.json"):
        check(f"train.init={no_tokenizer}")
    with pytest.raises(ConfigError, match=r"train.tokenizer=.*weights-only: No usable tokenizer"):
        check("train.init=scratch", f"train.tokenizer={no_tokenizer}")
    with pytest.raises(ConfigError, match=r"train.matryoshka_dims holds 64, not below the 32 dimensions"):
        check(f"train.init={tiny_model}", "train.matryoshka_dims=[16, 64]")


def test_resume_with_another_config_is_refused_naming_the_keys(tmp_path):
    """`train --resume --set train.lr=5e-3` continued the checkpoint's schedule and recorded lr 0.005: refused."""
    run = RunDir(str(tmp_path / "run"))
    started = config.load(None, ["train.lr=1e-3"])
    fingerprint = pipeline.STAGES["train"].fingerprint_of(started, run)
    run.write_json(f"{train_dir('s')}/_ATTEMPT.json", {"fingerprint": str(fingerprint),
                                                       "covers": json.loads(json.dumps(fingerprint.values))})
    train_stage._check_resumed_config(run, "s", fingerprint)  # the same config: resumes
    changed = pipeline.STAGES["train"].fingerprint_of(config.load(None, ["train.lr=5e-3"]), run)
    with pytest.raises(ConfigError, match=r"--resume: train/s was started with another config \(changed: train.lr "
                                          r"0.001 -> 0.005\)"):
        train_stage._check_resumed_config(run, "s", changed)
    run.write_json(f"{train_dir('s')}/_ATTEMPT.json", {"fingerprint": "0123"})  # recorded before `covers` was
    with pytest.raises(ConfigError, match=r"changed: unknown"):
        train_stage._check_resumed_config(run, "s", changed)


def test_more_negatives_than_mine_kept_is_said(tmp_path, capsys):
    run = RunDir(str(tmp_path / "run"))
    cfg = config.load(None, ["train.negatives_per_query=40"])
    run.mark_done(NEGATIVES, mine_fingerprint(cfg, run), {"rows": 268, "negatives_per_query": 0.1,
                                                          "without_negatives": 263})
    train_stage._check_negatives(cfg, run)
    out = capsys.readouterr().out
    assert "train.negatives_per_query=40, but mine kept 0.1 per query on average (263 of 268 queries with none" in out


def test_a_run_without_held_out_pairs_does_not_evaluate():
    """data.heldout_fraction=0 trained, then evaluate failed with a traceback: `run` leaves evaluate out."""
    assert "evaluate" not in pipeline.pipeline(config.load(None, ["data.heldout_fraction=0"]))
    assert "evaluate" in pipeline.pipeline(config.load(None, []))


def test_a_batch_larger_than_every_pair_is_said_as_such():
    """268 pairs and a global batch of 400: the advice was shard.small_cluster_policy=pool, which cannot help."""
    import numpy as np

    from clusterscale.stages.shards import ClusteringError, plan_small_clusters

    counts, centroids = np.array([69, 67, 66, 66]), np.eye(4, dtype=np.float32)
    for policy in ("merge", "pool"):
        with pytest.raises(ClusteringError, match=r"The 268 training pairs are fewer than one global batch "
                                                  r"\(train.global_batch_size=400\): lower train.global_batch_size"):
            plan_small_clusters(counts, centroids, 400, policy)

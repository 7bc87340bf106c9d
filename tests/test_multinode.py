"""More than one node: the pipeline on a multi-node Ray cluster on this machine, its outputs against a single-node run
of the same config, and a worker node lost in the middle of a stage.

The cluster is Ray's own multi-node test harness (ray.cluster_utils.Cluster, run by tests/multinode_cluster.py in a
process of its own): a head that offers no CPU (the driver's node: no work runs beside it) and two worker nodes of
two CPUs each, every node a raylet of its own, token auth on. `clusterscale` joins it through RAY_ADDRESS, as on a
real cluster. Removing a node kills its raylet and its workers, which is how a lost spot node looks to Ray; a
replacement joins right after, as an autoscaler would add one. One cluster serves the module; it stops with the
processes it started (never with `ray stop`, which would stop every Ray on the machine).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale import config as config_mod
from clusterscale.io.layout import batches_path
from clusterscale.io.rundir import RunDir
from clusterscale.runtime.nodes import TEST_UNIT_DELAY_ENV
from tests.conftest import make_pairs, tiny_overrides

REPO = Path(__file__).resolve().parents[1]
K, TRAIN = 4, "train/clustered-seed0"
# Exact dedup (the input repeats 20 pairs) and one mined negative per query: every stage of the pipeline runs.
# Checkpoints every 2 of the 6 steps and two restarts: a lost node costs training at most 2 steps.
# Embed units of a fixed size: the same unit plan (so the same batches) as the single-node run; two encoders (one per
# worker node), not one per CPU: each loads the model. Both sides embedded: mine takes the queries' vectors from
# assign/ (with embed.side=passage it loads the encoder again, and encodes the queries twice: ~20 s a run here).
EXTRA = ["ray.shared_run_dir=true", "dedup.exact=true", "train.negatives_per_query=1", "embed.rows_per_unit=36",
         "embed.num_actors=2", "embed.side=both", "train.checkpoint_every_steps=2", "train.max_failures=2",
         "eval.num_distractors=50"]
WORKED_ON = ("embeddings", f"assign/k={K}", f"shards/k={K}", TRAIN)  # each spreads its work over both nodes


class MultiNode:
    """The cluster of tests/multinode_cluster.py (its own process, token auth on), driven through its stdin."""

    def __init__(self, delay_file: Path, temp_dir: str):
        self.delay_file = delay_file  # runtime.nodes.TEST_UNIT_DELAY_ENV: {stage: seconds per unit} while written
        env = {**os.environ, "RAY_AUTH_MODE": "token", TEST_UNIT_DELAY_ENV: str(delay_file),
               "PYTHONPATH": str(REPO)}  # the nodes' workers inherit the hook and this checkout
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "multinode_cluster.py"), temp_dir], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        address = self._answer()["address"]
        self.workers: list[str] = []
        # A driver's environment: token auth on, RAY_ADDRESS names the head (not the hook: the driver runs no unit).
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": address, "PYTHONPATH": str(REPO)}

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("CLUSTER "):
                return json.loads(line.removeprefix("CLUSTER "))
        raise RuntimeError(f"the test cluster's process ended (exit {self.proc.wait()})")

    def _command(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def add_worker(self) -> str:
        """One more worker node (a lost node's replacement, as an autoscaler would add); its node id."""
        node = self._command("add")["added"]
        self.workers.append(node)
        return node

    def remove_worker(self, node: str) -> None:
        """Kill that worker node's raylet and workers at once (a lost spot node)."""
        self._command(f"remove {node}")
        self.workers.remove(node)

    def stop(self) -> None:
        try:
            self._command("quit")
        except (OSError, RuntimeError):
            pass
        self.proc.wait(timeout=60)

    def slow(self, seconds_per_unit: dict[str, float]) -> None:
        self.delay_file.write_text(json.dumps(seconds_per_unit))


@pytest.fixture(scope="module")
def multinode(tmp_path_factory):
    delay_file = tmp_path_factory.mktemp("hook") / "unit_delay.json"
    temp_dir = tempfile.mkdtemp(prefix="csmn-", dir="/tmp")  # short: Ray's socket paths are length-limited
    nodes = MultiNode(delay_file, temp_dir)
    try:
        for _ in range(2):
            nodes.add_worker()
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> str:
    table = make_pairs(300)
    path = tmp_path_factory.mktemp("mn-data") / "pairs.parquet"
    pq.write_table(pa.concat_tables([table, table.slice(0, 20)]), path)  # 20 exact duplicates for dedup
    return str(path)


def overrides(tiny_model: str, pairs_file: str) -> list[str]:
    return tiny_overrides(tiny_model, pairs_file) + EXTRA


def clusterscale(multinode: MultiNode, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterscale.cli", *args], env=multinode.env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def multinode_run(multinode, tiny_model, pairs_file, tmp_path_factory) -> RunDir:
    run_dir = tmp_path_factory.mktemp("mn-run") / "run"
    # Units of a few hundred tiny rows take milliseconds: the actors that start first would take them all, on one
    # node. A short wait per unit (the test hook) makes them last long enough for every actor to take its share.
    multinode.slow({"embed": 0.5, "assign": 0.3, "shard": 0.3})
    try:
        done = clusterscale(multinode, "run", "--run-dir", str(run_dir), "--set",
                            *overrides(tiny_model, pairs_file), timeout=480)
    finally:
        multinode.delay_file.unlink(missing_ok=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return RunDir(str(run_dir))


@dataclass(frozen=True)
class SingleNode:
    run: RunDir  # ingest to mine
    batches: list[list[tuple[int, list[int]]]]  # drawn_batches' form: what each rank's training draws


@pytest.fixture(scope="module")
def single_node_run(ray_local, tiny_model, pairs_file, tmp_path_factory) -> SingleNode:
    """The same config on the suite's local one-node Ray, ingest to mine (evaluate and report compare nothing), and
    the batches its training would draw: each rank's rows of every step, read by the trainer's own reader
    (TrainData.rank_rows, whose pair_ids are what train.log_batches logs) from this run's shards and negatives. A
    Ray Train fit here (~20 s) would only add the logging of those same rows."""
    from clusterscale import pipeline
    from clusterscale.train.trainer import SegmentJob, TrainData

    cfg = config_mod.load(None, overrides(tiny_model, pairs_file))
    run = RunDir(str(tmp_path_factory.mktemp("sn-run") / "run"))
    pipeline.run_stages(cfg, run, pipeline.pipeline(cfg, last="mine"))
    steps = cfg.train.schedule.steps
    data = TrainData(SegmentJob(cfg, run, run, TRAIN.removeprefix("train/"), steps, 0, 0, steps, resume=False))
    batches = [[(item.batch.step, item.table.column("pair_id").to_pylist()) for item in data.rank_rows(0, rank, 2)]
               for rank in (0, 1)]
    return SingleNode(run, batches)


def embeddings(run: RunDir) -> dict[int, np.ndarray]:
    table = pq.read_table(run.files("embeddings"), columns=["pair_id", "emb"])
    ids = table.column("pair_id").to_pylist()
    assert len(ids) == len(set(ids)), "a pair_id twice in embeddings/"
    vectors = np.asarray(table.column("emb").combine_chunks().flatten(), dtype=np.float32).reshape(len(ids), -1)
    return dict(zip(ids, vectors))


def shard_pair_ids(run: RunDir) -> list[list[int]]:
    """pair_ids of each cluster shard of the manifest, in file and row order."""
    manifest = run.read_json(f"shards/k={K}/manifest.json")
    return [pq.read_table([run.path(f) for f in c["files"]], columns=["pair_id"]).column("pair_id").to_pylist()
            for c in manifest["clusters"]]


def drawn_batches(run: RunDir) -> list[list[tuple[int, list[int]]]]:
    return [[(r["step"], r["pair_ids"]) for r in map(json.loads, run.read_bytes(batches_path("clustered-seed0", rank))
                                                    .decode().splitlines())] for rank in (0, 1)]


def negatives(run: RunDir) -> dict[int, list[int]]:
    buckets = [f for f in run.files("negatives") if os.path.dirname(f) == run.path("negatives")
               and os.path.basename(f).startswith("part-")]  # mine's bucket files, not the padding pool or sidecars
    table = pq.read_table(buckets, columns=["pair_id", "neg_pair_ids"])
    return dict(zip(table.column("pair_id").to_pylist(), table.column("neg_pair_ids").to_pylist()))


def test_every_stage_runs_and_spreads_over_the_worker_nodes(multinode, multinode_run):
    run, workers = multinode_run, set(multinode.workers)
    for folder in ("pairs", "embeddings", f"kmeans/k={K}", f"assign/k={K}", "dedup", f"shards/k={K}", "negatives",
                   TRAIN):
        assert run.exists(folder, "_DONE.json"), folder
    assert run.exists("eval/clustered-seed0.json") and run.exists("report/report.md")
    for folder in WORKED_ON:
        nodes = run.done_stats(folder)["nodes"]
        assert len(nodes) >= 2 and set(nodes) <= workers, (folder, nodes, workers)  # never the CPU-less head
    for folder in (f"kmeans/k={K}", "dedup", "negatives"):
        assert set(run.done_stats(folder)["nodes"]) <= workers and run.done_stats(folder)["nodes"], folder
    costs = run.read_json("report/costs.json")
    assert costs["embed"]["num_nodes"] >= 2 and costs["train:clustered-seed0"]["num_nodes"] >= 2
    assert run.done_stats("dedup")["exact"] >= 1  # the repeated pairs went


def test_outputs_equal_a_single_node_run(multinode_run, single_node_run):
    multi, single = multinode_run, single_node_run.run
    got, want = embeddings(multi), embeddings(single)
    assert sorted(got) == sorted(want)
    assert max(float(np.abs(got[i] - want[i]).max()) for i in want) <= 1e-6
    fit_multi, fit_single = (r.read_json(f"kmeans/k={K}/fit_stats.json") for r in (multi, single))
    assert fit_multi["objective"] == pytest.approx(fit_single["objective"], rel=1e-6)
    assert shard_pair_ids(multi) == shard_pair_ids(single)
    assert negatives(multi) == negatives(single)
    assert drawn_batches(multi) == single_node_run.batches


def copy_run(run: RunDir, dest: Path, *folders: str) -> RunDir:
    """A new run directory holding `folders` of `run` (with their done markers) and its config."""
    dest.mkdir(parents=True)
    shutil.copy(run.path("config.yaml"), dest / "config.yaml")
    for folder in folders:
        shutil.copytree(run.path(folder), dest / folder)
    return RunDir(str(dest))


def lose_a_node_during(multinode: MultiNode, args: list[str], started, seconds_per_unit: float, stage: str,
                       rerun: tuple[str, ...] = (), timeout: float = 240) -> tuple[str, str]:
    """Run `clusterscale *args`, each unit of `stage` slowed down; once `started()` (the stage is past its first
    unit) remove a worker node, then let a replacement join. Returns how the stage ended: ("by itself", log), or
    ("after a rerun", the logs of both) when the command failed as it must and `clusterscale *args *rerun` finished."""
    multinode.slow({stage: seconds_per_unit})
    try:
        with tempfile.TemporaryFile("w+") as out:
            proc = subprocess.Popen([sys.executable, "-m", "clusterscale.cli", *args], env=multinode.env, stdout=out,
                                    stderr=subprocess.STDOUT, text=True, cwd=REPO)
            deadline = time.time() + timeout
            while not started() and proc.poll() is None and time.time() < deadline:
                time.sleep(0.05)
            out.seek(0)
            assert proc.poll() is None, f"{stage} ended before a node could be lost:\n{out.read()[-3000:]}"
            lost = multinode.workers[0]
            multinode.remove_worker(lost)
            multinode.delay_file.unlink()  # the units after the loss need no slowing down: the rest runs at full speed
            multinode.add_worker()
            try:
                status = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                status = proc.wait()
            out.seek(0)
            log = out.read()
            assert status in (0, 2), f"{stage} after a lost node: exit {status} (-9: it hung)\n{log[-4000:]}"
        if status == 0:
            return "by itself", log
        # Ray could not finish: the command ends with one paragraph naming the node and the rerun, exit 2 (not 1 with
        # a traceback of its own; Ray's forwarded worker logs above it may hold theirs), then the rerun finishes.
        last = log.strip().splitlines()[-1]
        assert status == 2 and last.startswith(f"error: {stage}: Ray node {lost} ") and "Rerun" in last, log[-4000:]
    finally:
        multinode.delay_file.unlink(missing_ok=True)
    again = clusterscale(multinode, *args, *rerun, timeout=timeout)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    return "after a rerun", log + again.stdout


def test_a_node_lost_during_embed(multinode, multinode_run, tmp_path):
    run = copy_run(multinode_run, tmp_path / "run", "pairs", "heldout", "quarantine")
    how, log = lose_a_node_during(multinode, ["embed", "--run-dir", run.uri], lambda: bool(run.files("embeddings")),
                                  seconds_per_unit=1.5, stage="embed")
    print(f"embed finished {how} after the loss of a node")
    want = embeddings(multinode_run)
    got = embeddings(run)  # every file under its final name is whole (Parquet reads it), no pair_id twice
    assert sorted(got) == sorted(want)  # every pair once: rows in = rows out
    assert max(float(np.abs(got[i] - want[i]).max()) for i in want) <= 1e-6
    assert run.done_stats("embeddings")["rows"] == run.done_stats("pairs")["pairs"] == len(got)


# Ray Train V2 keeps the checkpoints it has registered in this file of its run's storage (ray/train/v2/_internal:
# constants.CHECKPOINT_MANAGER_SNAPSHOT_FILENAME, written by checkpoint_manager.register_checkpoint).
RAY_TRAIN_SNAPSHOT = ("ray", "ray-train", "checkpoint_manager_snapshot.json")


def registered_checkpoint(run: RunDir) -> str | None:
    """The folder of the latest checkpoint Ray Train has registered for training (None before the first).

    A checkpoint's files (its cursor.json) are in storage as soon as rank 0 has uploaded them, but Ray Train restarts a
    failed worker group from the checkpoints its controller has registered, which it does when it next polls the
    workers (every 2 s) and then records in this snapshot. A node lost in between restarts training from the
    checkpoint before (from step 0 after the first): so the test waits for the snapshot to name one."""
    path = run.path(TRAIN, *RAY_TRAIN_SNAPSHOT)
    try:
        with open(path) as f:
            latest = json.load(f).get("latest_checkpoint_result")
    except (OSError, ValueError):  # not written yet, or being written (Ray writes it in place)
        return None
    return latest and latest.get("checkpoint_dir_name")


def test_a_node_lost_during_training_resumes_from_its_checkpoint(multinode, multinode_run, tmp_path):
    run = copy_run(multinode_run, tmp_path / "run", "pairs", "heldout", "quarantine", "embeddings", "kmeans",
                   "assign", "dedup", "shards", "negatives")

    def checkpointed() -> bool:
        return registered_checkpoint(run) is not None

    how, log = lose_a_node_during(multinode, ["train", "--run-dir", run.uri], checkpointed, seconds_per_unit=2.0,
                                  stage="train", rerun=("--resume",))
    print(f"train finished {how} after the loss of a node")
    assert how == "by itself" or "--resume" in log
    assert "resuming at step" in log  # from the checkpoint, not from step 0
    assert drawn_batches(run) == drawn_batches(multinode_run)  # the same batches as without the loss
    assert run.done_stats(TRAIN)["steps"] == 6 and run.exists(TRAIN, "model", "model.safetensors")


def kept_and_removed(run: RunDir) -> tuple[list[int], list[int]]:
    kept = pq.read_table(run.files("dedup/kept"), columns=["pair_id"]).column("pair_id").to_pylist()
    removed = pq.read_table(run.files("dedup/removed"), columns=["pair_id"]).column("pair_id").to_pylist()
    return sorted(kept), sorted(removed)


@pytest.mark.parametrize("stage, folder, inputs", [
    ("dedup", "dedup/kept", ("embeddings", "kmeans", "assign")),
    ("shard", f"shards/k={K}", ("embeddings", "kmeans", "assign", "dedup")),
])
def test_a_node_lost_during_a_shuffle_stage(multinode, multinode_run, tmp_path, stage, folder, inputs):
    """dedup and shard group rows by a hash shuffle (map outputs on the nodes' disks, even at this size): after a lost
    node they finish by themselves or the rerun does, with the very output of the run that lost no node (whose
    shuffles went through the object store)."""
    run = copy_run(multinode_run, tmp_path / "run", "pairs", "heldout", "quarantine", *inputs)
    args = [stage, "--run-dir", run.uri, "--set", "ray.disk_shuffle_min_mib=0"]
    how, _ = lose_a_node_during(multinode, args, lambda: bool(run.files(folder)),
                                seconds_per_unit=1.0, stage=stage)
    print(f"{stage} finished {how} after the loss of a node")
    if stage == "dedup":
        kept, removed = kept_and_removed(run)
        assert (kept, removed) == kept_and_removed(multinode_run)
        assert len(kept) + len(removed) == len(set(kept + removed)) == run.done_stats(f"assign/k={K}")["rows"]
    else:
        got = shard_pair_ids(run)  # per cluster shard, in row order: each pair once, none lost
        assert got == shard_pair_ids(multinode_run)
        assert sum(map(len, got)) == len({i for ids in got for i in ids}) == run.done_stats("dedup/kept")["rows"]

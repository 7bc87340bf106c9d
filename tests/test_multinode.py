"""More than one node: the pipeline on a multi-node Ray cluster on this machine, a worker node lost in the middle of
each of embed, dedup, shard, mine and train, and its outputs against a single-node run of the same config.

The cluster is Ray's own multi-node test harness (ray.cluster_utils.Cluster, run by tests/multinode_cluster.py in a
process of its own): a head that offers no CPU (the driver's node: no work runs beside it) and two worker nodes of
two CPUs each, every node a raylet of its own, token auth on. `clusterscale run` joins it through RAY_ADDRESS, as on
a real cluster. Removing a node kills its raylet and its workers, which is how a lost spot node looks to Ray; a
replacement joins right after, as an autoscaler would add one. One run loses a node in each of the five stages (one
run, not one per stage: each command and each pipeline on this cluster costs a minute here), and must still finish
by itself or through the rerun its error names, with the single-node run's very outputs. One cluster serves the
module; it stops with the processes it started (never with `ray stop`, which would stop every Ray on the machine).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
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
         "train.num_workers=2",
         "eval.num_distractors=50"]
WORKED_ON = ("embeddings", f"assign/k={K}", f"shards/k={K}", TRAIN)  # each spreads its work over both nodes
# A worker node is lost in each of these stages of the multi-node run, in pipeline order: once the stage has started
# LOSE_AFTER_UNITS units over all nodes (the test hook's count; a unit of the victim node is then finished), and for
# train once Ray Train has registered a checkpoint. Their output folders (done markers) by stage:
LOSSES = {"embed": "embeddings", "dedup": "dedup", "shard": f"shards/k={K}", "mine": "negatives", "train": TRAIN}
LOSE_AFTER_UNITS = {"embed": 4, "dedup": 3, "shard": 4, "mine": 3}
# Seconds per unit (runtime.nodes.TEST_UNIT_DELAY_ENV): units of a few hundred tiny rows take milliseconds, so the
# actors that start first would take them all, on one node, and a stage would end before a node could be lost. A
# stage's delay goes once its node is lost: the rest runs at full speed.
DELAYS = {"embed": 1.0, "assign": 0.3, "dedup": 1.0, "shard": 0.5, "mine": 0.5, "train": 2.0}


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
        self.workers: list[str] = []  # alive now
        self.joined: list[str] = []  # every worker node that ever joined
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
        self.joined.append(node)
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

    def units_started(self, stage: str) -> Counter:
        """{node id: units of `stage` started there} while slowed (the hook's `.units` file)."""
        try:
            lines = Path(f"{self.delay_file}.units").read_text().splitlines()
        except OSError:
            return Counter()
        return Counter(node for name, _, node in (line.partition(" ") for line in lines) if name == stage)


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


# Ray Train V2 keeps the checkpoints it has registered in this file of its run's storage (ray/train/v2/_internal:
# constants.CHECKPOINT_MANAGER_SNAPSHOT_FILENAME, written by checkpoint_manager.register_checkpoint).
RAY_TRAIN_SNAPSHOT = ("ray", "ray-train", "checkpoint_manager_snapshot.json")


def registered_checkpoint(run: RunDir) -> str | None:
    """The folder of the latest checkpoint Ray Train has registered for training (None before the first).

    A checkpoint's files (its cursor.json) are in storage as soon as rank 0 has uploaded them, but Ray Train restarts a
    failed worker group from the checkpoints its controller has registered, which it does when it next polls the
    workers and then records in this snapshot. A node lost in between restarts training from the checkpoint before
    (from step 0 after the first): so the test waits for the snapshot to name one."""
    path = run.path(TRAIN, *RAY_TRAIN_SNAPSHOT)
    try:
        with open(path) as f:
            latest = json.load(f).get("latest_checkpoint_result")
    except (OSError, ValueError):  # not written yet, or being written (Ray writes it in place)
        return None
    return latest and latest.get("checkpoint_dir_name")


@dataclass
class MultiNodeRun:
    """The run of the pipeline on the cluster, a worker node lost in each stage of LOSSES; per stage, the node lost
    and how the stage ended: "by itself", or "after a rerun" (the command failed with the paragraph, exit 2)."""
    run: RunDir
    lost: dict[str, str] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)
    log: str = ""
    started: float = field(default_factory=time.time)

    def note(self, line: str) -> None:
        """A line of the timeline (the commands' output and the nodes lost, in seconds since the start) kept beside
        the run directory: where a slow or failed run spent its time."""
        with open(f"{self.run.uri}.timeline.log", "a") as f:
            f.write(f"{time.time() - self.started:6.1f}s {line.rstrip()}\n")


def read_lines(stream, lines: list[str], record: MultiNodeRun) -> None:
    """Read a command's output into `lines` and the run's timeline."""
    for line in stream:
        lines.append(line)
        record.note(line)


def victim(multinode: MultiNode, run: RunDir, stage: str) -> str | None:
    """The worker node to lose in `stage` now, or None while the stage is not far enough yet: the node that started
    most of its units once LOSE_AFTER_UNITS have started, a rank's node once training has a registered checkpoint."""
    if stage == "train":
        return multinode.workers[0] if registered_checkpoint(run) else None
    started = multinode.units_started(stage)
    if sum(started.values()) < LOSE_AFTER_UNITS[stage]:
        return None
    alive = [(count, node) for node, count in started.items() if node in multinode.workers]
    return max(alive)[1] if alive else None


def lose_nodes_while(multinode: MultiNode, proc: subprocess.Popen, record: MultiNodeRun, todo: list[str],
                     deadline: float) -> None:
    """While `proc` runs, lose a worker node in each stage of `todo` in turn (popped once lost), a replacement
    joining right after; the stage's slowing goes with its node."""
    delays = {stage: s for stage, s in DELAYS.items() if stage not in record.lost}
    while todo and proc.poll() is None and time.time() < deadline:
        stage = todo[0]
        node = victim(multinode, record.run, stage)
        if node is None:
            assert not record.run.exists(LOSSES[stage], "_DONE.json"), f"{stage} ended before a node could be lost"
            time.sleep(0.05)
            continue
        multinode.remove_worker(node)
        record.note(f"[test] lost worker node {node} in {stage}")
        # Checked after the kill: the stage was still running when its node went.
        assert not record.run.exists(LOSSES[stage], "_DONE.json"), f"{stage} ended before a node could be lost"
        record.lost[stage], record.ended[stage] = node, "by itself"  # unless the command fails in it
        todo.pop(0)
        delays.pop(stage)
        multinode.slow(delays)
        multinode.add_worker()
        record.note("[test] a replacement node joined")


@pytest.fixture(scope="module")
def multinode_run(multinode, tiny_model, pairs_file, tmp_path_factory) -> MultiNodeRun:
    """`clusterscale run` on the cluster (RAY_ADDRESS), hash shuffles through the nodes' disks even at this size, and
    a worker node lost in the middle of each stage of LOSSES. Where the command fails, it must be with the paragraph
    that names the node lost in that stage, exit 2; then the rerun it names (for train, `clusterscale train
    --resume`, then `run` again for the stages after) goes on, and loses nodes in the stages left."""
    run_dir = tmp_path_factory.mktemp("mn-run") / "run"
    record, todo = MultiNodeRun(RunDir(str(run_dir))), list(LOSSES)
    args = ["--run-dir", str(run_dir), "--set", *overrides(tiny_model, pairs_file), "ray.disk_shuffle_min_mib=0"]
    commands, deadline = [["run", *args]], time.time() + 900
    multinode.slow(DELAYS)
    try:
        while commands:
            command = commands.pop(0)
            proc = subprocess.Popen([sys.executable, "-m", "clusterscale.cli", *command], env=multinode.env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
            lines: list[str] = []
            record.note(f"[test] clusterscale {' '.join(command[:2])} ...")
            reader = threading.Thread(target=read_lines, args=(proc.stdout, lines, record), daemon=True)
            reader.start()
            lose_nodes_while(multinode, proc, record, todo, deadline)
            try:
                status = proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                status = proc.wait()
            reader.join(timeout=30)
            log = "".join(lines)
            record.log += log
            if status == 0:
                continue
            # Ray could not finish: one paragraph naming the node lost in that stage and the rerun, exit 2 (not 1 with a
            # traceback of its own; Ray's forwarded worker and raylet logs around it may hold theirs).
            last = ([line for line in log.splitlines() if line.startswith("error: ")] or [""])[-1]
            failed = next((s for s, node in record.lost.items() if last.startswith(f"error: {s}: Ray node {node} ")),
                          None)
            assert status == 2 and failed and "Rerun" in last and record.ended[failed] == "by itself", log[-4000:]
            record.ended[failed] = "after a rerun"
            commands = [["train", "--resume", *args], ["run", *args]] if failed == "train" else [["run", *args]]
    finally:
        multinode.delay_file.unlink(missing_ok=True)
    assert not todo, f"the run ended before a node was lost in {todo}:\n{record.log[-4000:]}"
    print("after the loss of a node: " + ", ".join(f"{s} finished {how}" for s, how in record.ended.items()))
    return record


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
    ids = table.column("pair_id").to_pylist()
    assert len(ids) == len(set(ids)), "a pair_id twice in negatives/"
    return dict(zip(ids, table.column("neg_pair_ids").to_pylist()))


def kept_and_removed(run: RunDir) -> tuple[list[int], list[int]]:
    kept = pq.read_table(run.files("dedup/kept"), columns=["pair_id"]).column("pair_id").to_pylist()
    removed = pq.read_table(run.files("dedup/removed"), columns=["pair_id"]).column("pair_id").to_pylist()
    return sorted(kept), sorted(removed)


def test_every_stage_runs_and_spreads_over_the_worker_nodes(multinode, multinode_run):
    run, workers = multinode_run.run, set(multinode.joined)
    for folder in ("pairs", "embeddings", f"kmeans/k={K}", f"assign/k={K}", "dedup", f"shards/k={K}", "negatives",
                   TRAIN):
        assert run.exists(folder, "_DONE.json"), folder
    assert run.exists("eval/clustered-seed0.json") and run.exists("report/report.md")
    for folder in WORKED_ON:
        # The nodes whose units the stage kept, and the node lost in it (it had started units, the victim rule):
        # when the other node had finished none of its units yet, the survivors redid them all.
        lost = {node for stage, node in multinode_run.lost.items() if LOSSES[stage] == folder}
        nodes = set(run.done_stats(folder)["nodes"]) | lost
        assert len(nodes) >= 2 and nodes <= workers, (folder, nodes, workers)  # never the CPU-less head
    for folder in (f"kmeans/k={K}", "dedup", "negatives"):
        assert set(run.done_stats(folder)["nodes"]) <= workers and run.done_stats(folder)["nodes"], folder
    costs = run.read_json("report/costs.json")
    assert costs["embed"]["num_nodes"] >= 2 and costs["train:clustered-seed0"]["num_nodes"] >= 2
    assert run.done_stats("dedup")["exact"] >= 1  # the repeated pairs went


def test_outputs_equal_a_single_node_run(multinode_run, single_node_run):
    """Nodes lost in embed, dedup, shard, mine and train, and still the very outputs of one node that lost none."""
    multi, single = multinode_run.run, single_node_run.run
    got, want = embeddings(multi), embeddings(single)
    assert sorted(got) == sorted(want)
    assert max(float(np.abs(got[i] - want[i]).max()) for i in want) <= 1e-6
    fit_multi, fit_single = (r.read_json(f"kmeans/k={K}/fit_stats.json") for r in (multi, single))
    assert fit_multi["objective"] == pytest.approx(fit_single["objective"], rel=1e-6)
    assert kept_and_removed(multi) == kept_and_removed(single)
    assert shard_pair_ids(multi) == shard_pair_ids(single)
    assert negatives(multi) == negatives(single)
    assert drawn_batches(multi) == single_node_run.batches


def test_a_node_lost_in_each_stage_loses_no_pair_and_duplicates_none(multinode_run):
    """Every file under its final name is whole (Parquet reads it), each pair_id once per stage: rows in = rows out;
    training resumed from its checkpoint (not step 0) with the batches of an uninterrupted run (the test above)."""
    record, run = multinode_run, multinode_run.run
    assert set(record.lost) == set(LOSSES) and len(set(record.lost.values())) == len(LOSSES)
    pairs = run.done_stats("pairs")["pairs"]
    assert run.done_stats("embeddings")["rows"] == pairs == len(embeddings(run))
    kept, removed = kept_and_removed(run)
    assert len(kept) + len(removed) == len(set(kept + removed)) == run.done_stats(f"assign/k={K}")["rows"]
    got = shard_pair_ids(run)  # per cluster shard, in row order: each pair once, none lost
    assert sum(map(len, got)) == len({i for ids in got for i in ids}) == len(kept) == run.done_stats("dedup/kept")["rows"]
    assert sorted(negatives(run)) == sorted(kept + removed)  # a query of every assigned pair
    assert "resuming at step" in record.log  # from the checkpoint, not from step 0
    assert run.done_stats(TRAIN)["steps"] == 6 and run.exists(TRAIN, "model", "model.safetensors")

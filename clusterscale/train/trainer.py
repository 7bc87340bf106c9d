"""The per-rank trainer that Ray Train runs: setup, one global step, logging and checkpointing as separate pieces.

`train_loop_per_worker` is Ray Train's entry on every worker (stages/train.py's driver starts it once per
segment of the run): it builds a Trainer and calls `fit`. The step's math is train/step.py, the metrics
all-reduce and logs train/metrics.py, the checkpoint state train/checkpoint.py.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import ray.train
import ray.train.torch as rt_torch
import torch

from clusterscale.config import Config
from clusterscale.errors import storage_error, user_error
from clusterscale.io.records import ShardManifest
from clusterscale.io.rundir import RunDir
from clusterscale.io.layout import shard_set_manifest, train_dir
from clusterscale.modeling.student import build_student, choose_packing, matmul_params
from clusterscale.runtime.nodes import this_node, unit_delay_for_tests
from clusterscale.train import schedule
from clusterscale.train.checkpoint import Checkpointer, ModelExport
from clusterscale.train.data import RankRows, ShardReader, StackedReader
from clusterscale.train.samplers import Sampler, SetShapes, sampler as get_sampler, training_sets
from clusterscale.train.metrics import MetricsProcessor, StepResult, peak_flops, reduce_step_figures
from clusterscale.train.negatives import MinedNegatives, NegativeSidecars, training_draw
from clusterscale.train.optim import build_optimizer
from clusterscale.train.step import contrastive_backward, step_seed


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's per-worker entry: this rank's share of one segment, from the plain dict the driver sent."""
    torch.set_num_threads(max(1, int(config.get("threads_per_worker", 1))))
    keep_user_faults_off_console()
    context = ray.train.get_context()
    Trainer(SegmentJob.from_loop_config(config), context.get_world_rank(), context.get_world_size()).fit()


class _UserFaultsOffConsole(logging.Filter):
    """Drops a record logged while a user fault (clusterscale.errors.user_error) is being handled: Ray Train's
    "Error in training function" and its traceback, once per rank, for an error the driver prints as one paragraph."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else sys.exc_info()[1]  # Ray Train logs inside its `except`
        return exc is None or user_error(exc) is None


def keep_user_faults_off_console() -> None:
    """Keep this worker's console quiet about user faults (a full disk, bad data): Ray Train logs a worker's error
    with its traceback before the driver hears of it. Its log files (ray-train-*-worker-*.log) keep the record; a
    bug's traceback is printed as before."""
    for handler in logging.getLogger("ray.train").handlers:  # Ray Train's dictConfig names its console handler
        if handler.get_name() == "console" and not any(isinstance(f, _UserFaultsOffConsole) for f in handler.filters):
            handler.addFilter(_UserFaultsOffConsole())


@dataclass(frozen=True)
class SegmentJob:
    """What the driver asks of every worker: the run, the steps of one segment (all steps without
    re-clustering), whether a checkpoint must exist, and a test hook."""

    cfg: Config
    run: RunDir
    shards_run: RunDir  # the run's own shards, or a re-clustering's child run directory
    name: str
    num_steps: int  # of the whole run
    segment: int
    seg_start: int
    seg_stop: int
    resume: bool  # --resume, or a segment after the first: a checkpoint must exist
    fail_at_step: int | None = None  # test hook: rank 0 fails once there, unless it restored a checkpoint
    sampler: Sampler | None = None  # the driver's train.sampler (None: looked up here by name)

    @classmethod
    def from_loop_config(cls, config: dict) -> SegmentJob:
        segment, seg_start, seg_stop = config.get("segment", (0, 0, config["num_steps"]))
        return cls(config["cfg"], RunDir(config["run_uri"]),
                   RunDir(config.get("shards_uri") or config["run_uri"]), config["name"], config["num_steps"],
                   segment, seg_start, seg_stop, bool(config.get("resume")), config.get("fail_at_step"),
                   config.get("sampler"))

    @property
    def batch_sampler(self) -> Sampler:
        """The sampler that draws the batches: the one the driver resolved and sent (so a sampler registered in
        the driver's process only still draws them), else the registered train.sampler."""
        return self.sampler or get_sampler(self.cfg.train.schedule.sampler)

    @property
    def stop_step(self) -> int:
        """The step this worker stops at: the segment's end, or train.stop_after_steps when earlier."""
        return min(self.num_steps, self.cfg.train.checkpoint.stop_after_steps or self.num_steps, self.seg_stop)

    def cursor(self) -> dict:
        """What a checkpoint must have been made with to continue this run (checkpoint.check_cursor)."""
        batches, every = self.cfg.train.schedule, self.cfg.train.shards.recluster_every
        cursor = {"num_steps": self.num_steps, "sampler": batches.sampler, "seed": batches.seed,
                  "cluster_weighting": batches.cluster_weighting, "global_batch_size": batches.global_batch_size}
        if every:
            cursor["recluster_every"] = every
        # the sampler's own keys that decide which batches come (the curriculum's ramp): a resume must keep them
        cursor |= {k: getattr(batches, k) for k in self.batch_sampler.cursor_keys}
        if self.cfg.train.objective.negatives_curriculum_steps:
            cursor["negatives_curriculum_steps"] = self.cfg.train.objective.negatives_curriculum_steps
        return cursor

    def check_start(self, start_step: int, restored: bool) -> None:
        """Refuse a start the segment cannot continue from: no checkpoint to resume, or one outside the segment."""
        name = self.name
        if not restored and self.resume and self.segment > 0:
            raise RuntimeError(f"train/{name}: segment {self.segment} (re-clustering) found no checkpoint of the "
                               f"previous segment in train/{name}/ray; delete train/{name}/ and start afresh.")
        if not restored and self.resume:
            raise RuntimeError(f"--resume: Ray Train found no checkpoint of train/{name}; start without --resume.")
        if start_step > self.stop_step:
            raise RuntimeError(f"train/{name}: the checkpoint is at step {start_step}, past this run's stop at step "
                               f"{self.stop_step} (train.stop_after_steps lowered?): raise it, or delete train/{name}/.")
        if start_step < self.seg_start:
            raise RuntimeError(f"train/{name}: the checkpoint is at step {start_step}, before segment {self.segment} "
                               f"(steps {self.seg_start}..{self.seg_stop}); delete train/{name}/ and start afresh.")


def labeled_negatives(values: list, per_query: int, draw: tuple[int, int, list[int]] | None = None
                      ) -> tuple[list[tuple[list, list]], int]:
    """Each row's `per_query` labeled negatives (data.negative_column) and their queries (unknown: None), and how many
    slots were empty: a row with fewer fills its slots with None, which the loss masks for every query
    (step.contrastive_backward), so they change no loss but keep every row at the same number of negatives.
    The row's first ones, or with draw = (seed, epoch, pair_ids) a random choice of a row with more, in its listed
    order, by (seed, epoch, pair_id): the same on every rank and on a resumed run, another each epoch."""
    rows, empty = [], 0
    for i, texts in enumerate(values):
        texts = list(texts or [])
        if draw is not None and len(texts) > per_query:
            seed, epoch, pid = draw[0], draw[1], draw[2][i]
            rng = np.random.default_rng([seed, epoch, pid >> 32, pid & 0xFFFF_FFFF, LABELED_DRAW])
            texts = [texts[j] for j in sorted(rng.choice(len(texts), per_query, replace=False))]
        texts = texts[:per_query]
        empty += per_query - len(texts)
        rows.append((texts + [None] * (per_query - len(texts)), [None] * per_query))
    return rows, empty


LABELED_DRAW = 0x1A6E1ED  # the labeled negatives' random streams, apart from the mined padding's (same seed)


class TrainData:
    """A segment's shard sets (their shards are the sampler's strata: its `sets` stacked, e.g. the curriculum's
    clustered and random sets) and its sampler's batches, the reader of a rank's rows, and the optional mined
    negatives. A rank reads the sets' manifests only: the driver checked their files."""

    def __init__(self, job: SegmentJob):
        tc = self.tc = job.cfg.train
        self.job = job
        self.manifests = [shard_set_manifest(job.shards_run, job.cfg.cluster.k, tc.schedule.global_batch_size, name,
                                             check_files=False)
                          for name in training_sets(job.batch_sampler, tc.shards.dedup)]
        self.manifest = self.manifests[-1]  # its strata set the epoch (the curriculum's: the random set's)
        self.sizes = self.manifest.strata_sizes
        self.sampler, self.shapes = job.batch_sampler, SetShapes.of(self.manifests)
        self.negatives = None
        if tc.objective.negatives_per_query:  # each row's candidates come with it; the padding pool: negatives/
            self.negatives = MinedNegatives(job.run, tc.objective.negatives_per_query, tc.schedule.seed)
        labeled = bool(tc.objective.labeled_negatives_per_query)
        readers = [ShardReader(job.shards_run, m, sidecars=self._sidecars(m), labeled_negatives=labeled)
                   for m in self.manifests]
        self.reader = readers[0] if len(readers) == 1 else StackedReader(readers)

    def _sidecars(self, manifest: ShardManifest) -> NegativeSidecars | None:
        """The reader of the set's mined negatives (this run's draw), None without them."""
        if self.negatives is None:
            return None
        return NegativeSidecars(self.job.shards_run, manifest, training_draw(self.job.cfg, manifest))

    def epoch_at(self, step: int) -> int:
        """The epoch (counted within the segment) that `step` falls in."""
        per_epoch = schedule.batches_per_epoch(self.sizes, self.tc.schedule.global_batch_size)
        return (step - self.job.seg_start) // max(1, per_epoch)

    def batches(self, start_step: int) -> Iterator[schedule.GlobalBatch]:
        """The global batches from start_step to the stop, numbered in run steps (the segment's schedule counts
        from its own start, with its own seed; a sampler that is never re-clustered has one segment)."""
        job, batches = self.job, self.tc.schedule
        for local in self.sampler.batches(batches, self.shapes, schedule.segment_seed(batches.seed, job.segment),
                                          start_step - job.seg_start, job.stop_step - job.seg_start, job.num_steps):
            yield dataclasses.replace(local, step=local.step + job.seg_start)

    def rank_rows(self, start_step: int, rank: int, world: int) -> Iterator[RankRows]:
        """This rank's contiguous slice of each global batch (pair_id, query, passage), read train.prefetch_steps
        steps ahead."""
        return self.reader.prefetch(self.batches(start_step), rank, world, depth=self.tc.compute.prefetch_steps)

    def label(self, gb: schedule.GlobalBatch) -> tuple[int | None, str]:
        """(cluster, cluster_name) of the stratum a batch came from, as metrics.jsonl records it."""
        if gb.group < 0:  # a batch of the global shuffle (the random set)
            return None, "random"
        shard = self.manifests[0].clusters[gb.shard]
        return shard.cluster, shard.name


def ranks_nodes(world: int) -> list[str]:
    """The Ray node id of every rank (gathered over the process group): the checkpoint reports carry them to the
    driver, which records where training ran (runtime/nodes.py)."""
    nodes = [this_node()] * world
    if world > 1 and torch.distributed.is_initialized():
        torch.distributed.all_gather_object(nodes, this_node())
    return nodes


class Trainer:
    """One rank's training of one segment: set up in __init__, one global step in `train_step`, `fit` to the stop."""

    def __init__(self, job: SegmentJob, rank: int, world: int):
        tc = self.tc = job.cfg.train
        self.job, self.rank, self.world = job, rank, world
        self.device = rt_torch.get_device()
        self.data = TrainData(job)
        model, self.tokenizer, pooling = build_student(tc)
        self.batching = choose_packing(model, self.tokenizer, pooling, tc.compute.packing,
                                       tc.student.passage_max_length, self.device)
        if rank == 0 and self.batching != "padded":
            print(f"[train] {self.batching} passes: a batch's texts end to end, no padding (train.packing)", flush=True)
        self.flops_params = matmul_params(model)
        self.model = rt_torch.prepare_model(model)  # MoE: idle experts stay in the graph (moe.py), no unused parameters
        self.optimizer, self.scheduler = build_optimizer(self.model, tc.optimizer, job.num_steps)
        self.pooling, self.amp = pooling, self.device.type == "cuda"  # bf16 autocast on GPU
        self.checkpointer = Checkpointer(self.model, self.optimizer, self.scheduler, job.cursor(),
                                         ModelExport(self.tokenizer, pooling, tc.student.passage_max_length,
                                                     (tc.student.query_prompt, tc.student.passage_prompt)))
        self.start_step, self.restored = self._restore()
        self.nodes = ranks_nodes(world)
        self.metrics = MetricsProcessor(job.run, job.name, tc, rank, world,
                                        peak=peak_flops(self.device, tc.compute.peak_tflops) if rank == 0 else None,
                                        resume_step=self.start_step if self.restored else None,
                                        num_steps=job.num_steps, stop_step=job.stop_step, segment=job.segment)

    def _restore(self) -> tuple[int, bool]:
        """(start step, whether a checkpoint was restored): Ray Train's latest checkpoint of this run, if any."""
        checkpoint, start_step = ray.train.get_checkpoint(), 0
        if checkpoint is not None:
            with checkpoint.as_directory() as local:
                start_step = self.checkpointer.restore(local, self.device)
        self.job.check_start(start_step, restored=checkpoint is not None)
        return start_step, checkpoint is not None

    def fit(self) -> None:
        """Train from the start step to the stop. The last report carries a checkpoint, with the exported model
        at the run's (or segment's) end; a collapsed run (train.stop_on_collapse) ends with a checkpoint only."""
        job = self.job
        if self.start_step:
            print(f"[train] rank {self.rank}: resuming at step {self.start_step}/{job.num_steps}", flush=True)
        epoch = self.data.epoch_at(self.start_step)
        for item in self.data.rank_rows(self.start_step, self.rank, self.world):
            gb = item.batch
            if job.fail_at_step == gb.step and not self.restored and self.rank == 0:
                raise RuntimeError(f"injected failure at step {gb.step} (test hook)")
            epoch = gb.epoch
            result = self.train_step(item)
            self.metrics.log(result)
            verdict = self.metrics.check(result)  # the same on every rank: they stop together
            if verdict is not None and self.tc.logging.stop_on_collapse:
                self.metrics.close()  # the driver ends the run with the verdict
                self.save(gb.step + 1, epoch, final=False, note={"collapsed": verdict})
                return
            self._report(gb.step + 1, epoch)
        self.metrics.close()
        self.save(job.stop_step, epoch, final=job.stop_step in (job.num_steps, job.seg_stop))

    def train_step(self, item: RankRows) -> StepResult:
        """One global step: this rank's rows forward and backward (the loss sees every rank's batch), gradient
        clipping, optimizer and LR step; then the figures all-reduced (with the bytes read for the rows), so every
        rank holds the same ones."""
        unit_delay_for_tests("train")
        gb, table, started = item.batch, item.table, time.time()
        torch.manual_seed(step_seed(self.tc.schedule.seed, gb.step, self.rank))  # a resume replays the dropout masks
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, stats = self._backward(table, gb.step)
        stats |= {"bytes_read": float(item.bytes_read), "bytes_used": float(item.bytes_used),
                  "footer_bytes_read": float(item.footer_bytes), "data_wait_s": item.wait_s}
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tc.optimizer.max_grad_norm)
        self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        figures = reduce_step_figures(loss, stats, self.world)
        step_s = time.time() - started
        pair_ids = table.column("pair_id").to_pylist() if self.tc.logging.log_batches else None
        return StepResult(gb, self.data.label(gb), figures, lr, float(grad_norm),
                          stats["flops_per_param_token"] * self.flops_params * figures.sums["tokens"], step_s, pair_ids)

    def _backward(self, table: pa.Table, step: int) -> tuple[torch.Tensor, dict]:
        """contrastive_backward on this rank's rows, with their labeled negatives (train.labeled_negatives_per_query)
        and mined ones (train.negatives_per_query), each row's labeled first."""
        queries, passages = table.column("query").to_pylist(), table.column("passage").to_pylist()
        step_options = {"pooling": self.pooling, "amp": self.amp}
        labeled = self.tc.objective.labeled_negatives_per_query
        mined = self.data.negatives is not None and self.tc.objective.mined_at(step)  # easy-first: not yet
        figures = {}
        if self.data.negatives is not None:  # the same figures at every step of the run
            figures["negatives_padded"] = torch.tensor(0.0)
        if not labeled and not mined:
            loss, stats = contrastive_backward(self.model, self.tokenizer, queries, passages, self.tc, self.device,
                                               **step_options)
            return loss, stats | figures
        per_row = [([], [])] * len(queries)
        if labeled:
            draw = None
            if self.tc.objective.labeled_negatives_draw == "random":
                draw = (self.tc.schedule.seed, self.data.epoch_at(step), table.column("pair_id").to_pylist())
            per_row, empty = labeled_negatives(table.column("negatives").to_pylist(), labeled, draw)
            figures["labeled_negatives_empty"] = torch.tensor(float(empty))
        if mined:
            neg_passages, neg_queries, padded = self.data.negatives.for_rows(table, step)
            m = self.tc.objective.negatives_per_query
            per_row = [(p + neg_passages[i * m:(i + 1) * m], q + neg_queries[i * m:(i + 1) * m])
                       for i, (p, q) in enumerate(per_row)]
            figures["negatives_padded"] = torch.tensor(float(padded))
        negatives = [text for p, _ in per_row for text in p]
        negative_queries = [text for _, q in per_row for text in q]
        loss, stats = contrastive_backward(self.model, self.tokenizer, queries, passages, self.tc, self.device,
                                           negatives=negatives, negative_queries=negative_queries, **step_options)
        return loss, stats | figures

    def _report(self, done: int, epoch: int) -> None:
        """After a step before the stop: a checkpoint every train.checkpoint_every_steps, else the metrics every
        logging step (Ray's dashboard and Result.metrics see them between checkpoints too)."""
        if done >= self.job.stop_step:
            return
        if self.tc.checkpoint.checkpoint_every_steps and done % self.tc.checkpoint.checkpoint_every_steps == 0:
            self.save(done, epoch, final=False)
        elif done % self.tc.logging.log_every_steps == 0:
            ray.train.report(self.metrics.report(done))

    def save(self, step: int, epoch: int, final: bool, note: dict | None = None) -> None:
        """All ranks report (a barrier); rank 0 attaches the checkpoint, with the exported model when `final`."""
        self.metrics.flush()
        directory, attached = tempfile.mkdtemp(prefix="clusterscale-ckpt-"), None
        try:  # Ray Train copies the checkpoint into storage; the local copy goes even if that fails
            if self.rank == 0:
                self.checkpointer.write(directory, step, epoch, final)
                attached = ray.train.Checkpoint.from_directory(directory)
            ray.train.report({**self.metrics.report(step), "nodes": self.nodes, **(note or {})}, checkpoint=attached)
        except OSError as exc:  # Ray Train's copy into the run directory; pyarrow's error does not name it
            raise storage_error(exc, self.job.run.path(train_dir(self.job.name), "ray")) or exc
        finally:
            shutil.rmtree(directory, ignore_errors=True)

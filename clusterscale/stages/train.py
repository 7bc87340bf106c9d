"""The train stage: Ray Train DDP, every global batch from one stratum, InfoNCE over the gathered batch.

Run with `clusterscale train [CONFIG] --run-dir R` (after `shard`); `--resume` continues a stopped or
failed run from its latest checkpoint. Writes train/<name>/: metrics.jsonl (rank 0, one line per
step), batches/rank-<r>.jsonl (train.log_batches), checkpoints (Ray Train, under ray/), model/ (the
exported encoder). The per-worker trainer is train/trainer.py. The stages training needs first (its sampler's
shard set, dedup, a segment's re-clustering) run through ctx.stage, the executor's, so each keeps its own lock,
done marker and cost record.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import time
from pathlib import Path

from clusterscale.config import Config, ConfigError, TrainConfig, variant
from clusterscale.errors import UserError
from clusterscale.io.layout import NEGATIVES, collapse_path, metrics_path, model_dir, shard_set_manifest, train_dir
from clusterscale.modeling.model_files import (EncoderLoadError, check_encoder_files, check_tokenizer_files,
                                               resolve_model_path)
from clusterscale.modeling.model_card import write_model_card
from clusterscale.io.rundir import RunDir, StageMissingError, StageResult, changed_keys
from clusterscale.runtime.nodes import node_stats
from clusterscale.runtime.resources import plan_actors
from clusterscale.runtime.stage_context import StageContext
from clusterscale.stages.dedup import train_dedup_config
from clusterscale.stages.mine_rows import sidecars_for_training
from clusterscale.runtime import interrupt
from clusterscale.train import samplers, schedule
from clusterscale.io.negatives import mine_fingerprint
from clusterscale.train import recluster
from clusterscale.train.recluster import segment_bounds, segment_dir

ATTEMPT = "_ATTEMPT.json"  # in train/<name>/: the fingerprint of the config its latest attempt started with
RAY_RUN_NAME = "ray-train"  # fixed: Ray Train resumes a run whose name and storage path it finds again
# Ray Train's controller polls every rank once per RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray's default: 2 s), so it
# sees a fit's end, or a rank's failure, up to that late: ~3.8 s of a 14-s fit here went between the last step and
# fit()'s return (0.9 s at 0.25 s). Unless the user set it, clusterscale polls at 32 ranks a second: 0.25 s up to 8
# ranks, Ray's 2 s from 64 (where a fit takes hours and each poll is one call per rank).
HEALTH_CHECK_ENV, RANK_POLLS_PER_S, POLL_BOUNDS_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 32, (0.25, 2.0)


class TrainingCollapsedError(UserError):
    """The collapse guard stopped a run (train.stop_on_collapse): the message names the likely causes."""


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """What one training run will do, worked out (and checked) before any compute is spent."""
    name: str
    num_steps: int
    stop_step: int  # train.stop_after_steps, or num_steps
    segments: list[tuple[int, int]]  # (first step, stop step) per re-clustering segment
    unused_pairs: int
    started: float

    @property
    def out(self) -> str:
        return train_dir(self.name)


def run_train(ctx: StageContext) -> StageResult:
    """Train in segments; between two segments (train.recluster_every) the pairs are re-clustered with the
    model so far, by the ordinary embed, fit, assign and shard stages into the segment's child run."""
    cfg, run = ctx.cfg, ctx.run
    if cfg.train.shards.dedup:  # the clustered shards of the kept pairs, after the dedup stage (once per clustering)
        dedup_cfg = train_dedup_config(cfg)
        ctx.stage("dedup", dedup_cfg, run)
        ctx.stage("dedup_shards", dedup_cfg, run)
    else:  # the sampler's shard sets other than the clustered shards: inputs built once per clustering
        for set_cfg in set_configs(cfg):
            if set_cfg.train.schedule.sampler != samplers.CLUSTERED:
                ctx.stage("shard_set", set_cfg, run)
    plan = plan_training(cfg, run, ctx.resume)
    if ctx.resume:
        _check_resumed_config(run, plan.name, ctx.fingerprint)
    else:  # which config this attempt trains: compare continues an attempt stopped midway (stopped_attempt)
        run.write_json(f"{train_dir(plan.name)}/{ATTEMPT}", {"fingerprint": str(ctx.fingerprint or ""), "covers":
                                                             getattr(ctx.fingerprint, "values", None)})
    if cfg.train.objective.negatives_per_query:  # the rows of the shard sets this sampler reads carry their negatives
        for set_cfg in set_configs(cfg):
            sidecars_for_training(set_cfg, run, run)
    shards_uri, recluster_s, result = run.uri, 0.0, None
    for segment in segments_to_train(run, plan):
        if segment > 0:
            started = time.time()
            shards_uri = recluster_segment(ctx, plan.name, segment).uri
            recluster_s += time.time() - started
        result = train_segment(ctx, plan, segment, shards_uri, ctx.resume or segment > 0)
    return finish_training(cfg, run, plan, result, recluster_s)


def _check_resumed_config(run: RunDir, name: str, fingerprint) -> None:
    """`train --resume` continues the attempt of train/<name>/ only with the config it started with: another one
    (train.lr changed) wrote a model no config describes (the checkpoint's schedule with the new values recorded)."""
    attempt = run.read_json(f"{train_dir(name)}/{ATTEMPT}") if run.exists(train_dir(name), ATTEMPT) else {}
    if not attempt.get("fingerprint") or not fingerprint or attempt["fingerprint"] == str(fingerprint):
        return  # an attempt from before the record: its checkpoint's own check (check_cursor) stands
    changed = changed_keys(attempt.get("covers"), json.loads(json.dumps(getattr(fingerprint, "values", None))))
    raise ConfigError(f"--resume: {train_dir(name)} was started with another config (changed: {changed}); a "
                      f"resumed training continues its checkpoint's schedule and weights, so it resumes only with the "
                      f"config it started with: drop those --set keys, or start afresh without --resume.")


def stopped_attempt(run: RunDir, name: str) -> str | None:
    """The config fingerprint of an attempt of train/<name>/ that stopped midway after Ray Train registered a
    checkpoint (and before the done marker), which `train --resume` would continue on the same batches; None when
    there is none (an attempt stopped before its first checkpoint starts afresh)."""
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    out = train_dir(name)
    snapshot = f"{out}/ray/{RAY_RUN_NAME}/{CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}"
    if run.exists(out, "_DONE.json") or not run.exists(snapshot) or not run.exists(out, ATTEMPT):
        return None
    try:  # Ray Train writes its snapshot in place: a torn read is no checkpoint yet
        registered = json.loads(run.read_bytes(snapshot)).get("latest_checkpoint_result")
    except ValueError:
        return None
    return run.read_json(f"{out}/{ATTEMPT}").get("fingerprint") if registered else None


def set_configs(cfg: Config) -> list[Config]:
    """One config per shard set the run reads, with the sampler that writes that set (the clustered shards:
    `clustered`; the curriculum reads two sets)."""
    if cfg.train.shards.dedup:
        return [cfg]
    return [cfg if name == cfg.train.schedule.sampler else variant(cfg, train={"sampler": name})
            for name in samplers.sampler(cfg.train.schedule.sampler).sets]


def recluster_segment(ctx: StageContext, name: str, segment: int) -> RunDir:
    """Embed, fit, assign and shard the training pairs with the segment's encoder into its child run directory
    (its own done markers; costs recorded in the parent run as recluster:<name>:seg-<s>:<stage>)."""
    cfg, run = ctx.cfg, ctx.run
    child = RunDir(run.child_uri(segment_dir(name, segment)))
    # A URI (or local path) every node can read: embed actors copy an object-store model locally.
    child_cfg = recluster.segment_config(cfg, run.child_uri(segment_dir(name, segment), "encoder"))
    print(f"[recluster] segment {segment}: re-embedding, re-fitting (k={cfg.cluster.k}) and re-sharding the "
          f"training pairs with the model after step {recluster.segment_start_step(cfg, segment)}", flush=True)
    for verb in ("embed", "fit", "assign", "shard"):
        ctx.stage(verb, child_cfg, child, source=run if verb == "embed" else None,
                  cost_key=f"recluster:{name}:seg-{segment}:{verb}", costs_run=run)
    if cfg.train.objective.negatives_per_query:  # the run's mined negatives, aligned to the segment's shards
        sidecars_for_training(cfg, run, child)
    return child


def plan_training(cfg: Config, run: RunDir, resume: bool) -> TrainPlan:
    """Check the shards, the negatives and the options against the config; print the warnings and the plan
    (run_train runs its segments with train_segment, then finish_training)."""
    tc, name = cfg.train, cfg.train_name()
    batches = tc.schedule
    manifests = [shard_set_manifest(run, cfg.cluster.k, batches.global_batch_size, name)  # checked, each of them
                 for name in samplers.training_sets(batches.sampler, tc.shards.dedup)]
    manifest = manifests[-1]  # its strata set the epoch (the curriculum's: the random set's)
    if tc.logging.tensorboard and (not run.is_local or importlib.util.find_spec("tensorboard") is None):
        raise ConfigError("train.tensorboard=true needs the `tensorboard` package (`pip install tensorboard`) and a "
                          "local --run-dir; set train.tensorboard=false otherwise.")
    check_student(tc)
    if tc.objective.negatives_per_query:
        _check_negatives(cfg, run)
    if tc.objective.labeled_negatives_per_query:
        _check_labeled_negatives(cfg, run, manifests)
    else:
        _note_unused_labeled_negatives(cfg, run)
    sizes = manifest.strata_sizes
    num_steps = schedule.total_steps(sizes, tc.schedule.global_batch_size, tc.schedule.epochs, tc.schedule.steps)
    if num_steps == 0 or not all(schedule.batches_per_epoch(m.strata_sizes, batches.global_batch_size)
                                 for m in manifests):  # the curriculum may draw from either set at any step
        raise ConfigError(f"train.sampler={tc.schedule.sampler} finds no stratum with a full global batch of "
                          f"{tc.schedule.global_batch_size} pairs: lower train.global_batch_size.")
    # The last set's strata count the epoch (the curriculum's: the random set's, N / batch steps), and its sampler's
    # rules the pairs it leaves out.
    unused = samplers.unused_pairs(tc.schedule.sampler, tc.schedule, sizes)
    for warning in training_warnings(tc, num_steps, unused, sum(sizes)):
        print(f"[train] warning: {warning}", flush=True)
    if resume:
        check_resumable(cfg, run)
    print(f"[train] {name}: {num_steps} steps x {batches.global_batch_size} pairs, sampler={batches.sampler} "
          f"({batches.cluster_weighting}), {tc.compute.num_workers} workers "
          f"({'GPU' if tc.compute.use_gpu else 'CPU'}); {unused} pairs unused per epoch (remainders < one global "
          f"batch)", flush=True)
    return TrainPlan(name, num_steps, min(num_steps, tc.checkpoint.stop_after_steps or num_steps),
                     segment_bounds(num_steps, tc.shards.recluster_every), unused, time.time())


def check_student(tc: TrainConfig) -> None:
    """train.init (train.tokenizer from scratch) on the driver, before Ray Train starts its workers (~20 s): a
    folder that is not there, holds no safetensors weights or no tokenizer files (AutoTokenizer then made a 5-token
    vocabulary of such a folder and trained a useless model, exit 0); a Matryoshka dimension not below a local
    model's own (hidden_size of its config.json)."""
    student = tc.student
    folder = student.tokenizer if student.init == "scratch" else student.init
    key = tc.key("tokenizer" if student.init == "scratch" else "init")
    path = resolve_model_path(folder)
    try:
        if student.init == "scratch":
            check_tokenizer_files(path)
        else:
            check_encoder_files(path)
    except EncoderLoadError as exc:
        raise ConfigError(f"{key}={folder}: {exc}") from None
    config = Path(path) / "config.json"
    if student.init != "scratch" and config.is_file():
        try:
            hidden = json.loads(config.read_text()).get("hidden_size")
        except (OSError, ValueError):
            hidden = None  # the load says what is wrong with it
        too_wide = [d for d in tc.objective.matryoshka_dims if isinstance(hidden, int) and d >= hidden]
        if too_wide:
            raise ConfigError(f"{tc.key('matryoshka_dims')} holds {too_wide[0]}, not below the {hidden} dimensions of "
                              f"{key}={folder}: list only the nested ones (the full dimension always counts).")


def segments_to_train(run: RunDir, plan: TrainPlan) -> list[int]:
    """The segments this attempt trains: up to train.stop_after_steps, less those an earlier attempt finished."""
    return [segment for segment, (start, _) in enumerate(plan.segments)
            if start < plan.stop_step and not run.exists(segment_dir(plan.name, segment), "_TRAINED.json")]


def train_segment(ctx: StageContext, plan: TrainPlan, segment: int, shards_uri: str, resume: bool):
    """One Ray Train run over the steps of `segment`, on the shards under shards_uri; when another segment
    follows, the model goes to that segment's folder (the encoder its re-clustering embeds with)."""
    seg_start, seg_stop = plan.segments[segment]
    run = ctx.run
    result = _fit(ctx, plan.name, plan.num_steps, (segment, seg_start, seg_stop), shards_uri, resume)
    if len(plan.segments) > 1 and seg_stop < plan.num_steps and seg_stop <= plan.stop_step:
        _export_model(run, result.checkpoint, f"{segment_dir(plan.name, segment + 1)}/encoder")
        run.write_json(f"{segment_dir(plan.name, segment)}/_TRAINED.json", {"steps": [seg_start, seg_stop]})
    return result


def finish_training(cfg: Config, run: RunDir, plan: TrainPlan, result, recluster_s: float) -> StageResult:
    """The stage result of a training run; the model exported to train/<name>/model/ unless it stopped early."""
    tc, batches = cfg.train, cfg.train.schedule
    wall = time.time() - plan.started
    stats = {"name": plan.name, "steps": plan.num_steps, "global_batch_size": batches.global_batch_size,
             "sampler": batches.sampler, "cluster_weighting": batches.cluster_weighting,
             "unused_pairs_per_epoch": plan.unused_pairs, "wall_s": round(wall, 3),
             "worker_s": round((wall - recluster_s) * tc.compute.num_workers, 3),
             "device": "gpu" if tc.compute.use_gpu else "cpu",
             "pairs_per_s": round(plan.num_steps * batches.global_batch_size / wall, 2),
             **node_stats((result.metrics or {}).get("nodes", []) if result is not None else [])}
    if tc.objective.negatives_per_query:
        stats["mined_negatives_per_query"] = tc.objective.negatives_per_query
    if run.exists(collapse_path(plan.name)):  # train.stop_on_collapse=false: warned, went on; the report flags it
        stats["collapse_warning_at_step"] = run.read_json(collapse_path(plan.name))["step"]
    if len(plan.segments) > 1:
        stats |= {"segments": len(plan.segments), "recluster_s": round(recluster_s, 3)}
    if plan.stop_step < plan.num_steps:
        print(f"[train] stopped after step {plan.stop_step}/{plan.num_steps} (train.stop_after_steps); continue with "
              f"`clusterscale train --resume` and the same config.", flush=True)
        return StageResult(stats | {"stopped_at_step": plan.stop_step}, complete=False)
    _export_model(run, result.checkpoint, model_dir(plan.name))
    return StageResult(stats, config={"train": cfg.train.to_dict()})


def after_training(cfg: Config, run: RunDir, result: StageResult) -> None:
    """Once train/<name>/ is marked done: the model card, and the checkpoints dropped unless kept (until the
    marker exists, --resume needs them)."""
    keep, out = cfg.train.checkpoint.keep_checkpoint, train_dir(cfg.train_name())
    write_model_card(cfg, run, cfg.train_name())
    if not keep:
        run.remove(out, "ray")
    print(f"[train] done in {result.stats['wall_s']:.1f}s; model exported to {run.path(model_dir(cfg.train_name()))}"
          f"{'' if keep else ' (checkpoints deleted; train.keep_checkpoint=true keeps them)'}", flush=True)


def training_warnings(tc: TrainConfig, num_steps: int, unused_pairs: int, total_pairs: int) -> list[str]:
    """Settings that waste data or never leave warm-up, said before any compute is spent."""
    warnings, optimizer, checkpoint = [], tc.optimizer, tc.checkpoint
    if total_pairs and unused_pairs >= 0.1 * total_pairs:
        warnings.append(f"{unused_pairs} of {total_pairs} pairs ({unused_pairs / total_pairs:.0%}) are unused per "
                        f"epoch (each stratum's remainder below one global batch of "
                        f"{tc.schedule.global_batch_size}): lower train.global_batch_size (or cluster.k) so that fewer "
                        f"pairs are left over.")
    if optimizer.warmup_steps >= num_steps:
        warnings.append(f"train.warmup_steps={optimizer.warmup_steps} >= the {num_steps} steps of this run: the "
                        f"learning rate never reaches train.lr={optimizer.lr:g}; lower train.warmup_steps.")
    if checkpoint.max_failures and not checkpoint.checkpoint_every_steps and num_steps > 1:
        warnings.append(f"train.max_failures={checkpoint.max_failures} restarts failed workers from the latest "
                        f"checkpoint, and "
                        f"train.checkpoint_every_steps=0 writes none before the end: a restart begins again at step "
                        f"0. Set train.checkpoint_every_steps (e.g. {max(1, num_steps // 50)}).")
    return warnings


def _check_labeled_negatives(cfg: Config, run: RunDir, manifests: list) -> None:
    """train.labeled_negatives_per_query needs shards that carry the `negatives` column (data.negative_column)."""
    import pyarrow.parquet as pq

    for manifest in manifests:
        with run.fs.open_input_file(run.path(manifest.files[0])) as f:
            if "negatives" not in pq.read_schema(f).names:
                wanted = cfg.train.objective.labeled_negatives_per_query
                raise ConfigError(
                    f"train.labeled_negatives_per_query={wanted} needs labeled negatives, but the shards hold none: "
                    f"set data.negative_column to the input column(s) that hold them (one text or a list per row, or "
                    f"several columns: negative_1,negative_2 or negative_*) in a new --run-dir, or set "
                    f"train.labeled_negatives_per_query=0.")
    ingested = run.done_stats("pairs") if run.exists("pairs", "_DONE.json") else {}
    given, pairs = ingested.get("labeled_negatives"), ingested.get("pairs") or 0
    wanted = cfg.train.objective.labeled_negatives_per_query
    if given is not None and pairs and given < wanted * pairs:  # the empty slots are masked: fewer negatives a step
        print(f"[train] warning: train.labeled_negatives_per_query={wanted}, but the training pairs carry "
              f"{given / pairs:.1f} labeled negatives each on average ({ingested.get('without_labeled_negatives', '?')}"
              f" of {pairs} pairs with none; data.negative_column={cfg.data.negative_column}): a query's missing "
              f"ones are empty slots, masked, so each step has fewer hard negatives than asked for (the metrics' "
              f"labeled_negatives_empty counts them).", flush=True)


def _note_unused_labeled_negatives(cfg: Config, run: RunDir) -> None:
    """Said once: the pairs carry labeled negatives (ingest's count) that train.labeled_negatives_per_query=0 leaves
    unused (a comparison arm may mean it; a first run usually forgot the key)."""
    ingested = run.done_stats("pairs") if run.exists("pairs", "_DONE.json") else {}
    given, pairs = ingested.get("labeled_negatives") or 0, ingested.get("pairs") or 0
    if given and pairs:
        print(f"[train] note: the training pairs carry {given / pairs:.1f} labeled negatives each on average "
              f"(data.negative_column={cfg.data.negative_column}), but train.labeled_negatives_per_query=0: training "
              f"draws none. Set it to 1 or more to train with them.", flush=True)


def check_resumable(cfg: Config, run: RunDir) -> None:
    """`train --resume`: an earlier attempt of train/<name>/ whose checkpoints are there to continue."""
    out = train_dir(cfg.train_name())
    if run.exists(out, "ray", RAY_RUN_NAME):
        return
    if run.exists(out, "_DONE.json"):
        raise StageMissingError(f"--resume: {out} finished earlier with another config and its checkpoints were "
                                f"deleted after the export (train.keep_checkpoint=false): start without --resume "
                                f"(it trains afresh), and set train.keep_checkpoint=true to keep them next time.")
    raise StageMissingError(f"--resume: no earlier run of {out} in {run.path(out)}; start without --resume.")


def precheck(cfg: Config, run: RunDir, resume: bool) -> None:
    """The train stage's checks before Ray starts (Stage.precheck): the mined negatives it asks for and, with
    --resume, an attempt to continue."""
    check_mined(cfg, run)
    if resume:
        check_resumable(cfg, run)


def check_mined(cfg: Config, run: RunDir) -> None:
    """With train.negatives_per_query, negatives/ made with this config (the train stage's precheck, before Ray)."""
    wanted = cfg.train.objective.negatives_per_query
    if wanted and not run.is_done(NEGATIVES, mine_fingerprint(cfg, run)):  # raises when mined with another config
        raise StageMissingError(f"train.negatives_per_query={wanted} needs mined "
                                f"negatives in {run.path(NEGATIVES)}: run `clusterscale mine` with this config first.")


def _check_negatives(cfg: Config, run: RunDir) -> None:
    wanted = cfg.train.objective.negatives_per_query
    check_mined(cfg, run)
    mined = run.done_stats(NEGATIVES)
    kept, rows = mined.get("negatives_per_query"), mined.get("rows") or 0
    if kept is not None and kept < wanted:  # the rest are random passages of the padding pool, not hard ones
        print(f"[train] warning: train.negatives_per_query={wanted}, but mine kept {kept:.1f} per query on average "
              f"({mined.get('without_negatives', '?')} of {rows} queries with none; at most mine.range_max - "
              f"mine.range_min = {cfg.mine.range_max - cfg.mine.range_min}): the rest of each query's {wanted} are "
              f"random passages of the padding pool, and each step encodes them all. Lower "
              f"train.negatives_per_query, or widen mine.range_max (then `clusterscale mine --replace`).", flush=True)


def poll_interval_s(ranks: int) -> float:
    """The controller's poll interval for a fit of `ranks` ranks (HEALTH_CHECK_ENV)."""
    low, high = POLL_BOUNDS_S
    return min(high, max(low, ranks / RANK_POLLS_PER_S))


@contextlib.contextmanager
def controller_poll(ranks: int):
    """HEALTH_CHECK_ENV for the fits inside (the trainer passes the driver's value to its controller), unless the
    user set it; the driver's environment is as it was afterwards."""
    if HEALTH_CHECK_ENV in os.environ:
        yield
        return
    os.environ[HEALTH_CHECK_ENV] = str(poll_interval_s(ranks))
    try:
        yield
    finally:
        os.environ.pop(HEALTH_CHECK_ENV, None)


def _fit(ctx: StageContext, name: str, num_steps: int, segment: tuple[int, int, int], shards_uri: str, resume: bool):
    """One Ray Train run over the steps of one segment (all steps when re-clustering is off)."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from clusterscale.train.trainer import train_loop_per_worker  # imports ray.train.torch: ~0.8 s of CLI start

    cfg, run, compute = ctx.cfg, ctx.run, ctx.cfg.train.compute
    workers = plan_actors(ctx.resources, max_actors=compute.num_workers, use_gpu=compute.use_gpu)  # ranks share the CPUs
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg, "run_uri": run.uri, "num_steps": num_steps, "name": name,
                           "threads_per_worker": workers.threads, "resume": resume, "fail_at_step": ctx.fail_at_step,
                           "segment": segment, "shards_uri": shards_uri,
                           "sampler": samplers.sampler(cfg.train.schedule.sampler)},
        scaling_config=ScalingConfig(num_workers=compute.num_workers, use_gpu=compute.use_gpu,
                                     resources_per_worker=workers.resources_per_worker),
        run_config=RunConfig(name=RAY_RUN_NAME, storage_path=run.path(train_dir(name), "ray"),
                             storage_filesystem=None if run.is_local else run.fs,
                             failure_config=FailureConfig(max_failures=cfg.train.checkpoint.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             # Ray Train's INFO lines (worker group start, its failure policy's verdict with the
                             # failed ranks' tracebacks) stay in its log files: the driver and rank 0 speak.
                             logging_config=LoggingConfig(log_level="WARNING")))
    interrupt.keep_sigint(trainer, "_register_sigint_handler")  # Ctrl-C stays clusterscale's (runtime.interrupt)
    with controller_poll(compute.num_workers):
        result = trainer.fit()
    if result.error:
        raise result.error
    if (result.metrics or {}).get("collapsed"):
        raise TrainingCollapsedError(f"{train_dir(name)} stopped: {result.metrics['collapsed']} The per-step figures "
                                     f"are in {run.path(metrics_path(name))}.")
    return result


def _export_model(run: RunDir, checkpoint, target: str) -> None:
    with checkpoint.as_directory() as local:
        src = os.path.join(local, "model")
        for root, _, files in os.walk(src):
            for fname in files:
                rel = os.path.relpath(os.path.join(root, fname), src)
                with open(os.path.join(root, fname), "rb") as f:
                    run.write_bytes(f"{target}/{rel}", f.read())

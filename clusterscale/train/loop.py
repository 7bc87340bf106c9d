"""Ray Train DDP loop: every global batch from one stratum, InfoNCE over the gathered batch, metrics per step.

Run with `clusterscale train [CONFIG] --run-dir R` (after `shard`); `--resume` continues a stopped or
failed run from its latest checkpoint. Writes train/<name>/: metrics.jsonl (rank 0, one line per
step), batches/rank-<r>.jsonl (train.log_batches), checkpoints (Ray Train, under ray/), model/ (the
exported encoder).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import shutil
import tempfile
import time

import torch

from clusterscale.config import Config, ConfigError, TrainConfig, from_dict
from clusterscale.modeling.encoder import save_sentence_transformers_dir
from clusterscale.errors import UserError
from clusterscale.io.layout import NEGATIVES, batches_path, collapse_path, metrics_path, model_dir, train_dir
from clusterscale.modeling.model_card import write_model_card
from clusterscale.io.rundir import RunDir, StageMissingError
from clusterscale.runtime.resources import Resources, plan_actors
from clusterscale.train import schedule
from clusterscale.train.checkpoint import check_cursor, load_state, save_state, unwrap
from clusterscale.train.data import ShardReader, checked_manifest, strata_inputs
from clusterscale.train.metrics import CollapseGuard, JsonlLog, TensorBoardLog, chance_loss, peak_flops
from clusterscale.modeling.student import build_student, matmul_params
from clusterscale.train.negatives import MinedNegatives, mine_fingerprint
from clusterscale.train.recluster import recluster, segment_bounds, segment_dir, segment_seed
from clusterscale.train.step import StepSettings, contrastive_backward, step_seed

RAY_RUN_NAME = "ray-train"  # fixed: Ray Train resumes a run whose name and storage path it finds again
# Per-step figures that exist only with some options (mined negatives, CLP, MoE): means over ranks / sums.
OPTIONAL_MEANS = ("mined_neg_cos_mean", "clp_penalty", "moe_aux_loss")
OPTIONAL_SUMS = ("mined_negatives", "masked_mined_negatives", "clp_skipped", "negatives_padded")


def lr_at(step: int, cfg: TrainConfig, num_steps: int) -> float:
    """Linear warmup 0 -> lr over warmup_steps, then linear decay to final_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, num_steps - 1 - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr + (cfg.final_lr - cfg.lr) * frac


def _group_label(gb: schedule.GlobalBatch, manifest: dict, sampler: str, sources: list[str] | None):
    if sampler == "clustered":
        shard = manifest["clusters"][gb.shard]
        return shard["cluster"], shard["name"]
    if sampler == "source":
        return gb.group, sources[gb.group]
    if sampler == "random_clusters":
        return gb.group, f"random-{gb.group}"
    return None, "random"


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch as rt_torch

    cfg = from_dict(config["cfg"])  # rebuilt from the plain dict the driver sent
    tc = cfg.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(config.get("threads_per_worker", 1))))
    run, name, num_steps = RunDir(config["run_uri"]), config["name"], config["num_steps"]
    # The shards of this segment: the run's own, or a re-clustering's child run directory.
    shards_run = RunDir(config.get("shards_uri") or config["run_uri"])
    segment, seg_start, seg_stop = config.get("segment", (0, 0, num_steps))
    manifest = checked_manifest(shards_run, cfg.cluster.k, tc.global_batch_size)
    sizes, codes, sources = strata_inputs(shards_run, manifest, tc.sampler)
    device = rt_torch.get_device()

    model, tokenizer, pooling = build_student(tc)
    flops_params = matmul_params(model)
    model = rt_torch.prepare_model(model)  # MoE: idle experts stay in the graph (moe.py), no unused parameters
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=tc.lr,
                                  weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, tc, num_steps) / tc.lr)
    expected_cursor = {"num_steps": num_steps, "sampler": tc.sampler, "seed": tc.seed,
                       "cluster_weighting": tc.cluster_weighting, "global_batch_size": tc.global_batch_size}
    if tc.recluster_every:
        expected_cursor["recluster_every"] = tc.recluster_every
    start_step, checkpoint = 0, ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as local:
            cursor = load_state(local, model, optimizer, scheduler, device)
        check_cursor(cursor, expected_cursor)
        start_step = cursor["step"]
    elif config.get("resume"):
        if segment > 0:
            raise RuntimeError(f"train/{name}: segment {segment} (re-clustering) found no checkpoint of the previous "
                               f"segment in train/{name}/ray; delete train/{name}/ and start afresh.")
        raise RuntimeError(f"--resume: Ray Train found no checkpoint of train/{name}; start without --resume.")
    stop_step = min(num_steps, tc.stop_after_steps or num_steps, seg_stop)
    if start_step > stop_step:
        raise RuntimeError(f"train/{name}: the checkpoint is at step {start_step}, past this run's stop at step "
                           f"{stop_step} (train.stop_after_steps lowered?): raise it, or delete train/{name}/.")
    if start_step < seg_start:
        raise RuntimeError(f"train/{name}: the checkpoint is at step {start_step}, before segment {segment} (steps "
                           f"{seg_start}..{seg_stop}); delete train/{name}/ and start afresh.")
    resumed = start_step if checkpoint is not None else None
    metrics = JsonlLog(run, metrics_path(name), resumed) if rank == 0 else None
    batches = JsonlLog(run, batches_path(name, rank), resumed) if tc.log_batches else None
    board = TensorBoardLog(run.path(train_dir(name), "tensorboard")) if tc.tensorboard and rank == 0 else None
    peak = peak_flops(device, tc.peak_tflops) if rank == 0 else None
    settings = StepSettings.from_train_config(tc, pooling, amp=device.type == "cuda")
    reader = ShardReader(shards_run, manifest)
    negatives = None
    if tc.negatives_per_query:

        negatives = MinedNegatives(run, manifest, shards_run, tc.negatives_per_query, tc.seed)
    guard = CollapseGuard(chance_loss(tc.global_batch_size, tc.negatives_per_query, tc.loss, tc.clp_lambda),
                          tc.warmup_steps, tc.log_every_steps)
    collapsed_at = None
    if start_step:
        print(f"[train] rank {rank}: resuming at step {start_step}/{num_steps}", flush=True)
    t_last, started = time.time(), time.time()

    def flush_logs() -> None:
        for log in (metrics, batches):
            if log is not None:
                log.flush()

    progress: dict = {}  # the latest logged figures, identical on every rank (all-reduced)

    def save(step: int, epoch: int, final: bool, note: dict | None = None) -> None:
        """All ranks call report (a barrier); rank 0 attaches the checkpoint."""
        flush_logs()
        directory, attached = tempfile.mkdtemp(prefix="clusterscale-ckpt-"), None
        try:  # Ray Train copies the checkpoint into storage; the local copy goes even if that fails
            if rank == 0:
                save_state(directory, model, optimizer, scheduler, {**expected_cursor, "step": step, "epoch": epoch})
                if final:
                    save_sentence_transformers_dir(unwrap(model), tokenizer, os.path.join(directory, "model"),
                                                   pooling, tc.passage_max_length)
                attached = ray.train.Checkpoint.from_directory(directory)
            ray.train.report({**progress, "step": step, "train_s": time.time() - started, **(note or {})},
                             checkpoint=attached)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    epoch = (start_step - seg_start) // max(1, schedule.batches_per_epoch(sizes, tc.global_batch_size, tc.sampler,
                                                                          codes))
    for local in schedule.iterate(sizes, tc.global_batch_size, tc.sampler, segment_seed(tc.seed, segment),
                                  stop_step - seg_start, start_step - seg_start, tc.cluster_weighting, codes):
        gb = dataclasses.replace(local, step=local.step + seg_start)
        if config.get("fail_at_step") == gb.step and checkpoint is None and rank == 0:
            raise RuntimeError(f"injected failure at step {gb.step} (test hook)")
        t0, epoch = time.time(), gb.epoch
        torch.manual_seed(step_seed(tc.seed, gb.step, rank))
        table = reader.rows(gb.shard, gb.rank_rows(rank, world))
        queries, passages = table.column("query").to_pylist(), table.column("passage").to_pylist()
        model.train()
        optimizer.zero_grad(set_to_none=True)
        neg_passages = neg_queries = None
        if negatives is not None:
            neg_passages, neg_queries, padded = negatives.for_rows(table.column("pair_id").to_numpy(), gb.step)
        loss, stats = contrastive_backward(model, tokenizer, queries, passages, settings, device,
                                           negatives=neg_passages, negative_queries=neg_queries)
        if negatives is not None:
            stats["negatives_padded"] = torch.tensor(float(padded))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.max_grad_norm)
        optimizer.step()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        # Global means of the logged figures (every rank's queries) and global sums of the counts: one small
        # all-reduce. Which optional figures exist depends only on the config, so all ranks agree.
        means = ["pos_cos", "neg_cos_mean", "neg_cos_max"] + [k for k in OPTIONAL_MEANS if k in stats]
        sums = ["masked_false_negatives", "tokens"] + [k for k in OPTIONAL_SUMS if k in stats]
        values = torch.stack([loss.detach().float()] + [torch.as_tensor(stats[k], dtype=torch.float32).to(loss.device)
                                                        for k in means + sums])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(values)
            values[:1 + len(means)] /= world
        values = values.tolist()
        figures = dict(zip(means + sums, values[1:]))
        step_s = time.time() - t0
        if batches is not None:
            batches.append({"step": gb.step, "epoch": gb.epoch, "shard": gb.shard, "group": gb.group,
                            "pair_ids": table.column("pair_id").to_pylist()})
        if rank == 0:
            cluster, cluster_name = _group_label(gb, manifest, tc.sampler, sources)
            flops = stats["flops_per_param_token"] * flops_params * figures["tokens"]
            record = {"step": gb.step, "epoch": gb.epoch, "cluster": cluster, "cluster_name": cluster_name,
                      "loss": values[0], "lr": lr, "grad_norm": float(grad_norm),
                      **{k: (int(v) if k in sums else v) for k, v in figures.items()},
                      "pairs_per_s": tc.global_batch_size / step_s, "step_s": step_s,
                      "tflops_per_s": flops / step_s / 1e12, "mfu": flops / step_s / (peak * world) if peak else None}
            if tc.recluster_every:
                record["segment"] = segment
            metrics.append(record)
            if board is not None:
                board.log(record)
            if (gb.step + 1) % tc.log_every_steps == 0 or gb.step + 1 == stop_step:
                flush_logs()
                elapsed, t_last = time.time() - t_last, time.time()
                mfu = f" MFU {record['mfu']:.1%}" if record["mfu"] is not None else ""
                print(f"[train] step {gb.step + 1}/{num_steps} epoch {gb.epoch} loss {values[0]:.4f} lr {lr:.2e} "
                      f"neg_cos {figures['neg_cos_mean']:.3f} {tc.log_every_steps * tc.global_batch_size / max(elapsed, 1e-9):.1f} "
                      f"pairs/s{mfu}", flush=True)
        if not math.isfinite(values[0]):
            raise FloatingPointError(f"Loss became {values[0]} at step {gb.step}: lower train.lr or raise "
                                     f"train.temperature.")
        done = gb.step + 1
        progress = {"epoch": gb.epoch, "loss": values[0], "lr": lr, **figures}
        verdict = guard.observe(gb.step, values[0], figures["neg_cos_mean"])  # same values, same verdict on every rank
        if verdict is not None and rank == 0:
            print(f"[train] WARNING: {verdict}", flush=True)
            run.write_json(collapse_path(name), {"step": done, "stopped": tc.stop_on_collapse, "message": verdict})
        if verdict is not None and tc.stop_on_collapse:
            collapsed_at = done
            break
        if tc.checkpoint_every_steps and done % tc.checkpoint_every_steps == 0 and done < stop_step:
            save(done, gb.epoch, final=False)
        elif done % tc.log_every_steps == 0 and done < stop_step:
            # Metrics reach Ray's dashboard and Result.metrics every logging step, not only with checkpoints.
            ray.train.report({**progress, "step": done, "train_s": time.time() - started})
    if board is not None:
        board.close()
    if collapsed_at is not None:  # a checkpoint to inspect, no export: the driver ends the run with the verdict
        save(collapsed_at, epoch, final=False, note={"collapsed": guard.verdict})
        return
    # The model is exported at the end, and at a segment's end for the re-clustering that follows.
    save(stop_step, epoch, final=stop_step in (num_steps, seg_stop))


class TrainingCollapsedError(UserError):
    """The collapse guard stopped a run (train.stop_on_collapse): the message names the likely causes."""


def run_train(cfg: Config, run: RunDir, resume: bool = False, fail_at_step: int | None = None) -> dict:
    """Train train/<name>/; `resume` continues from its latest checkpoint. fail_at_step: a test hook that
    makes rank 0 fail once (before any checkpoint was restored) to exercise train.max_failures."""
    tc, name = cfg.train, cfg.train_name()
    out = train_dir(name)
    negatives_fingerprint = None
    if tc.negatives_per_query:
        negatives_fingerprint = mine_fingerprint(cfg, run)
    fingerprint = cfg.fingerprint(("data", "embed", "cluster", "shard", "train"),
                                  extra={"negatives": negatives_fingerprint} if negatives_fingerprint else None)
    manifest = checked_manifest(run, cfg.cluster.k, tc.global_batch_size)
    if run.is_done(out, fingerprint):
        return run.done_stats(out)
    if tc.tensorboard and (not run.is_local or importlib.util.find_spec("tensorboard") is None):
        raise ConfigError("train.tensorboard=true needs the `tensorboard` package (`pip install tensorboard`) and a "
                          "local --run-dir; set train.tensorboard=false otherwise.")
    if tc.negatives_per_query:
        _check_negatives(cfg, run)
    sizes, codes, _ = strata_inputs(run, manifest, tc.sampler)
    num_steps = schedule.total_steps(sizes, tc.global_batch_size, tc.sampler, tc.epochs, tc.steps, codes)
    if num_steps == 0 or schedule.batches_per_epoch(sizes, tc.global_batch_size, tc.sampler, codes) == 0:
        raise ConfigError(f"train.sampler={tc.sampler} finds no stratum with a full global batch of "
                          f"{tc.global_batch_size} pairs: lower train.global_batch_size.")
    unused = schedule.unused_pairs(sizes, tc.global_batch_size, tc.sampler, tc.seed, 0, tc.cluster_weighting, codes)
    for warning in training_warnings(tc, num_steps, unused, sum(sizes)):
        print(f"[train] warning: {warning}", flush=True)
    if resume:
        if not run.exists(out, "ray", RAY_RUN_NAME) and run.exists(out, "_DONE.json"):
            raise StageMissingError(f"--resume: {out} finished earlier with another config and its checkpoints were "
                                    f"deleted after the export (train.keep_checkpoint=false): start without --resume "
                                    f"(it trains afresh), and set train.keep_checkpoint=true to keep them next time.")
        if not run.exists(out, "ray", RAY_RUN_NAME):
            raise StageMissingError(f"--resume: no earlier run of {out} in {run.path(out)}; start without --resume.")
    else:
        run.begin(out)  # a fresh run must not pick up an older run's checkpoints (same Ray run name)
    started = time.time()
    print(f"[train] {name}: {num_steps} steps x {tc.global_batch_size} pairs, sampler={tc.sampler} "
          f"({tc.cluster_weighting}), {tc.num_workers} workers ({'GPU' if tc.use_gpu else 'CPU'}); {unused} pairs "
          f"unused per epoch (remainders < one global batch)", flush=True)
    stop_step = min(num_steps, tc.stop_after_steps or num_steps)
    segments = segment_bounds(num_steps, tc.recluster_every)
    shards_uri, recluster_s, result = run.uri, 0.0, None
    for segment, (seg_start, seg_stop) in enumerate(segments):
        if seg_start >= stop_step:
            break
        if run.exists(segment_dir(name, segment), "_TRAINED.json"):
            continue  # finished by an earlier attempt (--resume)
        if segment > 0:
            t0 = time.time()
            # A URI (or local path) every node can read: embed actors copy an object-store model locally.
            child, _ = recluster(cfg, run, name, segment, run.child_uri(segment_dir(name, segment), "encoder"))
            shards_uri, recluster_s = child.uri, recluster_s + time.time() - t0
        result = _fit(cfg, run, name, num_steps, (segment, seg_start, seg_stop), shards_uri,
                      resume or segment > 0, fail_at_step)
        if len(segments) > 1 and seg_stop < num_steps and seg_stop <= stop_step:
            _export_model(run, result.checkpoint, f"{segment_dir(name, segment + 1)}/encoder")
            run.write_json(f"{segment_dir(name, segment)}/_TRAINED.json", {"steps": [seg_start, seg_stop]})
    wall = time.time() - started
    stats = {"name": name, "steps": num_steps, "global_batch_size": tc.global_batch_size, "sampler": tc.sampler,
             "cluster_weighting": tc.cluster_weighting, "unused_pairs_per_epoch": unused, "wall_s": round(wall, 3),
             "worker_s": round((wall - recluster_s) * tc.num_workers, 3), "device": "gpu" if tc.use_gpu else "cpu",
             "pairs_per_s": round(num_steps * tc.global_batch_size / wall, 2)}
    if tc.negatives_per_query:
        stats["mined_negatives_per_query"] = tc.negatives_per_query
    if run.exists(collapse_path(name)):  # train.stop_on_collapse=false: warned, went on; the report flags it
        stats["collapse_warning_at_step"] = run.read_json(collapse_path(name))["step"]
    if len(segments) > 1:
        stats |= {"segments": len(segments), "recluster_s": round(recluster_s, 3)}
    if stop_step < num_steps:
        print(f"[train] stopped after step {stop_step}/{num_steps} (train.stop_after_steps); continue with "
              f"`clusterscale train --resume` and the same config.", flush=True)
        return stats | {"stopped_at_step": stop_step}
    _export_model(run, result.checkpoint, model_dir(name))
    run.mark_done(out, fingerprint, stats, {"train": cfg.to_dict()["train"]})
    write_model_card(cfg, run, name)
    if not tc.keep_checkpoint:  # only now: until the export is complete, --resume needs the checkpoint
        run.remove(out, "ray")
    print(f"[train] done in {wall:.1f}s; model exported to {run.path(model_dir(name))}"
          f"{'' if tc.keep_checkpoint else ' (checkpoints deleted; train.keep_checkpoint=true keeps them)'}", flush=True)
    return stats


def training_warnings(tc: TrainConfig, num_steps: int, unused_pairs: int, total_pairs: int) -> list[str]:
    """Settings that waste data or never leave warm-up, said before any compute is spent."""
    warnings = []
    if total_pairs and unused_pairs >= 0.1 * total_pairs:
        warnings.append(f"{unused_pairs} of {total_pairs} pairs ({unused_pairs / total_pairs:.0%}) are unused per "
                        f"epoch (each stratum's remainder below one global batch of {tc.global_batch_size}): lower "
                        f"train.global_batch_size (or cluster.k) so that fewer pairs are left over.")
    if tc.warmup_steps >= num_steps:
        warnings.append(f"train.warmup_steps={tc.warmup_steps} >= the {num_steps} steps of this run: the learning "
                        f"rate never reaches train.lr={tc.lr:g}; lower train.warmup_steps.")
    return warnings


def _check_negatives(cfg: Config, run: RunDir) -> None:
    if not run.is_done(NEGATIVES, mine_fingerprint(cfg, run)):  # raises when mined with another config
        raise StageMissingError(f"train.negatives_per_query={cfg.train.negatives_per_query} needs mined negatives in "
                                f"{run.path(NEGATIVES)}: run `clusterscale mine` with this config first.")


def _fit(cfg: Config, run: RunDir, name: str, num_steps: int, segment: tuple[int, int, int], shards_uri: str,
         resume: bool, fail_at_step: int | None):
    """One Ray Train run over the steps of one segment (all steps when re-clustering is off)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    tc = cfg.train
    workers = plan_actors(Resources(gpus=1), max_actors=tc.num_workers, use_gpu=tc.use_gpu)  # ranks share the CPUs
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg.to_dict(), "run_uri": run.uri, "num_steps": num_steps, "name": name,
                           "threads_per_worker": workers.threads, "resume": resume, "fail_at_step": fail_at_step,
                           "segment": segment, "shards_uri": shards_uri},
        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu, resources_per_worker=workers.resources_per_worker),
        run_config=RunConfig(name=RAY_RUN_NAME, storage_path=run.path(train_dir(name), "ray"),
                             storage_filesystem=None if run.is_local else run.fs,
                             failure_config=FailureConfig(max_failures=tc.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
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

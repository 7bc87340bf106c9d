"""Ray Train DDP loop: every global batch from one shard, InfoNCE over the gathered batch, metrics per step.

Run with `clusterscale train [CONFIG] --run-dir R` (after `shard`). Writes train/<name>/:
metrics.jsonl (rank 0, one line per step), checkpoints (Ray Train), model/ (the exported encoder).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from clusterscale.config import Config, TrainConfig, from_dict
from clusterscale.rundir import RunDir
from clusterscale.shards import load_manifest, shards_dir
from clusterscale.train import schedule
from clusterscale.train.loss import info_nce
from clusterscale.train.model import build_student, embed, text_keys


def lr_at(step: int, cfg: TrainConfig, num_steps: int) -> float:
    """Linear warmup 0 -> lr over warmup_steps, then linear decay to final_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, num_steps - 1 - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr + (cfg.final_lr - cfg.lr) * frac


class ShardReader:
    """Reads rows of a shard by index; keeps the last few shards in memory."""

    def __init__(self, run: RunDir, manifest: dict, cache_size: int = 2):
        self.run, self.clusters, self.cache, self.cache_size = run, manifest["clusters"], OrderedDict(), cache_size
        self._all: pa.Table | None = None

    def _read(self, files: list[str]) -> pa.Table:
        tables = [pq.read_table(self.run.fs.open_input_file(self.run.path(f)),
                                columns=["pair_id", "query", "passage"]) for f in files]
        return pa.concat_tables(tables)

    def shard(self, index: int) -> pa.Table:
        if index not in self.cache:
            self.cache[index] = self._read(self.clusters[index]["files"])
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        self.cache.move_to_end(index)
        return self.cache[index]

    def rows(self, shard: int, rows: np.ndarray) -> pa.Table:
        if shard >= 0:
            return self.shard(shard).take(pa.array(rows))
        if self._all is None:  # random sampler: rows index the shards concatenated in manifest order
            self._all = self._read([f for c in self.clusters for f in c["files"]])
        return self._all.take(pa.array(rows))


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch as rt_torch

    cfg = from_dict(config["cfg"])  # rebuilt from the plain dict the driver sent
    tc = cfg.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    threads = int(config.get("threads_per_worker", 1))
    torch.set_num_threads(max(1, threads))
    run = RunDir(config["run_uri"])
    manifest = load_manifest(run, cfg.cluster.k)
    sizes = [c["rows"] for c in manifest["clusters"]]
    num_steps = config["num_steps"]
    device = rt_torch.get_device()

    model, tokenizer, pooling = build_student(tc)
    model = rt_torch.prepare_model(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=tc.lr,
                                  weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, tc, num_steps) / tc.lr)
    reader = ShardReader(run, manifest)
    name = config["name"]
    metrics_lines: list[str] = []
    batch_log: list[str] = []
    per_rank = tc.global_batch_size // world
    use_amp = device.type == "cuda"
    t_last, started = time.time(), time.time()
    for gb in schedule.iterate(sizes, tc.global_batch_size, tc.sampler, tc.seed, num_steps):
        t0 = time.time()
        table = reader.rows(gb.shard, gb.rank_rows(rank, world))
        queries, passages = table.column("query").to_pylist(), table.column("passage").to_pylist()
        model.train()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            q = embed(model, tokenizer, queries, tc.query_max_length, pooling, device)
            p = embed(model, tokenizer, passages, tc.passage_max_length, pooling, device)
        loss, stats = info_nce(q.float(), p.float(), tc.temperature, text_keys(queries).to(device),
                               text_keys(passages).to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.max_grad_norm)
        optimizer.step()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        # Global means of the logged figures (every rank's queries), one small all-reduce.
        values = torch.stack([loss.detach().float(), stats["pos_cos"].float(), stats["neg_cos_mean"].float(),
                              stats["neg_cos_max"].float(), stats["masked_false_negatives"].float()])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(values)
            values[:4] /= world
        values = values.tolist()
        step_s = time.time() - t0
        if tc.log_batches:
            batch_log.append(json.dumps({"step": gb.step, "epoch": gb.epoch, "shard": gb.shard,
                                         "pair_ids": table.column("pair_id").to_pylist()}))
        if rank == 0:
            shard = manifest["clusters"][gb.shard] if gb.shard >= 0 else None
            record = {"step": gb.step, "epoch": gb.epoch, "cluster": shard["cluster"] if shard else None,
                      "cluster_name": shard["name"] if shard else "random", "loss": values[0], "lr": lr,
                      "grad_norm": float(grad_norm), "pos_cos": values[1], "neg_cos_mean": values[2],
                      "neg_cos_max": values[3], "masked_false_negatives": int(values[4]),
                      "pairs_per_s": tc.global_batch_size / step_s, "step_s": step_s}
            metrics_lines.append(json.dumps(record))
            if (gb.step + 1) % tc.log_every_steps == 0 or gb.step + 1 == num_steps:
                run.write_text(f"train/{name}/metrics.jsonl", "\n".join(metrics_lines) + "\n")
                elapsed = time.time() - t_last
                t_last = time.time()
                print(f"[train] step {gb.step + 1}/{num_steps} epoch {gb.epoch} loss {values[0]:.4f} "
                      f"lr {lr:.2e} neg_cos {values[2]:.3f} {tc.log_every_steps * tc.global_batch_size / max(elapsed, 1e-9):.1f} pairs/s",
                      flush=True)
        if not math.isfinite(values[0]):
            raise FloatingPointError(f"Loss became {values[0]} at step {gb.step}: lower train.lr or raise "
                                     f"train.temperature.")
    if tc.log_batches:
        run.write_text(f"train/{name}/batches/rank-{rank}.jsonl", "\n".join(batch_log) + "\n")
    checkpoint_dir = tempfile.mkdtemp(prefix="clusterscale-ckpt-")
    checkpoint = None
    if rank == 0:
        unwrapped = model.module if hasattr(model, "module") else model
        from clusterscale.encoder import save_sentence_transformers_dir

        save_sentence_transformers_dir(unwrapped, tokenizer, os.path.join(checkpoint_dir, "model"), pooling,
                                       tc.passage_max_length)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                   os.path.join(checkpoint_dir, "optimizer.pt"))
        with open(os.path.join(checkpoint_dir, "cursor.json"), "w") as f:
            json.dump({"step": num_steps, "seed": tc.seed}, f)
        checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir)
    ray.train.report({"step": num_steps, "train_s": time.time() - started}, checkpoint=checkpoint)


def run_train(cfg: Config, run: RunDir) -> dict:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer


    k, tc, name = cfg.cluster.k, cfg.train, cfg.train_name()
    out = f"train/{name}"
    fingerprint = cfg.fingerprint(("data", "embed", "cluster", "shard", "train"))
    manifest = load_manifest(run, k)
    if manifest["global_batch_size"] != tc.global_batch_size:
        raise ValueError(f"The shards under {shards_dir(k)} were planned for train.global_batch_size="
                         f"{manifest['global_batch_size']}, not {tc.global_batch_size}: rerun `clusterscale shard` "
                         f"with this batch size in a new --run-dir, or keep the batch size.")
    if run.is_done(out, fingerprint):
        return run.done_stats(out)
    sizes = [c["rows"] for c in manifest["clusters"]]
    if max(sizes) < tc.global_batch_size:
        raise ValueError(f"train.global_batch_size={tc.global_batch_size} is larger than every shard "
                         f"(largest {max(sizes)} rows): lower it or cluster.k.")
    num_steps = schedule.total_steps(sizes, tc.global_batch_size, tc.sampler, tc.epochs, tc.steps)
    _, unused = schedule.epoch_batches(sizes, tc.global_batch_size, tc.sampler, tc.seed, 0)
    run.begin(out)
    started = time.time()
    cpus = ray.cluster_resources().get("CPU", 1)
    threads = 1 if tc.use_gpu else max(1, int(cpus // tc.num_workers))
    resources = {"GPU": 1, "CPU": 1} if tc.use_gpu else {"CPU": min(threads, cpus / tc.num_workers)}
    storage = run.path(out, "ray")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg.to_dict(), "run_uri": run.uri, "num_steps": num_steps, "name": name,
                           "threads_per_worker": threads},
        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(name="ray-train", storage_path=storage,
                             storage_filesystem=None if run.is_local else run.fs))
    print(f"[train] {name}: {num_steps} steps x {tc.global_batch_size} pairs, sampler={tc.sampler}, "
          f"{tc.num_workers} workers ({'GPU' if tc.use_gpu else 'CPU'}); {unused} pairs unused per epoch "
          f"(remainders < one global batch)", flush=True)
    result = trainer.fit()
    if result.error:
        raise result.error
    _export_model(run, result.checkpoint, out)
    wall = time.time() - started
    stats = {"name": name, "steps": num_steps, "global_batch_size": tc.global_batch_size, "sampler": tc.sampler,
             "unused_pairs_per_epoch": unused, "wall_s": round(wall, 3),
             "worker_s": round(wall * tc.num_workers, 3), "device": "gpu" if tc.use_gpu else "cpu",
             "pairs_per_s": round(num_steps * tc.global_batch_size / wall, 2)}
    run.mark_done(out, fingerprint, stats, {"train": cfg.to_dict()["train"]})
    print(f"[train] done in {wall:.1f}s; model exported to {run.path(out, 'model')}", flush=True)
    return stats


def _export_model(run: RunDir, checkpoint, out: str) -> None:
    with checkpoint.as_directory() as local:
        src = os.path.join(local, "model")
        for root, _, files in os.walk(src):
            for fname in files:
                rel = os.path.relpath(os.path.join(root, fname), src)
                with open(os.path.join(root, fname), "rb") as f:
                    run.write_bytes(f"{out}/model/{rel}", f.read())


def local_model_dir(run: RunDir, name: str) -> str:
    """A local folder with the exported model (downloaded from an object store when needed)."""
    if run.is_local:
        return run.path(f"train/{name}/model")
    target = tempfile.mkdtemp(prefix=f"clusterscale-{name}-")
    prefix = run.path(f"train/{name}/model")
    for f in run.files(f"train/{name}/model", suffix=""):
        rel = os.path.relpath(f, prefix)
        os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
        with run.fs.open_input_stream(f) as src, open(os.path.join(target, rel), "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target

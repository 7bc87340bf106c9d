"""Training benchmark: loader overhead (clustered vs random), clusterscale vs a plain PyTorch loop, GradCache memory.

    PYTHONPATH=. python benchmarks/bench_train.py [--steps 12] [--json out.json] [--skip-ray] [--gpu]

1. Loader: the same single-process step (ShardReader + contrastive_backward + AdamW) fed by the
   clustered and by the random schedule, interleaved step by step, over shards laid out as the shard stage
   writes them (row groups of row_group_rows_for(batch), files of one global batch: shard.batches_per_file=1). loader_overhead = (median loader
   time clustered - random) / median step time random: the time the clustered loader adds per step.
2. clusterscale `train` through Ray Train (2 DDP workers on local Ray, gloo) vs a plain single-process
   PyTorch loop (tokenize, forward, in-batch InfoNCE, backward, AdamW) on the same batches and model:
   step_time_ratio_vs_plain_torch = median step_s from metrics.jsonl / median plain step time.
3. GradCache memory: peak memory of one step as the global batch grows 256 -> 4096, with and without
   GradCache (one fresh subprocess per mode, sizes ascending). CPU: peak RSS (getrusage ru_maxrss)
   minus the peak after a warm-up step; GPU (--gpu): torch.cuda.max_memory_allocated.
Model: a BERT from scratch (hidden 128, 2 layers: bert-tiny's shape), synthetic topical text.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clusterscale import config as config_mod  # noqa: E402
from clusterscale.io.layout import manifest_path  # noqa: E402
from clusterscale.train import schedule  # noqa: E402
from clusterscale.train.data import ShardReader, row_group_rows_for, schedule_block_rows  # noqa: E402
from clusterscale.train.metrics import read_metrics  # noqa: E402
from clusterscale.modeling.student import build_student  # noqa: E402
from clusterscale.train.step import contrastive_backward  # noqa: E402

MODEL = ["train.init=scratch", "train.scratch_hidden_size=128", "train.scratch_num_layers=2",
         "train.scratch_num_heads=2", "train.scratch_intermediate_size=512", "train.query_max_length=32",
         "train.passage_max_length=64", "train.temperature=0.05", "train.lr=1e-4", "train.final_lr=1e-5",
         "train.warmup_steps=2"]


def _cfg(global_batch_size: int, steps: int, *extra: str):
    return config_mod.load(None, MODEL + [f"train.global_batch_size={global_batch_size}", f"train.steps={steps}",
                                          "cluster.k=4", *extra])


def loader_and_plain(run, cfg, steps: int) -> dict:
    """Parts 1 and 2's plain loop, in this process (torch threads = all cores)."""
    tc = cfg.train
    manifest = run.read_json(manifest_path(4))
    sizes = [c["rows"] for c in manifest["clusters"]]
    model, tokenizer, pooling = build_student(tc)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.optimizer.lr)
    reader = ShardReader(run, manifest)
    block_rows = schedule_block_rows(manifest)
    batch, seed = tc.schedule.global_batch_size, tc.schedule.seed
    streams = {s: schedule.iterate(sizes, batch, s, seed, steps + 2, block_rows=block_rows)
               for s in ("clustered", "random")}
    times: dict[str, dict[str, list[float]]] = {s: {"load": [], "step": [], "plain": []} for s in streams}
    for i in range(steps + 2):
        for sampler, stream in streams.items():
            t0 = time.perf_counter()
            gb = next(stream)
            table = reader.rows(gb.shard, gb.rows)
            queries, passages = table.column("query").to_pylist(), table.column("passage").to_pylist()
            t1 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            contrastive_backward(model, tokenizer, queries, passages, tc, torch.device("cpu"), pooling=pooling)
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.optimizer.max_grad_norm)
            optimizer.step()
            t2 = time.perf_counter()
            plain_s = plain_step(model, tokenizer, optimizer, queries, passages, tc) if sampler == "clustered" else 0
            if i >= 2:  # the first steps read the shards and warm up the allocator
                times[sampler]["load"].append(t1 - t0)
                times[sampler]["step"].append(t2 - t0)
                times[sampler]["plain"].append(plain_s)
    med = {s: {k: statistics.median(v) for k, v in t.items()} for s, t in times.items()}
    return {"loader_s_clustered": med["clustered"]["load"], "loader_s_random": med["random"]["load"],
            "step_s_clustered": med["clustered"]["step"], "step_s_random": med["random"]["step"],
            "loader_overhead": (med["clustered"]["load"] - med["random"]["load"]) / med["random"]["step"],
            "plain_torch_step_s": med["clustered"]["plain"],
            "core_step_ratio_vs_plain_torch": med["clustered"]["step"] / med["clustered"]["plain"]}


def plain_step(model, tokenizer, optimizer, queries, passages, tc) -> float:
    """What a user would write without clusterscale: CLS embeddings, in-batch InfoNCE, AdamW."""
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    lengths = tc.student
    q_in = tokenizer(queries, padding=True, truncation=True, max_length=lengths.query_max_length, return_tensors="pt")
    p_in = tokenizer(passages, padding=True, truncation=True, max_length=lengths.passage_max_length,
                     return_tensors="pt")
    q = torch.nn.functional.normalize(model(**q_in).last_hidden_state[:, 0], dim=-1)
    p = torch.nn.functional.normalize(model(**p_in).last_hidden_state[:, 0], dim=-1)
    loss = torch.nn.functional.cross_entropy(q @ p.T / tc.objective.temperature, torch.arange(len(q)))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.optimizer.max_grad_norm)
    optimizer.step()
    return time.perf_counter() - started


def ray_train_step_s(run, cfg) -> float:
    """Median step_s of a real `clusterscale train` (Ray Train, 2 DDP workers) after 2 warm-up steps."""
    import ray

    from clusterscale.pipeline import run_stage

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    try:
        run_stage("train", cfg, run)
    finally:
        ray.shutdown()
    records = read_metrics(run, cfg.train_name())
    return statistics.median(r["step_s"] for r in records[2:])


def memory_points(sizes: list[int], chunk: int, gpu: bool) -> list[float]:
    """Peak extra memory (MiB) of one training step per global batch size, in this (fresh) process.

    On CPU the peak RSS only grows, so sizes run in ascending order and each point is the peak so far
    minus the RSS after a warm-up step: a flat curve means the larger batch needed no more memory.
    """
    import resource

    from tests.conftest import make_pairs

    device = torch.device("cuda" if gpu else "cpu")
    cfg = config_mod.load(None, ["train.init=scratch", "train.scratch_hidden_size=32", "train.scratch_num_layers=2",
                                 "train.scratch_num_heads=2", "train.scratch_intermediate_size=64",
                                 "train.query_max_length=16", "train.passage_max_length=32",
                                 f"train.grad_cache_chunk={chunk}"])
    model, tokenizer, pooling = build_student(cfg.train)
    model.to(device)
    step_options = {"pooling": pooling, "amp": gpu}
    table = make_pairs(max(sizes), seed=1)
    queries, passages = table.column("q").to_pylist(), table.column("p").to_pylist()
    contrastive_backward(model, tokenizer, queries[:32], passages[:32], cfg.train, device, **step_options)  # warm-up
    base = torch.cuda.memory_allocated() if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    points = []
    for size in sorted(sizes):
        model.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        contrastive_backward(model, tokenizer, queries[:size], passages[:size], cfg.train, device, **step_options)
        peak = torch.cuda.max_memory_allocated() if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        points.append((peak - base) / 2 ** 20)
    return points


def memory_curve(sizes: list[int], chunk: int, gpu: bool) -> dict:
    curve: dict[str, dict[int, float]] = {}
    for mode, c in (("grad_cache", chunk), ("no_cache", 0)):
        out = subprocess.run([sys.executable, __file__, "--memory-points", ",".join(map(str, sizes)), str(c)]
                             + (["--gpu"] if gpu else []), capture_output=True, text=True, check=True)
        values = json.loads(out.stdout.strip().splitlines()[-1])
        curve[mode] = {size: round(v, 1) for size, v in zip(sorted(sizes), values)}
        print(f"  memory {mode}: {curve[mode]} MiB", flush=True)
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="Measured steps per sampler (after 2 warm-up steps).")
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--rows-per-cluster", type=int, default=800)
    parser.add_argument("--memory-sizes", default="256,1024,4096")
    parser.add_argument("--chunk", type=int, default=64, help="GradCache chunk for the memory curve.")
    parser.add_argument("--skip-ray", action="store_true", help="Skip the Ray Train measurement.")
    parser.add_argument("--gpu", action="store_true", help="Memory curve on the GPU (torch.cuda peak memory).")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--memory-points", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.memory_points:
        sizes, chunk = args.memory_points
        print(json.dumps(memory_points([int(x) for x in sizes.split(",")], int(chunk), args.gpu)))
        return
    from tests.train_data import make_sharded_run

    results: dict = {"machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}", "date": time.strftime(
        "%Y-%m-%d %H:%M UTC", time.gmtime()), "global_batch_size": args.global_batch_size}
    with tempfile.TemporaryDirectory() as tmp:
        group_rows = row_group_rows_for(args.global_batch_size)
        run = make_sharded_run(os.path.join(tmp, "run"), rows_per_topic=args.rows_per_cluster,
                               global_batch_size=args.global_batch_size, row_group_rows=group_rows,
                               groups_per_file=args.global_batch_size // group_rows)
        cfg = _cfg(args.global_batch_size, args.steps + 2)
        results |= loader_and_plain(run, cfg, args.steps)
        print(json.dumps(results, indent=2), flush=True)
        if not args.skip_ray:
            results["clusterscale_ray_step_s"] = ray_train_step_s(run, _cfg(args.global_batch_size, args.steps + 2,
                                                                            "train.log_every_steps=100"))
            results["step_time_ratio_vs_plain_torch"] = results["clusterscale_ray_step_s"] / results["plain_torch_step_s"]
            results["step_time_ratio_measured_on"] = "clusterscale train (Ray Train, 2 DDP workers)"
        else:
            results["step_time_ratio_vs_plain_torch"] = results["core_step_ratio_vs_plain_torch"]
            results["step_time_ratio_measured_on"] = "the step core in one process (--skip-ray)"
    results["memory_mib"] = memory_curve([int(s) for s in args.memory_sizes.split(",")], args.chunk, args.gpu)
    results["memory_measured_by"] = "torch.cuda.max_memory_allocated" if args.gpu else \
        "peak RSS (ru_maxrss) of a fresh process per mode (sizes ascending) minus the peak after a warm-up step"
    print(json.dumps(results, indent=2))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

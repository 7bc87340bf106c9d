"""Training read amplification: bytes a rank reads per step / on-disk bytes of the rows it trains on.

    PYTHONPATH=. python benchmarks/bench_train_reads.py --run-dir R --k 32 [--world-size 8] [--steps 100]
        [--samplers clustered,random,random_clusters,source]

R is a sharded run (`clusterscale synth` + fit + assign + shard). Every rank of a DDP run is simulated
in this process with its own ShardReader, fed by the schedule, exactly as training reads. Bytes read
are counted at the filesystem (every file opened through the run's pyarrow filesystem); bytes used
are each returned row's share of its row group's compressed column chunks (pair_id, query, passage).
A sampler other than clustered reads its shard set (shards/k=<k>/<sampler>/), which is written first
through the executor, as `clusterscale train` does, when the run has none (on a local Ray).

--latency-ms MS measures what an object store's latency does to a training step instead: one rank (rank 0 of
--world-size) reads its rows through the trainer's prefetch while each step "computes" for --compute-ms (a
sleep, as a GPU step leaves the CPU free), once on local disk and once through a filesystem that adds MS to
every request (each open and each read), at the default train.prefetch_steps and at --low-prefetch; the
figure is step time through the slow filesystem / step time on local disk (goal <= 1.2 at the default).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clusterscale import pipeline  # noqa: E402
from clusterscale.io.layout import shard_set_dir, shard_set_manifest  # noqa: E402
from clusterscale.io.records import ShardManifest  # noqa: E402
from clusterscale.io.rundir import RunDir  # noqa: E402
from clusterscale.runtime import session  # noqa: E402
from clusterscale.train import data, schedule  # noqa: E402

COLUMNS = ["pair_id", "query", "passage"]


class CountingFS:
    """The run's filesystem with every input file counted."""

    def __init__(self, fs):
        self.fs, self.opened = fs, []

    def open_input_file(self, path: str):
        counted = data._CountingFile(self.fs.open_input_file(path))  # the reader's own byte-counting file
        self.opened.append(counted)
        return counted

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.opened)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def bytes_per_row(run: RunDir, manifest: ShardManifest) -> list[np.ndarray]:
    """Per shard, the on-disk bytes of each row's (pair_id, query, passage): its row group's share."""
    out = []
    for cluster in manifest.clusters:
        parts = []
        for rel in cluster.files:
            md = pq.read_metadata(run.fs.open_input_file(run.path(rel)))
            names = [md.schema.column(i).name for i in range(md.num_columns)]
            for g in range(md.num_row_groups):
                group = md.row_group(g)
                chunk = sum(group.column(names.index(c)).total_compressed_size for c in COLUMNS)
                parts.append(np.full(group.num_rows, chunk / group.num_rows))
        out.append(np.concatenate(parts))
    return out


def set_manifest(run_dir: str, k: int, sampler: str) -> tuple[ShardManifest, float | None]:
    """(manifest of the sampler's shard set, seconds spent writing it: None when it was there)."""
    cfg, run = pipeline.open_run(run_dir, None, [f"cluster.k={k}", f"train.sampler={sampler}"])
    written = None
    if sampler != "clustered" and not run.exists(shard_set_dir(k, sampler), "_DONE.json"):
        session.init_ray(cfg.ray)
        started = time.time()
        pipeline.run_stage("shard_set", cfg, run)
        written = round(time.time() - started, 1)
    return shard_set_manifest(run, k, cfg.train.schedule.global_batch_size, sampler), written


def measure(run_dir: str, k: int, world_size: int, steps: int, seed: int, footer_cache_mb: float | None,
            sampler: str = "clustered") -> dict:
    run = RunDir(run_dir)
    manifest, set_write_s = set_manifest(run_dir, k, sampler)
    sizes, batch = manifest.strata_sizes, manifest.global_batch_size
    row_bytes = bytes_per_row(run, manifest)
    counted = RunDir(run_dir)
    counted.fs = CountingFS(counted.fs)
    options = {} if footer_cache_mb is None else {"footer_cache_bytes": int(footer_cache_mb * 2 ** 20)}
    readers = [data.ShardReader(counted, manifest, **options) for _ in range(world_size)]
    per_step, total_read, total_used, started = [], 0, 0.0, time.time()
    for gb in schedule.iterate(sizes, batch, sampler, seed, steps, block_rows=data.schedule_block_rows(manifest)):
        before = counted.fs.bytes_read
        used = 0.0
        for rank, reader in enumerate(readers):
            rows = gb.rank_rows(rank, world_size)
            table = reader.rows(gb.shard, rows)
            assert table.num_rows == len(rows)
            used += float(row_bytes[gb.shard][rows].sum())
        read = counted.fs.bytes_read - before
        per_step.append(read / used)
        total_read, total_used = total_read + read, total_used + used
    warm = per_step[len(per_step) // 2:]
    return {"sampler": sampler, "set_write_s": set_write_s, "rows": int(sum(sizes)), "k": k, "shards": len(sizes),
            "global_batch_size": batch, "world_size": world_size, "steps": len(per_step),
            "footer_cache_mb": footer_cache_mb, "row_group_rows": manifest.row_group_rows,
            "files": len(manifest.files),
            "bytes_read_per_rank_step": total_read / len(per_step) / world_size,
            "bytes_used_per_rank_step": total_used / len(per_step) / world_size,
            "train_read_amplification": total_read / total_used,
            "train_read_amplification_second_half": sum(warm) / len(warm),
            "median_step_amplification": statistics.median(per_step), "wall_s": round(time.time() - started, 1)}


class LatencyFS:
    """The run's filesystem with `latency_s` added to every request: opening a file and each read of it."""

    def __init__(self, fs, latency_s: float):
        self.fs, self.latency_s, self.requests = fs, latency_s, 0

    def open_input_file(self, path: str):
        self._wait()
        return _SlowFile(self.fs.open_input_file(path), self)

    def _wait(self) -> None:
        self.requests += 1
        time.sleep(self.latency_s)

    def __getattr__(self, name):
        return getattr(self.fs, name)


class _SlowFile(data._CountingFile):
    def __init__(self, native, fs: LatencyFS):
        super().__init__(native)
        self.fs = fs

    def read(self, size: int = -1) -> bytes:
        self.fs._wait()
        return super().read(size)


def step_times(run_dir: str, k: int, world_size: int, steps: int, seed: int, compute_s: float,
               latency_s: float, depth: int) -> dict:
    """Seconds per step of one rank that reads through prefetch(depth) and computes compute_s a step."""
    run = RunDir(run_dir)
    manifest = shard_set_manifest(run, k, pipeline.open_run(run_dir, None, [f"cluster.k={k}"])[0]
                                  .train.schedule.global_batch_size, "clustered")
    if latency_s:
        run.fs = LatencyFS(run.fs, latency_s)
    reader = data.ShardReader(run, manifest)
    batches = schedule.iterate(manifest.strata_sizes, manifest.global_batch_size, "clustered", seed, steps,
                               block_rows=data.schedule_block_rows(manifest))
    started, waited = time.perf_counter(), 0.0
    for item in reader.prefetch(batches, 0, world_size, depth=depth):
        waited += item.wait_s
        time.sleep(compute_s)
    wall = time.perf_counter() - started
    return {"depth": depth, "latency_ms": latency_s * 1e3, "step_s": wall / steps, "waited_s": round(waited, 3),
            "requests_per_step": getattr(run.fs, "requests", 0) / steps}


def measure_latency(args) -> dict:
    from clusterscale.train.trainer_config import ComputeConfig

    default = ComputeConfig().prefetch_steps
    common = (args.run_dir, args.k, args.world_size, args.steps, args.seed, args.compute_ms / 1e3)
    local = step_times(*common, 0.0, default)
    slow = {depth: step_times(*common, args.latency_ms / 1e3, depth) for depth in (default, args.low_prefetch)}
    return {"compute_ms": args.compute_ms, "latency_ms": args.latency_ms, "world_size": args.world_size,
            "steps": args.steps, "default_prefetch_steps": default, "local": local,
            "slow": {str(d): r for d, r in slow.items()},
            "step_time_ratio_default": slow[default]["step_s"] / local["step_s"],
            f"step_time_ratio_prefetch_{args.low_prefetch}": slow[args.low_prefetch]["step_s"] / local["step_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--k", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--footer-cache-mb", type=float,
                        help="ShardReader's footer cache (row-group reader only); small values emulate the cache "
                             "misses of a run with many more files than the cache holds")
    parser.add_argument("--samplers", default="clustered", help="comma-separated train.sampler values")
    parser.add_argument("--latency-ms", type=float,
                        help="Measure step time through a filesystem adding this latency to every request instead")
    parser.add_argument("--compute-ms", type=float, default=150.0,
                        help="--latency-ms: each step's compute (default 150 ms, a BERT-base step of 64 pairs per "
                             "GPU rank)")
    parser.add_argument("--low-prefetch", type=int, default=1, help="--latency-ms: the prefetch to compare with")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.latency_ms is not None:
        result = measure_latency(args)
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return
    result = [measure(args.run_dir, args.k, args.world_size, args.steps, args.seed, args.footer_cache_mb, sampler)
              for sampler in args.samplers.split(",")]
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

"""`clusterscale plan --calibrate`: time ingest, fit, assign and shard on two small synth runs on this machine (each
stage its own `clusterscale` process, as a user runs it), sample the peak memory (USS) of its driver and of its
largest Ray worker, and write the calibration file that plan/rates.py documents. Three sizes (25k, 100k, 200k by
default) give each stage a start-up and a per-work rate (a least-squares line): with two sizes 4x apart, one noisy
start-up of a few seconds tilted assign's line by 2x (benchmarks/RESULTS.md "bench_plan"). Faiss's
search rate and Ray Data's shuffle rates (per partition, per block x partition; through local files and the
object store) are timed on their own (the terms that grow with k).
dedup's largest worker holds one full shuffle batch from ~64 MiB of input on: the largest size's dedup (through the
object store) measures that worker on this machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict

from clusterscale.config import ConfigError
from clusterscale.io.rundir import RunDir
from clusterscale.pipeline import open_run
from clusterscale.plan.cluster import this_machine
from clusterscale.plan.estimate import MB, Models, Planner
from clusterscale.plan.rates import (CALIBRATION_FORMAT, DEFAULT_CALIBRATION, SHUFFLE_PATHS, Rates, ShuffleRate,
                                     folder_bytes, line_fit)
from clusterscale.plan.shape import run_shape, stage_work
from clusterscale.runtime.bounded_data import SHUFFLE_MAP_BATCH_BYTES
from clusterscale.runtime.vectors import EMBEDDINGS_ROW_GROUP_ROWS

CALIBRATED_STAGES = ("fit", "assign", "dedup", "shard")  # and ingest, on the synth pairs written out as Parquet
# dedup runs with both passes on (exact and semantic at cos >= 0.9) for its own measurement; shard, after it, with
# dedup off (it reads assign/), as the other stages do.
SEMANTIC_THRESHOLD = 0.9
STAGE_KEYS = {"dedup": ["dedup.exact=true", f"dedup.semantic_threshold={SEMANTIC_THRESHOLD}"]}
CALIBRATION_DIM = 384
CALIBRATION_K = 64
SAMPLE_INTERVAL_S = 0.2
CALIBRATION_ROWS = (1_000, 10_000_000)  # the synth sizes --calibrate-rows may name: minutes at most on a laptop
MAX_CALIBRATION_SIZES = 8


class PeakSampler:
    """Peak USS of a command's process (the driver) and of its largest descendant titled `ray::...` or running
    default_worker.py (a Ray task, actor or Ray Data operator), sampled on a thread (psutil, which Ray ships):
    what benchmarks/bench_scale.py calls driver_peak_uss_mb and worker_peak_uss_mb."""

    def __init__(self, pid: int):
        import ray  # noqa: F401  (puts Ray's bundled psutil on sys.path)
        import psutil

        self.psutil, self.root = psutil, psutil.Process(pid)
        self.driver_bytes = self.worker_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _uss(self, proc) -> int:
        try:
            return proc.memory_full_info().uss
        except (self.psutil.Error, OSError):
            return 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.driver_bytes = max(self.driver_bytes, self._uss(self.root))
            try:
                children = self.root.children(recursive=True)
            except (self.psutil.Error, OSError):
                children = []
            for child in children:
                try:
                    cmdline = " ".join(child.cmdline())
                except (self.psutil.Error, OSError):
                    continue
                if cmdline.startswith("ray::") or "default_worker.py" in cmdline:
                    self.worker_bytes = max(self.worker_bytes, self._uss(child))
            self._stop.wait(SAMPLE_INTERVAL_S)


def cli_stage(verb: str, run_dir: str, keys: list[str], extra: list[str] = ()) -> tuple[float, float]:
    """Run `clusterscale VERB` as its own process (its own local Ray, as a user runs a stage), sampling its tree;
    (peak MB of the largest Ray worker, of the driver)."""
    argv = [sys.executable, "-m", "clusterscale.cli", verb, "--run-dir", run_dir, *extra, "--set", *keys]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        with PeakSampler(proc.pid) as sampler:
            rc = proc.wait()
        if rc:
            log.seek(0)
            raise RuntimeError(f"calibration: `{' '.join(argv)}` failed (exit {rc}):\n"
                               + log.read().decode(errors="replace")[-3000:])
    print(f"[calibrate] {verb} {os.path.basename(run_dir)}: largest worker {sampler.worker_bytes / MB:.0f} MB, driver "
          f"{sampler.driver_bytes / MB:.0f} MB", flush=True)
    return sampler.worker_bytes / MB, sampler.driver_bytes / MB


def calibration_run(rows: int, root: str, overrides: list[str]) -> tuple[RunDir, dict, dict]:
    """A synth run of `rows` pairs through CALIBRATED_STAGES, and an ingest of its pairs written out as one Parquet
    file; (run, costs.json with ingest's record added, {stage: (worker MB, driver MB)})."""
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    run_dir = os.path.join(root, f"rows={rows}")
    keys = [f"cluster.k={CALIBRATION_K}", *overrides]
    cli_stage("synth", run_dir, keys, ["--rows", str(rows), "--dim", str(CALIBRATION_DIM), "--topics", "100"])
    peaks = {stage: cli_stage(stage, run_dir, keys + STAGE_KEYS.get(stage, [])) for stage in CALIBRATED_STAGES}
    run = RunDir(run_dir)
    costs = run.read_json("report/costs.json")
    source = os.path.join(root, f"input-{rows}.parquet")
    pq.write_table(pads.dataset(run.files("pairs") + run.files("heldout"), format="parquet").to_table(
        columns=["query", "passage"]), source)
    ingest_dir = os.path.join(root, f"ingest-{rows}")
    peaks["ingest"] = cli_stage("ingest", ingest_dir, [*overrides, f"data.path={source}"])
    costs["ingest"] = RunDir(ingest_dir).read_json("report/costs.json")["ingest"]
    return run, costs, peaks


def _shuffle_rows(batch: dict, payload: int) -> dict:
    import numpy as np

    ids = batch["id"]
    return {"pair_id": ids, "query": np.array(["q" * (payload // 4)] * len(ids), dtype=object),
            "passage": np.array(["p" * (payload - payload // 4)] * len(ids), dtype=object),
            "cluster": (ids % 7).astype(np.int32), "sub": np.zeros(len(ids), np.int64)}


def _count_group(group):
    import pyarrow as pa

    return pa.table({"rows": [group.num_rows]})


def shuffle_seconds(disk: bool, block_counts: tuple[int, int] = (16, 64), partitions: tuple[int, int] = (16, 128),
                    payload: int = 140) -> ShuffleRate:
    """CPU-seconds of a Ray Data hash shuffle (groupby + map_groups, as shard writes its groups by (shard, sub))
    per partition and per input block x partition, through local files (disk) or the object store: the same blocks
    shuffled into two partition counts give the cost of the extra partitions, at two block counts to split it into
    its two terms. Rows like shard's (pair_id, a query and a passage of `payload` bytes in all, cluster) in blocks
    of assign/'s row group (EMBEDDINGS_ROW_GROUP_ROWS). The rows per partition do not enter: 4x the rows in the same
    blocks cost the same extra partitions here (benchmarks/RESULTS.md "bench_plan"). Its own local Ray on this
    machine's CPUs."""
    import ray

    from clusterscale.config import RayConfig
    from clusterscale.runtime.bounded_data import ShuffleSettings, bounded_shuffle_maps
    from clusterscale.runtime.session import init_ray

    cpus = os.cpu_count() or 1
    init_ray(RayConfig(num_cpus=cpus, include_dashboard=False))
    try:
        def once(blocks: int, p: int) -> float:
            with bounded_shuffle_maps(ShuffleSettings(disk=disk)):
                ds = ray.data.range(blocks * EMBEDDINGS_ROW_GROUP_ROWS, override_num_blocks=blocks).map_batches(
                    _shuffle_rows, fn_kwargs={"payload": payload}, batch_size=None, batch_format="numpy")
                ds = ds.map_batches(lambda b: {**b, "shard": b["pair_id"] % p}, batch_size=None,
                                    batch_format="numpy")
                started = time.perf_counter()
                grouped = ds.groupby(["shard", "sub"], num_partitions=p)
                grouped.map_groups(_count_group, batch_format="pyarrow").materialize()
            return time.perf_counter() - started

        once(block_counts[0], partitions[0])  # warm the workers
        extra = []  # CPU-s per extra partition, at each block count
        for blocks in block_counts:
            few = min(once(blocks, partitions[0]) for _ in range(2))
            many = min(once(blocks, partitions[1]) for _ in range(2))
            extra.append(max(0.0, many - few) * cpus / (partitions[1] - partitions[0]))
    finally:
        ray.shutdown()
    per_piece = max(0.0, (extra[1] - extra[0]) / (block_counts[1] - block_counts[0]))
    return ShuffleRate(max(0.0, extra[0] - per_piece * block_counts[0]), per_piece)


def cpu_encoder_mfu(texts: int = 256, words: tuple[int, int] = (4, 40)) -> float:
    """The bundled encoder's forward on one CPU thread, as a fraction of that thread's fp32 matmul rate: the MFU
    that plan's FLOP arithmetic for embed, evaluate and train on CPUs uses (FLOPs = 2 x parameters without the
    embedding tables x non-padding tokens, as the report counts them). Seeded texts of 4-40 topic words (~23
    tokens; the encoder sorts and pads them as embed does): ~55% here, 68% on equal 50-token texts. The stage's
    own start-up and Ray overhead are not in it (plan's CPU embed without a measured run is a lower bound)."""
    import numpy as np
    import torch

    from clusterscale.modeling.encoder import Encoder, resolve_model_path
    from clusterscale.plan.build import embedding_table_params
    from clusterscale.stages.costs import param_count
    from clusterscale.train.metrics import cpu_matmul_flops

    vocab = "planet orbit telescope galaxy comet recipe oven flour butter sauce stock bond market goal".split()
    rng = np.random.default_rng(0)
    batch = [" ".join(rng.choice(vocab, rng.integers(*words))) for _ in range(texts)]
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = resolve_model_path("bundled")
        encoder = Encoder(model, device="cpu")
        tokens = sum(len(ids) for ids in encoder.tokenizer(batch)["input_ids"])
        encoder.encode(batch[:16])  # warm-up
        started = time.perf_counter()
        encoder.encode(batch)
        seconds = time.perf_counter() - started
        peak = cpu_matmul_flops(1)
    finally:
        torch.set_num_threads(saved)
    flop_params = param_count(model) - (embedding_table_params(model) or 0)
    return 2.0 * flop_params * tokens / seconds / peak


def faiss_search_seconds(rows: int = 20_000, k: int = 1024, dim: int = CALIBRATION_DIM) -> float:
    """CPU-seconds per (row x centroid x dim) of faiss's flat inner-product search on one thread: assign's search
    term, which the synth calibration (k=64) barely exercises."""
    import numpy as np

    from clusterscale.runtime.faiss_index import require_faiss

    faiss = require_faiss()  # through clusterscale's import: its OpenBLAS on this CPU's kernels, as the stages run
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        rng = np.random.default_rng(0)
        x, c = rng.standard_normal((rows, dim), dtype=np.float32), rng.standard_normal((k, dim), dtype=np.float32)
        index = faiss.IndexFlatIP(dim)
        index.add(c)
        index.search(x[:1000], 1)
        started = time.perf_counter()
        index.search(x, 1)
        return (time.perf_counter() - started) / (rows * k * dim)
    finally:
        faiss.omp_set_num_threads(threads)


def _semantic_once(rows: int, dim: int, threshold: float, block_rows: int) -> float:
    import numpy as np

    from clusterscale.runtime.dedup_core import semantic_greedy

    x = np.random.default_rng(0).standard_normal((rows, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    semantic_greedy(x[:256], threshold, block_rows)
    started = time.perf_counter()
    semantic_greedy(x, threshold, block_rows)
    return (time.perf_counter() - started) / (rows * rows * dim)


def semantic_seconds(rows: int = 6144, dim: int = CALIBRATION_DIM) -> float:
    """CPU-seconds per (row x row x dim) of dedup's semantic pass: runtime/dedup_core.semantic_greedy (float64
    blocks, as dedup's per-cluster tasks run it) on one cluster of random unit vectors (no duplicates: every row
    is compared with every earlier one), at dedup's default threshold and block size. In a one-CPU Ray task, so
    that NumPy's BLAS runs one thread, as in dedup's tasks."""
    import ray

    from clusterscale.config import DedupConfig, RayConfig
    from clusterscale.runtime.session import init_ray

    init_ray(RayConfig(num_cpus=os.cpu_count() or 1, include_dashboard=False))
    try:
        task = ray.remote(num_cpus=1)(_semantic_once)
        return ray.get(task.remote(rows, dim, SEMANTIC_THRESHOLD, DedupConfig().block_rows))
    finally:
        ray.shutdown()


def dedup_shuffle_worker(planner: Planner, peak_mb: float) -> dict[str, float]:
    """{"object store": dedup's largest worker} when this run's dedup input holds at least one
    SHUFFLE_MAP_BATCH_BYTES batch and stays below ray.disk_shuffle_min_mib (so its shuffle went through the object
    store with a full batch); {} for a smaller run. Not through local files: a worker of that shuffle kept growing
    past the calibration's sizes (555 MB at 200k rows, 750-757 MB at 600k; benchmarks/RESULTS.md "Dedup"), so
    plan keeps the 600k measurement for it."""
    input_bytes = planner.shuffle_input("dedup")[1]
    if input_bytes < SHUFFLE_MAP_BATCH_BYTES or planner.through_files(input_bytes):
        return {}
    return {"object store": peak_mb}


def calibrate(sizes: list[int], path: str | None, overrides: list[str]) -> str:
    """Run the calibration at each size in `sizes` and write the calibration file; its path."""
    from clusterscale.plan.build import check_number
    from clusterscale.train.metrics import cpu_matmul_flops

    if len(sizes) > MAX_CALIBRATION_SIZES:
        raise ConfigError(f"--calibrate-rows lists {len(sizes)} sizes; the calibration takes at most "
                          f"{MAX_CALIBRATION_SIZES} (three, the default, fit a line well).")
    for rows in sizes:
        check_number("--calibrate-rows", rows, *CALIBRATION_ROWS, "a number of pairs ")

    path = os.path.abspath(os.path.expanduser(path or DEFAULT_CALIBRATION))
    points: dict[str, list] = {s: [] for s in ("ingest", *CALIBRATED_STAGES)}
    memory: dict[str, list] = {s: [] for s in ("ingest", *CALIBRATED_STAGES)}
    folders: dict[str, list] = {}
    machine = this_machine()
    load_before = os.getloadavg()[0]
    search_rate, semantic_rate = faiss_search_seconds(), semantic_seconds()
    shuffle = {path: shuffle_seconds(disk=path == "local files") for path in SHUFFLE_PATHS}
    k_rates = dict(search_cpu_s_per_row_k_d=search_rate, shuffle=shuffle, semantic_cpu_s_per_row_row_d=semantic_rate)
    shuffle_worker: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="cs-calibrate-") as root:
        for rows in sorted(sizes):
            run, costs, peaks = calibration_run(rows, root, overrides)
            cfg = open_run(run.uri, None, overrides)[0]
            shape = run_shape(cfg, rows, CALIBRATION_K, CALIBRATION_DIM,
                              run.read_json(f"shards/k={CALIBRATION_K}/manifest.json")["original_counts"])
            models = Models(0, 0, 0, 0, 0, 0, "")
            for folder, size in folder_bytes(run.root).items():
                count = {"pairs": shape.train_rows, "heldout": shape.heldout_rows}.get(folder)
                if count:
                    folders.setdefault(folder, []).append(size / count)
            bytes_per_row = {k: v[-1] for k, v in folders.items()}
            for stage in ("ingest", *CALIBRATED_STAGES):
                if stage in STAGE_KEYS:  # the stage's own keys (its work and sizing depend on them)
                    cfg = open_run(run.uri, None, [*overrides, *STAGE_KEYS[stage]])[0]
                else:
                    cfg = open_run(run.uri, None, overrides)[0]
                planner = Planner(cfg, shape, machine, Rates(bytes_per_row=bytes_per_row, **k_rates), models, None)
                extra = planner.k_terms(stage)  # the plan adds these on top of the line
                points[stage].append([stage_work(stage, cfg, shape), max(0.0, costs[stage]["wall_s"] - extra)])
                task, driver = planner.task_bytes(stage)
                memory[stage].append((peaks[stage][0] - task / MB, peaks[stage][1] - driver / MB))
                if stage == "dedup" and rows == max(sizes):
                    shuffle_worker = dedup_shuffle_worker(planner, peaks["dedup"][0])
    stages = {}
    for stage in ("ingest", *CALIBRATED_STAGES):
        fixed, per_work = line_fit(points[stage])
        stages[stage] = {"points": points[stage], "fixed_s": fixed, "cpu_s_per_work": per_work * machine.cpus,
                         "cpus": machine.cpus, "task_base_mb": max(0.0, min(m[0] for m in memory[stage])),
                         "driver_base_mb": max(0.0, min(m[1] for m in memory[stage]))}
    data = {"format": CALIBRATION_FORMAT, "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": {"cpus": machine.cpus, "load_avg_before": load_before, "load_avg_after": os.getloadavg()[0]},
            "runs": [{"rows": n, "k": CALIBRATION_K, "dim": CALIBRATION_DIM, "data": "clusterscale synth"}
                     for n in sorted(sizes)],
            "stages": stages, "bytes_per_row": {k: sum(v) / len(v) for k, v in folders.items()},
            "cpu_flops_per_s_per_cpu": cpu_matmul_flops(1), "search_cpu_s_per_row_k_d": search_rate,
            "shuffle_cpu_s": {path: asdict(rate) for path, rate in shuffle.items()},
            "semantic_cpu_s_per_row_row_d": semantic_rate,
            "cpu_encoder_mfu": cpu_encoder_mfu(), "dedup_shuffle_worker_mb": shuffle_worker,
            "note": "synth text (topic words): bytes per row of real text differ; pass --run-dir of a real run"}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2)
    os.replace(path + ".tmp", path)
    return path

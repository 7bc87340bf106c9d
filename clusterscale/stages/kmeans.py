"""Fit spherical k-means over W Ray actors on a seeded sample of embeddings/, and assign every row.

fit:    kmeans/k=<k>/centroids.npy + fit_stats.json   (`clusterscale fit`, after `embed`)
assign: assign/k=<k>/  = embeddings rows + cluster:int32 + cos:float32 (`clusterscale assign`)
The math lives in clusterscale/runtime/kmeans_core.py; this module only distributes it.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import math
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from clusterscale.config import Config
from clusterscale.io.sizing import ASSIGN_UNIT_ROWS
from clusterscale.io.layout import assign_dir, centroids_path, fit_stats_path
from clusterscale.runtime.kmeans_core import (ClusteringError, LloydWorker, check_vectors, init_candidates, lloyd,
                                      lloyd_partials, pick_initial)
from clusterscale.runtime.fit_sample import RowGroupUnit, choose_sample_units, read_sample_rows, row_group_units
from clusterscale.runtime.nodes import map_spread, node_stats, this_node, unit_delay_for_tests
from clusterscale.runtime.progress import ProgressLine
from clusterscale.runtime.bounded_data import release_freed_memory
from clusterscale.runtime.resources import ActorPlan, ClusterResources, Resources, plan_actors
from clusterscale.io.rundir import RunDir, StageInputChangedError, StageResult
from clusterscale.runtime import faiss_index
from clusterscale.runtime.session import faiss_runtime_env
from clusterscale.runtime.stage_context import StageContext
from clusterscale.runtime.vector_search import build_index, top_k, wants_gpus
from clusterscale.runtime.vectors import EMBEDDINGS_ROW_GROUP_ROWS, clustered_matrix
from clusterscale.runtime.work_units import load_or_make_plan, split_done

__all__ = ["ClusteringError", "check_vectors", "run_fit", "run_assign",
           "load_centroids", "AssignBatches", "assign_units"]


# --- fit ------------------------------------------------------------------------------------------------
def split_units(units: list[RowGroupUnit], workers: int) -> list[list[RowGroupUnit]]:
    """Contiguous runs of units with about equal rows per worker (fewer workers if there are few units)."""
    total = sum(u.rows for u in units)
    slices, current, acc = [], [], 0
    for unit in units:
        current.append(unit)
        acc += unit.rows
        if acc >= total * (len(slices) + 1) / workers and len(slices) < workers - 1:
            slices.append(current)
            current = []
    return [s for s in slices + [current] if s]


def read_sample_slice(run_uri: str, units: list[RowGroupUnit], keep_fraction: float, seed: int,
                      side: str = "passage", dims: int = 0) -> tuple[np.ndarray, list]:
    """One worker's part of the fit sample (runs in the actor): see clusterscale/runtime/fit_sample.py."""
    return read_sample_rows(RunDir(run_uri), units, keep_fraction, seed, side, dims)


class SampleShard:
    """One worker of the fit: holds its slice of the fit sample in memory for all iterations."""

    def __init__(self, load, threads: int, use_gpu: bool = False, backend: str = "faiss"):
        faiss_index.set_threads(threads)
        self.use_gpu = use_gpu
        self.ids, chunks = load()
        self.dims = sorted({c.shape[1] for c in chunks})
        self.x = np.concatenate(chunks) if len(self.dims) == 1 else np.zeros((0, 0), np.float32)
        del chunks  # the sample is held once from here on (twice only while it is concatenated)
        self.worker = LloydWorker(self.x, use_gpu, backend) if len(self.dims) == 1 else None

    def describe(self) -> dict:
        return {"rows": len(self.ids), "dims": self.dims, "node": this_node(),
                "nonfinite_rows": int((~np.isfinite(self.x).all(axis=1)).sum()) if self.x.size else 0}

    def init_candidates(self, k: int, seed: int):
        return init_candidates(self.ids, self.x, k, seed) if len(self.ids) else None

    def step(self, centroids: np.ndarray):
        if not len(self.ids):
            return lloyd_partials(np.zeros((0, centroids.shape[1]), np.float32), centroids)
        return self.worker.step(centroids)


def fit_resources(need: Resources, num_workers: int, units: int, backend: str = "faiss") -> ActorPlan:
    """The fit's actors: one per GPU (when the cluster has GPUs the backend can use: vector_search.wants_gpus), else
    one per node sharing its CPUs."""
    cluster = ClusterResources.current()
    return plan_actors(need, max_actors=num_workers, work_units=units, cpu_actors=cluster.nodes,
                       use_gpu=wants_gpus(backend, cluster.gpus), cluster=cluster)


def fit_on_actors(actors: list, k: int, niter: int, seed: int, log=None) -> tuple[np.ndarray, dict]:
    """Seeded init and niter Lloyd iterations over live SampleShard actors (driver side)."""
    candidates = ray.get([a.init_candidates.remote(k, seed) for a in actors])
    initial = pick_initial([c for c in candidates if c is not None], k)  # a worker may sample no rows

    def step(centroids: np.ndarray) -> list:
        ref = ray.put(centroids)  # one copy in the object store per iteration, not one per actor
        return ray.get([a.step.remote(ref) for a in actors])

    return lloyd(step, initial, niter, log)


def start_sample_shards(loads: list, plan: ActorPlan, backend: str = "faiss") -> list:
    options = {"runtime_env": faiss_runtime_env(), "scheduling_strategy": "SPREAD"} | plan.options
    actor_cls = ray.remote(SampleShard).options(**options)
    return [actor_cls.remote(load, plan.threads, plan.on_gpu, backend) for load in loads]


def check_sample(descriptions: list[dict], k: int) -> int:
    """Raise ClusteringError for mixed dimensions, NaN/inf vectors or a sample smaller than k."""
    dims = sorted({d for desc in descriptions for d in desc["dims"]})
    if len(dims) > 1 or any(len(desc["dims"]) > 1 for desc in descriptions):
        raise ClusteringError(f"embeddings/ mixes vectors of dimensions {dims}: it holds output of different "
                              f"encoders. Delete embeddings/ and re-run `clusterscale embed`.")
    bad = sum(desc["nonfinite_rows"] for desc in descriptions)
    if bad:
        raise ClusteringError(f"{bad} sampled embedding rows hold NaN/inf: the encoder is broken. Re-run "
                              f"`clusterscale embed` with a working embed.model (delete embeddings/ first).")
    rows = sum(desc["rows"] for desc in descriptions)
    if rows < k:
        raise ClusteringError(f"The fit sample holds {rows} vectors, fewer than cluster.k={k}: lower cluster.k, "
                              f"raise cluster.max_points_per_centroid, or set cluster.fit_sample=all.")
    return rows


def embedded_units(run: RunDir) -> list[RowGroupUnit]:
    """The row groups of embeddings/ (row_group_units), after checking their rows add up to the count in its done
    marker: a file lost or cut short since embed (a marker without a file list is not checked by the executor) is
    refused here, for the price of the footers the stage reads anyway."""
    units = row_group_units(run)
    marker = run.done_marker("embeddings")
    counted, found = marker.stats.get("rows"), sum(u.rows for u in units)
    if isinstance(counted, int) and found != counted:
        advice = run.rebuild_advice("embeddings", "embed", marker)
        raise StageInputChangedError(
            f"The files of embeddings/ in {run.path()} hold {found} rows, but its done marker counts {counted}: files "
            f"were lost or changed after embed finished. {advice[:1].upper()}{advice[1:]}.")
    return units


def check_cluster_dims(cfg: Config, run: RunDir, path: str) -> None:
    """cluster.dims must not exceed the embeddings' width (path: an embeddings/ file; checked on the driver, before
    any actor reads)."""
    dims = cfg.cluster.dims
    if not dims:
        return
    with run.fs.open_input_file(path) as f:
        width = pq.read_schema(f).field("emb").type.list_size
    if dims > width:
        raise ClusteringError(f"cluster.dims={dims} is more than the embeddings' {width} dimensions: set it to at "
                              f"most {width} (0 = every dimension).")


def run_fit(ctx: StageContext) -> StageResult:
    """Fit spherical k-means on a seeded sample of embeddings/ into kmeans/k=<k>/ (centroids, fit_stats)."""
    cfg, run = ctx.cfg, ctx.run
    k = cfg.cluster.k
    n_rows = int(run.done_stats("embeddings").get("rows", 0))
    units = embedded_units(run)
    n_files_rows = sum(u.rows for u in units)
    if n_rows == 0 or n_files_rows == 0:
        raise ClusteringError(f"embeddings/ in {run.path()} holds no rows: ingest kept no pairs or embed wrote "
                              f"nothing. Check `clusterscale ingest` output (pairs/, quarantine/) and re-run embed.")
    if k > n_files_rows:
        raise ClusteringError(f"cluster.k={k} is larger than the number of embedded pairs ({n_files_rows}): "
                              f"lower cluster.k or ingest more data.")
    started = time.time()
    wanted = n_files_rows if cfg.cluster.fit_sample == "all" else cfg.cluster.max_points_per_centroid * k
    sample_units, keep_fraction = choose_sample_units(units, wanted, cfg.cluster.seed)
    backend = cfg.ray.vector_backend
    plan = fit_resources(ctx.resources, cfg.cluster.num_workers, len(sample_units), backend)
    slices = split_units(sample_units, plan.actors)
    check_cluster_dims(cfg, run, units[0].path)
    loads = [functools.partial(read_sample_slice, run.uri, s, keep_fraction, cfg.cluster.seed, cfg.cluster.side,
                               cfg.cluster.dims) for s in slices]
    actors = start_sample_shards(loads, plan, backend)
    progress = ProgressLine("fit", cfg.cluster.niter, unit="iterations",
                            before_first="the workers read the sample first")
    try:
        descriptions = ray.get([a.describe.remote() for a in actors])
        n_sample = check_sample(descriptions, k)
        dim = next(d for desc in descriptions for d in desc["dims"])
        load_s = time.time() - started
        centroids, stats = fit_on_actors(actors, k, cfg.cluster.niter, cfg.cluster.seed,
                                         log=lambda _: progress.advance(1))
    finally:
        for a in actors:
            ray.kill(a)
    buf = io.BytesIO()
    np.save(buf, centroids)
    run.write_bytes(centroids_path(k), buf.getvalue())
    wall = time.time() - started
    stats.update({"k": k, "niter": cfg.cluster.niter, "seed": cfg.cluster.seed, "n_sample": n_sample,
                  "sample_fraction": round(keep_fraction, 6), "sample_row_groups": len(sample_units),
                  "row_groups": len(units), "sample_rows_read": sum(u.rows for u in sample_units),
                  "sample_bytes_read": sum(u.sample_bytes for u in sample_units),
                  "embeddings_bytes": sum(u.sample_bytes for u in units), "dim": dim, "num_workers": len(actors),
                  "threads_per_worker": plan.threads, "device": plan.device,
                  "load_s": round(load_s, 3), "wall_s": round(wall, 3),
                  "worker_s": round(wall * len(actors), 3), **node_stats(d["node"] for d in descriptions)})
    run.write_json(fit_stats_path(k), stats)
    print(f"[fit] k={k} on {n_sample} sampled vectors (d={dim}) over {len(actors)} worker(s): objective "
          f"{stats['objective']:.1f}, imbalance {stats['imbalance_factor']:.2f}, {wall:.1f}s", flush=True)
    return StageResult(stats, config={"cluster": cfg.cluster.to_dict()})


def load_centroids(run: RunDir, k: int) -> np.ndarray:
    return np.load(io.BytesIO(run.read_bytes(centroids_path(k))))


# --- assign ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AssignIndex:
    """What an assign actor builds its centroid index from: exact (flat) or IVF (k >= 10k, faster, approximate; an
    IVF index is trained with a fixed seed, so every actor builds the same one), on ray.vector_backend."""
    centroids: np.ndarray
    kind: str = "flat"
    nprobe: int = 1
    backend: str = "faiss"
    side: str = "passage"  # cluster.side: which vector of a row is assigned (runtime/vectors.clustered_matrix)
    dims: int = 0  # cluster.dims: on its first dims dimensions (0 = all)


def build_assign_index(centroids: np.ndarray, kind: str, nprobe: int, backend: str = "faiss",
                       side: str = "passage", dims: int = 0) -> AssignIndex:
    k = centroids.shape[0]
    if kind == "auto":
        kind = "ivf" if k >= 10_000 else "flat"
    return AssignIndex(np.ascontiguousarray(centroids, dtype=np.float32), kind, nprobe, backend, side, dims)


class AssignBatches:
    """Ray Data callable class: nearest centroid by inner product and its cosine (vector_search.top_k: the same on
    every backend)."""

    def __init__(self, spec: AssignIndex):
        """spec: build_assign_index's."""
        self.centroids, self.side, self.dims = spec.centroids, spec.side, spec.dims
        self.index = build_index(spec.centroids, spec.backend, bool(ray.is_initialized() and ray.get_gpu_ids()),
                                 spec.kind, nlist=max(1, int(math.sqrt(len(spec.centroids)))), nprobe=spec.nprobe)

    def __call__(self, batch: pa.Table) -> pa.Table:
        x = clustered_matrix(batch, self.side, self.dims)
        check_vectors(x, "embeddings/", dim=self.centroids.shape[1])
        sims, labels = top_k(self.index, self.centroids, x, 1)
        if (labels < 0).any():  # IVF with too small nprobe can find no list for a row
            raise ClusteringError("The IVF assign index found no centroid for some rows: raise "
                                  "cluster.ivf_nprobe or use cluster.assign_index=flat.")
        return batch.append_column("cluster", pa.array(labels[:, 0].astype(np.int32))).append_column(
            "cos", pa.array(sims[:, 0].astype(np.float32)))


PLAN_FILE = "_plan.json"  # assign/k=<k>/'s units, fixed at the first attempt (io/sizing.ASSIGN_UNIT_ROWS rows each)


def assign_units(run: RunDir) -> list[dict]:
    """Work units over embeddings/ from the Parquet footers: runs of whole row groups of one file, at most
    ASSIGN_UNIT_ROWS rows each (or one larger row group), numbered in file order."""
    units: list[dict] = []
    for unit in embedded_units(run):
        last = units[-1] if units else None
        if last and last["path"] == unit.path and last["rows"] + unit.rows <= ASSIGN_UNIT_ROWS:
            last["row_groups"].append(unit.group)
            last["rows"] += unit.rows
        else:
            units.append({"unit": len(units), "path": unit.path, "row_groups": [unit.group], "rows": unit.rows})
    return units


class AssignUnits(AssignBatches):
    """AssignBatches over work units: each call reads its units' row groups itself (pyarrow, one unit at a
    time), assigns them and writes assign/k=<k>/part-<unit>.parquet atomically; returns the row counts.

    Reading here, not through Ray Data's Parquet read, keeps every process at O(one unit): the read tasks pack
    128 MiB bins of several files and read ahead, which measured ~1 GB per read worker, growing with N. A
    retried unit rewrites the same file, so no row is duplicated."""

    def __init__(self, index: bytes, run_uri: str, out_dir: str):
        super().__init__(index)
        self.run, self.out_dir = RunDir(run_uri), out_dir

    def __call__(self, units: pa.Table) -> pa.Table:
        rows = []
        for unit in units.to_pylist():
            unit_delay_for_tests("assign")
            with self.run.fs.open_input_file(unit["path"]) as f:
                table = pq.ParquetFile(f).read_row_groups(unit["row_groups"])
            self.run.write_parquet(f"{self.out_dir}/part-{unit['unit']:05d}.parquet", super().__call__(table),
                                   row_group_size=EMBEDDINGS_ROW_GROUP_ROWS)
            rows.append(table.num_rows)
            del table
            release_freed_memory()  # else the allocators keep each unit's pages: creeps with units
        return pa.table({"rows": pa.array(rows, pa.int64()),
                         "node": pa.array([this_node()] * len(rows), pa.string())})


def run_assign(ctx: StageContext) -> StageResult:
    """Assign every embedded pair to its nearest centroid of kmeans/k=<k>/, into assign/k=<k>/ (one file per unit; an
    interrupted attempt with this fingerprint is finished, its files kept)."""
    cfg, run = ctx.cfg, ctx.run
    k = cfg.cluster.k
    out = assign_dir(k)
    started = time.time()
    index = build_assign_index(load_centroids(run, k), cfg.cluster.assign_index, cfg.cluster.ivf_nprobe,
                               cfg.ray.vector_backend, cfg.cluster.side, cfg.cluster.dims)
    n_rows = run.done_stats("embeddings")["rows"]
    cluster = ClusterResources.current()
    # Fractional CPUs leave room for the read tasks (whole-CPU actors deadlock Ray Data on small boxes).
    plan = plan_actors(ctx.resources, cpu_actors=cluster.cpus,
                       use_gpu=wants_gpus(cfg.ray.vector_backend, cluster.gpus), cluster=cluster)
    remote_args = plan.options | ({} if plan.on_gpu else {"runtime_env": faiss_runtime_env()})
    units = assign_units(run)
    # The units are fixed with the plan (embeddings/ is fixed for this fingerprint): a rerun after a kill or a lost
    # node writes only the files not yet written, into the same names.
    work = load_or_make_plan(run, out, f"{out}/{PLAN_FILE}", ctx.fingerprint, "assignment", lambda: {
        "units": [{"output": f"{out}/part-{u['unit']:05d}.parquet", "rows": u["rows"]} for u in units]})
    done, todo = split_done(run, out, work["units"])
    left = {u["output"] for u in todo}
    units = [u for u, planned in zip(units, work["units"]) if planned["output"] in left]
    if done:
        print(f"[assign] resuming: {len(done)} of {len(work['units'])} units were written by an earlier attempt",
              flush=True)
    ds = ray.data.from_items(units, override_num_blocks=max(1, len(units)))
    # At least one actor per node from the start, spread: every node takes a share of the units, and a node's loss
    # costs only the units in flight there. Autoscaling from one actor would leave small runs on one node.
    first = max(1, min(plan.actors, cluster.nodes, len(units)))
    ds = map_spread(ds.map_batches, AssignUnits, first_actors=first, on_gpu=plan.on_gpu,
                    fn_constructor_args=(index, run.uri, out), batch_size=1, batch_format="pyarrow",
                    compute=ray.data.ActorPoolStrategy(min_size=first, max_size=max(first, plan.actors)), **remote_args)
    progress, written, nodes = ProgressLine("assign", n_rows), sum(u["rows"] for u in done), set()
    progress.advance(written)
    for result in (ds.iter_rows() if units else ()):  # the driver sees counts only: progress, and the total checked
        written += result["rows"]
        nodes.add(result["node"])
        progress.advance(result["rows"])
    if written != n_rows:
        raise RuntimeError(f"assign wrote {written} rows but embeddings/ holds {n_rows}: rerun `clusterscale assign`.")
    wall = time.time() - started
    stats = {"k": k, "rows": n_rows, "index": cfg.cluster.assign_index, "wall_s": round(wall, 3),
             "rows_per_s": round(n_rows / wall, 1), "worker_s": round(wall, 3), **node_stats(nodes)}
    print(f"[assign] {n_rows} rows to {k} centroids in {wall:.1f}s", flush=True)
    return StageResult(stats)

"""clusterscale's spherical k-means fit vs faiss.Kmeans, and fit/assign/shard scaling in N and k.

    python benchmarks/bench_kmeans.py [--n 65536 --k 256 --dim 128 --niter 20] [--json PATH]
    python benchmarks/bench_kmeans.py --scaling --ns 10000 100000 --ks 10 100 [--json PATH]
    python benchmarks/bench_kmeans.py --gpu            (faiss-gpu; on a GPU box)

Compare mode, on the same fp16-rounded clustered unit vectors, k, niter and seed:
  faiss     faiss.Kmeans(d, k, spherical=True).train(x), all rows (no subsampling), all CPU threads
  core      clusterscale.runtime.kmeans_core.fit_spherical_kmeans(x) in this process, all CPU threads
  ray_w1/2  the Ray fit (fit_on_actors) over 1 / 2 SampleShard actors holding the rows in memory,
            threads split between actors. Timed: seeded init + niter Lloyd iterations; NOT timed: Ray
            startup, actor startup and loading the rows (the stage reports those as load_s).
Every round runs all four methods one after another (this VM's speed drifts from minute to minute);
each time reported is the best of --repeats rounds, and every round's time is in the JSON (*_all_s).
objective = sum over rows of the cosine to the nearest final centroid (higher is better), computed
the same way for every method; objective_ratio = faiss / clusterscale (goal <= 1.01).
time_ratio_w1 / _w2 = ray_w1 / faiss and ray_w2 / faiss seconds (goal for w1 <= 1.25).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

# The same OpenMP wait policy for faiss.Kmeans and the core in this process as the fit actors get
# (clusterscale.runtime.session.faiss_runtime_env), set before faiss loads OpenMP. --omp-default leaves this
# process at libgomp's default instead: faiss.Kmeans as a user would run it, against clusterscale as shipped.
if "--omp-default" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# faiss through clusterscale's import, so faiss.Kmeans and the core run on the same OpenBLAS kernels (faiss_index)
from clusterscale.runtime.faiss_index import faiss  # noqa: E402

from clusterscale.runtime.kmeans_core import fit_spherical_kmeans, nearest_centroid  # noqa: E402
from clusterscale.stages.synthetic import clustered_unit_vectors  # noqa: E402


def objective(x: np.ndarray, centroids: np.ndarray) -> float:
    return float(nearest_centroid(x, centroids)[0].astype(np.float64).sum())


def in_memory_slice(ids: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, list]:
    return ids, [x]


def ray_fit(x: np.ndarray, k: int, niter: int, seed: int, workers: int, cpus: int) -> tuple[np.ndarray, float]:
    import ray

    from clusterscale.runtime.resources import ActorPlan
    from clusterscale.stages.kmeans import fit_on_actors, start_sample_shards

    ids = np.arange(len(x), dtype=np.int64)
    bounds = np.linspace(0, len(x), workers + 1).astype(int)
    loads = [functools.partial(in_memory_slice, ids[a:b], x[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    threads = max(1, cpus // workers)
    actors = start_sample_shards(loads, ActorPlan(actors=workers, threads=threads, num_cpus=threads, num_gpus=0))
    ray.get([a.describe.remote() for a in actors])  # wait until the rows are loaded: not timed
    started = time.perf_counter()
    centroids, _ = fit_on_actors(actors, k, niter, seed)
    seconds = time.perf_counter() - started
    for a in actors:
        ray.kill(a)
    return centroids, seconds


def compare(args) -> dict:
    import ray

    x, _ = clustered_unit_vectors(args.n, args.dim, args.topics, seed=args.seed)
    cpus = os.cpu_count() or 1
    faiss.omp_set_num_threads(cpus)
    result = {"n": args.n, "k": args.k, "dim": args.dim, "niter": args.niter, "seed": args.seed, "cpus": cpus,
              "device": "gpu" if args.gpu else "cpu",
              "omp_wait_policy_driver": os.environ.get("OMP_WAIT_POLICY", "unset (libgomp default)")}
    result["repeats"] = args.repeats  # every time below is the best of `repeats` runs (the box is shared)
    methods = ["faiss", "core"] + ([] if args.gpu else ["ray_w1", "ray_w2"])  # on a GPU box: `clusterscale fit`
    seconds = {m: [] for m in methods}
    centroids = {}
    if not args.gpu:
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level="ERROR")
        time.sleep(10)  # let Ray's pre-started idle workers finish importing before anything is timed
    for _ in range(args.repeats):  # every round runs every method, so that load changes hit all of them
        for method in methods:
            if method == "faiss":
                started = time.perf_counter()
                km = faiss.Kmeans(args.dim, args.k, niter=args.niter, seed=args.seed, spherical=True, gpu=args.gpu,
                                  max_points_per_centroid=args.n, verbose=False)
                km.train(x)
                seconds[method].append(time.perf_counter() - started)
                centroids[method] = km.centroids
            elif method == "core":
                started = time.perf_counter()
                centroids[method], _ = fit_spherical_kmeans(x, args.k, args.niter, args.seed, use_gpu=args.gpu)
                seconds[method].append(time.perf_counter() - started)
            else:
                centroids[method], took = ray_fit(x, args.k, args.niter, args.seed, int(method[-1]), cpus)
                seconds[method].append(took)
    if not args.gpu:
        ray.shutdown()
    for method in methods:
        result[f"{method}_s"] = min(seconds[method])
        result[f"{method}_all_s"] = [round(s, 3) for s in seconds[method]]
    for w in (1, 2):
        if f"ray_w{w}" in centroids:
            result[f"ray_w{w}_equals_core"] = bool(np.array_equal(centroids[f"ray_w{w}"], centroids["core"]))
    objectives = {m: objective(x, c) for m, c in centroids.items()}
    result["objective"] = objectives
    result["objective_ratio"] = objectives["faiss"] / objectives["core"]
    result["time_ratio_core"] = result["core_s"] / result["faiss_s"]
    for w in (1, 2):
        if f"ray_w{w}_s" in result:
            result[f"time_ratio_w{w}"] = result[f"ray_w{w}_s"] / result["faiss_s"]
            # The same ratio paired within each round, median over rounds: less sensitive to one lucky run.
            result[f"time_ratio_w{w}_paired_median"] = float(np.median(
                np.array(seconds[f"ray_w{w}"]) / np.array(seconds["faiss"])))
    return result


def scaling(args) -> list[dict]:
    """Real stages (fit, assign, shard, through the pipeline's executor) on synthetic embeddings/ in a temp run dir."""
    import ray

    from clusterscale import config as config_mod
    from clusterscale.io.rundir import RunDir
    from clusterscale.pipeline import run_stage
    from clusterscale.stages.kmeans import ClusteringError
    from clusterscale.stages.synthetic import write_embeddings_stage

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    rows = []
    for n in args.ns:
        x, _ = clustered_unit_vectors(n, args.dim, max(args.ks), seed=args.seed)
        with tempfile.TemporaryDirectory() as tmp:
            run = RunDir(os.path.join(tmp, "run"))
            write_embeddings_stage(run, x, rows_per_file=100_000)
            for k in args.ks:
                if k * 10 > n:
                    continue
                cfg = config_mod.load(None, ["data.path=synthetic", f"cluster.k={k}", f"cluster.niter={args.niter}",
                                             f"train.global_batch_size={args.batch}", "train.num_workers=1"])
                row = {"n": n, "k": k, "dim": args.dim, "niter": args.niter}
                for stage in ("fit", "assign", "shard"):
                    started = time.perf_counter()
                    try:
                        stats = run_stage(stage, cfg, run).stats
                    except ClusteringError as exc:  # e.g. every cluster smaller than one batch: a row, not a crash
                        row[f"{stage}_error"] = str(exc)
                        break
                    row[f"{stage}_s"] = round(time.perf_counter() - started, 2)
                    if stage == "shard":
                        row["shards"], row["files"] = stats["shards"], stats["files"]
                    if stage == "fit":
                        row["fit_sample"] = stats["n_sample"]
                print(json.dumps(row), flush=True)
                rows.append(row)
    ray.shutdown()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=65_536, help="vectors (compare mode); 256 x k = FAISS's own sample")
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--topics", type=int, default=400, help="true directions of the synthetic data")
    p.add_argument("--niter", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="compare mode: best of this many runs of each method")
    p.add_argument("--scaling", action="store_true", help="sweep N and k through fit/assign/shard")
    p.add_argument("--ns", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--ks", type=int, nargs="+", default=[10, 100, 1_000, 10_000])
    p.add_argument("--batch", type=int, default=64, help="train.global_batch_size (small-cluster threshold)")
    p.add_argument("--gpu", action="store_true", help="faiss GPU index in faiss and in the core (needs faiss-gpu)")
    p.add_argument("--omp-default", action="store_true", help="run faiss.Kmeans and the core at libgomp's default "
                   "wait policy (the fit actors keep clusterscale's PASSIVE)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.scaling:
        result = {"scaling": scaling(args)}
    else:
        result = compare(args)
        print(f"objective ratio faiss/clusterscale {result['objective_ratio']:.4f} | seconds: faiss "
              f"{result['faiss_s']:.2f}, core {result['core_s']:.2f}"
              + "".join(f", ray W={w} {result[f'ray_w{w}_s']:.2f} (x{result[f'time_ratio_w{w}']:.2f})"
                        for w in (1, 2) if f"ray_w{w}_s" in result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

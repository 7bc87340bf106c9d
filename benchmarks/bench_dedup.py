"""The dedup stage against the plain alternative (faiss range search per cluster, one process), and its memory
at N and 4N.

    python benchmarks/bench_dedup.py [--rows 40000 --dim 64 --k 20 --topics 20 --threshold 0.88] [--json OUT]

For N and 4N it writes a synthetic run (`clusterscale synth`), fits and assigns at k (and at 4k for 4N: a
k that grows with N keeps clusters the same size), then runs `clusterscale dedup` (semantic only, keep=hard)
as its own CLI process (dedup/ then holds that k's output: dedup/_DONE.json, dedup/removed/), sampling the memory of every process of its tree (bench_scale's sampler: the peak
USS of the largest single process). At N it also runs the plain alternative a user would write: read
assign/k=<k>/ and heldout/ into one process, held-out leaks by text and by a faiss range search over the
held-out vectors, then per cluster a faiss IndexFlatIP range search of the cluster against itself and the
same greedy walk in keep order. It checks that both remove the same pairs for the same reasons and records
the time ratio (stage wall time from report/costs.json, without Ray's start-up / plain seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_scale import cli, machine, run_sampled, stage_wall_s  # noqa: E402

from clusterscale.io.layout import DEDUP  # noqa: E402
from clusterscale.io.rundir import RunDir  # noqa: E402
from clusterscale.runtime.faiss_index import faiss  # noqa: E402  (its OpenBLAS on this CPU's kernels)
from clusterscale.runtime.dedup_core import keep_order, keep_rank, normalised  # noqa: E402
from clusterscale.runtime.vectors import emb_matrix  # noqa: E402
from clusterscale.stages.dedup import removed_table  # noqa: E402


# --- the plain alternative ---------------------------------------------------------------------------------
def read_folder(run: RunDir, folder: str, columns: list[str]) -> pa.Table:
    return pa.concat_tables([pq.read_table(run.fs.open_input_file(f), columns=columns) for f in run.files(folder)])


def greedy_by_range_search(x: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """(kept, duplicate_of index) of rows already in keep order, from a faiss range search of x against itself."""
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    lims, sims, ids = index.range_search(x, threshold)
    kept, dup_of = np.zeros(len(x), bool), np.full(len(x), -1, np.int64)
    for j in range(len(x)):
        nb, s = ids[lims[j]:lims[j + 1]], sims[lims[j]:lims[j + 1]]
        earlier = (nb < j) & kept[nb]
        if earlier.any():
            nb, s = nb[earlier], s[earlier]
            dup_of[j] = nb[np.lexsort((nb, -s))[0]]  # the most similar kept row; equal: the earliest
        else:
            kept[j] = True
    return kept, dup_of


def plain_dedup(run: RunDir, k: int, threshold: float) -> dict[int, tuple[str, int]]:
    """{removed pair_id: (reason, duplicate_of)} in one process (keep=hard, semantic only)."""
    rows = read_folder(run, f"assign/k={k}", ["pair_id", "query", "passage", "emb", "cluster", "cos"])
    held = read_folder(run, "heldout", ["pair_id", "query", "passage", "emb"])
    pair_ids, cluster, cos = (rows.column(c).to_numpy() for c in ("pair_id", "cluster", "cos"))
    x = emb_matrix(rows.column("emb"))
    removed: dict[int, tuple[str, int]] = {}
    held_ids = held.column("pair_id").to_numpy()
    for side in ("query", "passage"):
        texts: dict[str, int] = {}
        for t, pid in zip(held.column(side).to_pylist(), held_ids):
            texts.setdefault(normalised(t), int(pid))
        for i, t in enumerate(rows.column(side).to_pylist()):
            if normalised(t) in texts and int(pair_ids[i]) not in removed:
                removed[int(pair_ids[i])] = ("heldout_leak", texts[normalised(t)])
    held_index = faiss.IndexFlatIP(x.shape[1])
    held_index.add(emb_matrix(held.column("emb")))
    lims, sims, ids = held_index.range_search(x, threshold)
    for i in range(len(x)):
        if lims[i + 1] > lims[i] and int(pair_ids[i]) not in removed:
            s, nb = sims[lims[i]:lims[i + 1]], ids[lims[i]:lims[i + 1]]
            removed[int(pair_ids[i])] = ("heldout_leak", int(held_ids[nb[np.lexsort((nb, -s))[0]]]))
    alive = np.array([int(p) not in removed for p in pair_ids])
    for c in np.unique(cluster):
        rows_c = np.flatnonzero((cluster == c) & alive)
        rows_c = rows_c[keep_order(pair_ids[rows_c], keep_rank(pair_ids[rows_c], cos[rows_c], "hard", 0))]
        kept, dup_of = greedy_by_range_search(np.ascontiguousarray(x[rows_c]), threshold)
        for j in np.flatnonzero(~kept):
            removed[int(pair_ids[rows_c[j]])] = ("semantic", int(pair_ids[rows_c[dup_of[j]]]))
    return removed


# --- the stage at N and 4N ---------------------------------------------------------------------------------
def stage_keys(k: int, args) -> list[str]:
    return [f"cluster.k={k}", f"data.rows_per_part={args.rows_per_part}", "dedup.keep=hard",
            f"dedup.semantic_threshold={args.threshold}"]


def measure(rows: int, ks: list[int], args, root: str) -> dict:
    """Synth, then fit + assign + dedup at each k; {k: dedup measurement}, and the plain comparison at the first k."""
    run_dir, logs = os.path.join(root, f"rows={rows}"), os.path.join(root, f"logs-{rows}")
    os.makedirs(logs, exist_ok=True)
    out = {}
    setup = run_sampled(cli("synth", run_dir, stage_keys(ks[0], args), ["--rows", str(rows), "--dim", str(args.dim),
                                                                       "--topics", str(args.topics)]),
                        os.path.join(logs, "synth.log"), 1.0)
    assert setup["returncode"] == 0, setup
    for k in ks:
        for verb in ("fit", "assign"):
            step = run_sampled(cli(verb, run_dir, stage_keys(k, args)), os.path.join(logs, f"{verb}-{k}.log"), 1.0)
            assert step["returncode"] == 0, step
        result = run_sampled(cli("dedup", run_dir, stage_keys(k, args), ["--replace"]),
                             os.path.join(logs, f"dedup-{k}.log"), args.interval)
        assert result["returncode"] == 0, result
        run = RunDir(run_dir)
        result |= {"stage_wall_s": stage_wall_s(run_dir, "dedup"), "stats": {
            key: run.done_stats(DEDUP)[key] for key in ("rows", "removed", "semantic", "heldout_leak")},
            "largest_cluster": max(int(n) for n in np.bincount(read_folder(
                run, f"assign/k={k}", ["cluster"]).column("cluster").to_numpy()))}
        if k == ks[0] and rows == args.rows:
            stage_removed = removed_table(run)  # dedup/removed/ of this k (dedup holds one clustering at a time)
            started = time.time()
            plain = plain_dedup(run, k, args.threshold)
            result["plain_s"] = round(time.time() - started, 3)
            got = dict(zip(stage_removed.column("pair_id").to_pylist(),
                           zip(stage_removed.column("reason").to_pylist(),
                               stage_removed.column("duplicate_of").to_pylist())))
            result["same_removed_set"] = set(got) == set(plain)
            result["same_reason_and_duplicate"] = sum(got.get(p) == v for p, v in plain.items())
            result["plain_removed"] = len(plain)
            result["time_ratio_stage_over_plain"] = round(result["stage_wall_s"] / result["plain_s"], 2)
        out[str(k)] = result
        brief = {x: result.get(x) for x in ("peak_uss_mb", "seconds", "stage_wall_s", "plain_s", "same_removed_set")}
        print(f"[bench_dedup] rows={rows} k={k}: {json.dumps(brief)}", flush=True)
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=40_000, help="N; the second scale is 4N.")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--topics", type=int, default=20)
    parser.add_argument("--threshold", type=float, default=0.88)
    parser.add_argument("--rows-per-part", type=int, default=20_000)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--out-dir")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    root = os.path.abspath(args.out_dir) if args.out_dir else tempfile.mkdtemp(prefix="bench_dedup-")
    before = machine()
    small = measure(args.rows, [args.k], args, root)
    large = measure(4 * args.rows, [args.k, 4 * args.k], args, root)
    fixed, scaled = (large[str(args.k)]["peak_uss_mb"], large[str(4 * args.k)]["peak_uss_mb"])
    base = small[str(args.k)]["peak_uss_mb"]
    result = {"N": small, "4N": large, "growth_fixed_k": round(fixed / base, 3),
              "growth_k_grows_with_N": round(scaled / base, 3),
              "machine": before | {"uptime_after": machine()["uptime"]}, "command": " ".join(sys.argv)}
    text = json.dumps(result, indent=2)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

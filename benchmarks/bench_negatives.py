"""Memory, disk and read amplification of mined negatives at N and 4N rows (the rows carry their negatives).

    python benchmarks/bench_negatives.py [--rows 20000 --k 20 --steps 8 --world 2 --per-query 2]
                                         [--out-dir DIR] [--json OUT]

For N and 4N it writes a synthetic run (`clusterscale synth --set embed.side=both`) and runs fit, assign,
shard and mine, each as its own CLI process. Then, for each run, a fresh process does what rank 0 of a
`--world`-rank job does with its data, without the model: the trainer's TrainData (schedule, ShardReader with
the negatives' sidecars, the padding pool), `--steps` steps of this rank's rows read with prefetch, and M mined
negatives drawn per row. It reports that process's RSS after the imports (`base_rss_mb`), its peak RSS
(`peak_rss_mb`, ru_maxrss) and the difference (`negatives_rss_mb`: what holding the data and the negatives
costs); `growth` = peak at 4N / peak at N.

Disk: `mine_bytes_over_shards` = the bytes of negatives/ after `clusterscale mine` (candidates, padding pool and
the sidecars of the training draw) / the bytes of the shard files, and `plan_mine_bytes` what
train/negatives.mine_disk_bytes (plan's formula) says for the run. Reads: `read_amplification` = the bytes of the
sidecar column chunks rank 0 read, as stored uncompressed / the UTF-8 bytes of the mined texts it handed to
training (the drawn passages and their queries); `read_compressed_over_used` the same with the bytes read from
disk.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import machine, write_result  # noqa: E402  (the sibling module: how a benchmark records its run)
KEYS = ["embed.side=both", "mine.index=ivf", "train.global_batch_size=64", "train.name=bench"]


def rank_memory(run_dir: str, steps: int, world: int) -> dict:
    """Rank 0's data side of `steps` training steps with mined negatives, in this process; its memory."""
    from clusterscale.config import load
    from clusterscale.io.rundir import RunDir
    from clusterscale.train.trainer import SegmentJob, TrainData

    base = _rss_mb()
    run = RunDir(run_dir)
    cfg = load(None, [], run_config=run.config_in_force())
    job = SegmentJob(cfg, run, run, "bench", steps, 0, 0, steps, False)
    started = time.time()
    data = TrainData(job)
    drawn = padded = 0
    for item in data.rank_rows(0, 0, world):
        passages, _, pad = data.negatives.for_rows(item.table, item.batch.step)
        drawn, padded = drawn + len(passages), padded + pad
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sidecars = data.reader.sidecars
    used = data.negatives.texts_used
    return {"rows": int(run.done_stats(f"shards/k={cfg.cluster.k}")["rows"]), "base_rss_mb": round(base, 1),
            "peak_rss_mb": round(peak, 1), "negatives_rss_mb": round(peak - base, 1), "negatives_drawn": drawn,
            "negatives_padded": padded, "seconds": round(time.time() - started, 2),
            "sidecar_bytes_read": sidecars.bytes_read, "sidecar_bytes_read_uncompressed": sidecars.bytes_stored,
            "mined_text_bytes_used": used, "read_amplification": round(sidecars.bytes_stored / max(1, used), 3),
            "read_compressed_over_used": round(sidecars.bytes_read / max(1, used), 3), **disk(run, cfg)}


def disk(run, cfg) -> dict:
    """Bytes of negatives/ (and its sidecars) and of the shards, and what plan's formula says."""
    import pyarrow.parquet as pq

    from clusterscale.io.layout import shards_dir
    from clusterscale.io.negatives import SIDECAR_DIR, candidates_per_query, mine_disk_bytes, training_manifest
    from clusterscale.train.negatives import training_draw

    def size(folder: str) -> int:
        return sum(run.listed_files(folder).values())
    shards, negatives, sidecars = size(shards_dir(cfg.cluster.k)), size("negatives"), size(SIDECAR_DIR)
    manifest = training_manifest(cfg, run)[1]
    draw = training_draw(cfg, manifest)
    sample = pq.read_table(run.path(manifest.files[0]), columns=["query", "passage"])
    text = sum(len(q.encode()) + len(p.encode()) for q, p in zip(*(sample.column(c).to_pylist()
                                                                     for c in ("query", "passage")))) / sample.num_rows
    plan = mine_disk_bytes(sum(manifest.strata_sizes), candidates_per_query(cfg), draw.per_query, draw.draws, text,
                           min(cfg.mine.nprobe, cfg.cluster.k))
    return {"shards_bytes": shards, "negatives_bytes": negatives, "sidecar_bytes": sidecars, "draw": draw.key,
            "mine_bytes_over_shards": round(negatives / shards, 3),
            "plan_mine_bytes": {k: round(v) for k, v in plan.items()}}


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def prepare(run_dir: str, rows: int, k: int, per_query: int) -> None:
    """synth, fit, assign, shard and mine into run_dir (each a CLI process)."""
    keys = [f"cluster.k={k}", f"train.negatives_per_query={per_query}", *KEYS]
    env = {**os.environ, "PYTHONPATH": REPO}
    for verb, extra in (("synth", ["--rows", str(rows), "--dim", "64", "--topics", str(k)]), ("fit", []),
                        ("assign", []), ("shard", []), ("mine", [])):
        subprocess.run([sys.executable, "-m", "clusterscale.cli", verb, "--run-dir", run_dir, *extra, "--set", *keys],
                       check=True, env=env, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000, help="N: pairs of the smaller run (the larger: 4N).")
    parser.add_argument("--k", type=int, default=20, help="cluster.k of both runs.")
    parser.add_argument("--steps", type=int, default=8, help="Training steps whose data rank 0 reads.")
    parser.add_argument("--world", type=int, default=2, help="Ranks the global batch is split over.")
    parser.add_argument("--per-query", type=int, default=2, help="train.negatives_per_query (M).")
    parser.add_argument("--out-dir", help="Where the synthetic runs go (default: a temporary folder).")
    parser.add_argument("--json", help="Also write the result here.")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: measure this run dir in this process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(rank_memory(args.measure, args.steps, args.world)))
        return
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="bench-negatives-")
    before = machine()
    result = {"steps": args.steps, "world": args.world, "per_query": args.per_query, "scales": []}
    for rows in (args.rows, 4 * args.rows):
        run_dir = os.path.join(out_dir, f"n{rows}")
        if not os.path.exists(os.path.join(run_dir, "negatives", "_DONE.json")):
            prepare(run_dir, rows, args.k, args.per_query)
        measured = subprocess.run([sys.executable, __file__, "--measure", run_dir, "--steps", str(args.steps),
                                   "--world", str(args.world)], check=True, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": REPO})
        result["scales"].append(json.loads(measured.stdout.strip().splitlines()[-1]))
    result["growth"] = round(result["scales"][1]["peak_rss_mb"] / result["scales"][0]["peak_rss_mb"], 3)
    write_result(result, before, out_dir, args.json)


if __name__ == "__main__":
    main()

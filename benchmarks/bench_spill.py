"""Object-store pressure: the pipeline on a local Ray whose object store is several times smaller than one stage's
data completes (Ray spills objects to local disk) with the outputs of a run that spills nothing, and how much it
spills per 1M pairs.

    python benchmarks/bench_spill.py [--rows 200000 --dim 384 --k 100 --topics 100 --object-store-mib 80]
                                     [--out-dir DIR] [--json OUT]

Three arms, each one process with its own local Ray (`ray.object_store_mib`), each running the CLI's verbs in turn
as `clusterscale VERB --run-dir R --set ...` does (cli.main): synth N pairs (embed.side=both, so each row carries two
d-dim vectors), then fit, assign, dedup (exact + semantic), shard, mine and train (2 steps of a tiny scratch student;
bench_scale's stage settings). After each verb, Ray's own count of the bytes it spilled (memory_summary: "Spilled X
MiB") gives the verb's share.

  default       Ray's default object store (30% of the machine's memory): the reference, which spills nothing.
  small         --object-store-mib, ray.disk_shuffle as shipped (a shuffle of >= ray.disk_shuffle_min_mib of rows
                goes through local files, not the object store).
  small-memory  --object-store-mib, ray.disk_shuffle=false: every hash shuffle waits in the object store.

The outputs compared with the reference: the k-means objective, the pair_ids of each cluster shard in row order, the
kept and removed pairs of dedup and every query's negatives. `spilled_mib_per_1m_pairs` = spilled / N x 1M.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import DEDUP_KEYS, STAGE_KEYS, machine, write_result  # noqa: E402  (the same stage settings)

VERBS = ("fit", "assign", "dedup", "shard", "mine", "train")
ARMS = {"default": [], "small": ["SMALL"], "small-memory": ["SMALL", "ray.disk_shuffle=false"]}


def spilled_mib() -> float:
    """MiB spilled by this Ray session so far (0 before the first spill: Ray prints no line then)."""
    from ray._private.internal_api import memory_summary

    found = re.search(r"Spilled (\d+) MiB", memory_summary(stats_only=True))
    return float(found.group(1)) if found else 0.0


def run_arm(run_dir: str, keys: list[str], rows: int, dim: int, topics: int) -> dict:
    """Every verb in this process (one local Ray); per verb its seconds, exit code and MiB spilled."""
    from clusterscale import cli

    out, spilled = {}, 0.0
    for verb in ("synth", *VERBS):
        extra = ["--rows", str(rows), "--dim", str(dim), "--topics", str(topics)] if verb == "synth" else []
        started = time.time()
        code = cli.main([verb, "--run-dir", run_dir, *extra, "--set", *keys,
                         *(DEDUP_KEYS if verb == "dedup" else [])])
        now = spilled_mib()
        out[verb] = {"returncode": code, "seconds": round(time.time() - started, 1), "spilled_mib": now - spilled}
        spilled = now
        if code:
            break
    return out


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def outputs(run_dir: str, k: int) -> dict:
    """What must not depend on the object store: digests of each stage's output, in a stable order."""
    import pyarrow.parquet as pq

    from clusterscale.io.rundir import RunDir

    run = RunDir(run_dir)
    manifest = run.read_json(f"shards/k={k}/manifest.json")
    shards = [pq.read_table([run.path(f) for f in c["files"]], columns=["pair_id"]).column(0).to_pylist()
              for c in manifest["clusters"]]

    def ids(folder: str, column: str = "pair_id") -> list:  # its part files, not its subfolders' (sidecars)
        files = [f for f in run.files(folder) if os.path.dirname(f) == run.path(folder)
                 and os.path.basename(f).startswith("part-")]
        if not files:
            return []
        table = pq.read_table(files, columns=sorted({"pair_id", column})).sort_by("pair_id")
        return table.column(column).to_pylist()

    return {"kmeans_objective": round(run.read_json(f"kmeans/k={k}/fit_stats.json")["objective"], 3),
            "shards": digest(shards), "dedup_kept": digest(sorted(ids("dedup/kept"))),
            "dedup_removed": digest(sorted(ids("dedup/removed"))),
            "negatives": digest([ids("negatives"), ids("negatives", "neg_pair_ids")])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--topics", type=int, default=100)
    parser.add_argument("--object-store-mib", type=int, default=80, help="The small arms' object store (>= 75).")
    parser.add_argument("--out-dir", help="Where the runs go (default: a temporary folder, removed at the end).")
    parser.add_argument("--json", dest="json_path", help="Write the result here.")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm in this process
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--keys", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:  # the child: one arm, its result on the last line of stdout
        result = run_arm(args.run_dir, json.loads(args.keys), args.rows, args.dim, args.topics)
        print("ARM " + json.dumps(result), flush=True)
        return

    before = machine()
    root = args.out_dir or tempfile.mkdtemp(prefix="bench-spill-")
    os.makedirs(root, exist_ok=True)
    keys = [f"cluster.k={args.k}", "embed.side=both", "data.rows_per_part=50000", *STAGE_KEYS]
    result = {"rows": args.rows, "dim": args.dim, "k": args.k, "object_store_mib": args.object_store_mib, "arms": {}}
    for arm, extra in ARMS.items():
        arm_keys = keys + [f"ray.object_store_mib={args.object_store_mib}" if x == "SMALL" else x for x in extra]
        run_dir = os.path.join(root, arm)
        print(f"[bench_spill] {arm}: {' '.join(arm_keys[len(keys):]) or 'the default object store'} ...", flush=True)
        started = time.time()
        with open(os.path.join(root, f"{arm}.log"), "w") as log:
            child = subprocess.run([sys.executable, os.path.abspath(__file__), "--arm", arm, "--run-dir", run_dir,
                                    "--keys", json.dumps(arm_keys), "--rows", str(args.rows), "--dim", str(args.dim),
                                    "--topics", str(args.topics)], stdout=subprocess.PIPE, stderr=log, text=True,
                                   cwd=REPO)
        lines = [line for line in child.stdout.splitlines() if line.startswith("ARM ")]
        stages = json.loads(lines[-1].removeprefix("ARM ")) if lines else {}
        log_tail = child.stdout[-2000:] if not lines else ""
        spilled = sum(s["spilled_mib"] for s in stages.values())
        completed = child.returncode == 0 and all(s["returncode"] == 0 for s in stages.values()) and \
            set(stages) == {"synth", *VERBS}
        entry = {"completed": completed, "seconds": round(time.time() - started, 1), "spilled_mib": spilled,
                 "spilled_mib_per_1m_pairs": round(spilled / args.rows * 1e6, 1), "stages": stages}
        if completed:
            entry["outputs"] = outputs(run_dir, args.k)
        elif log_tail:
            entry["stdout_tail"] = log_tail
        result["arms"][arm] = entry
        print(f"[bench_spill] {arm}: {'completed' if completed else 'FAILED'} in {entry['seconds']} s, spilled "
              f"{spilled:.0f} MiB ({entry['spilled_mib_per_1m_pairs']} MiB per 1M pairs)", flush=True)
    reference = result["arms"]["default"].get("outputs")
    result["outputs_equal_the_default"] = {arm: bool(reference) and e.get("outputs") == reference
                                           for arm, e in result["arms"].items() if arm != "default"}
    if not args.out_dir:
        shutil.rmtree(root, ignore_errors=True)
    write_result(result, before, root, args.json_path)


if __name__ == "__main__":
    main()

"""One big JSON lines file through ingest: read whole by one task (data.range_bytes=0, the only way before) against
byte ranges of data.range_bytes read by parallel tasks (as shipped), with the same output; and Ray Data's
read_json over the same file (one read task per file) for reference.

    python benchmarks/bench_ingest.py [--rows 1000000] [--range-bytes 134217728] [--limit N] [--out-dir DIR]
                                      [--json OUT]

One process, one local Ray (started by a warm-up ingest of 100 rows, so no arm pays Ray's start). The file: --rows
(query, passage) lines, passages of 20-80 words, ~270 bytes a line. Arms, each `clusterscale ingest` as the CLI runs
it (cli.main), timed by the command and by the stage's own wall_s (ingest's _DONE stats):

  whole    data.range_bytes=0: one task parses every line.
  ranges   data.range_bytes as given (default: as shipped): a counting pass, then one task per range.

--limit N adds data.limit=N to both arms (a trial run, or a sweep's smaller sizes, on a big file): the ranges arm
counts ranges in file order only until N rows are covered, and reads only those; `units_read` is how many units each
arm ran (their markers in pairs/_units).

`same_output` compares the pair_ids of pairs/, heldout/ and quarantine/ and the stats of both arms. `one_range`: the
largest range's count and ingest task timed alone in this process, the stage's critical path on a cluster with a CPU
per range. `ray_read_json` is `ray.data.read_json(file).count()`: pyarrow's C++ parser, one read task for the one
file, no validation.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import machine, write_result  # noqa: E402

WORDS = ("cluster shard query passage vector index memory object store node batch epoch token model encoder train "
         "negative positive sample metric recall ranking corpus document answer question file range byte").split()


def write_file(path: str, rows: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            query = f"what is {rng.choice(WORDS)} {rng.choice(WORDS)} number {i}"
            passage = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80)))
            f.write(json.dumps({"query": query, "passage": passage}) + "\n")
    return os.path.getsize(path)


def ingest(run_dir: str, path: str, keys: list[str]) -> dict:
    from clusterscale import cli
    from clusterscale.io.rundir import RunDir

    started = time.time()
    code = cli.main(["ingest", "--run-dir", run_dir, "--set", f"data.path={path}", *keys])
    seconds = time.time() - started
    stats = RunDir(run_dir).done_stats("pairs")
    return {"exit": code, "command_s": round(seconds, 2), "stage_wall_s": stats["wall_s"], "stats": stats}


def pair_ids(run_dir: str) -> dict:
    import pyarrow.dataset as pads

    from clusterscale.io.rundir import RunDir

    run = RunDir(run_dir)
    return {kind: sorted(pads.dataset(run.files(kind)).to_table(columns=["pair_id"]).column(0).to_pylist())
            for kind in ("pairs", "heldout", "quarantine") if run.files(kind)}


def one_range(root: str, path: str, range_bytes: int) -> dict:
    """The critical path with a CPU per range: one range's count and its ingest task, timed in this process."""
    from clusterscale import config
    from clusterscale.io.rundir import RunDir
    from clusterscale.io.text_ranges import count_rows
    from clusterscale.stages.ingest import file_units, ingest_unit, list_input_files

    cfg = config.load(None, [f"data.path={path}", f"data.range_bytes={range_bytes}"])
    fs, files = list_input_files(cfg.data)
    unit = max(file_units(fs, 0, files[0], cfg.data), key=lambda u: u.byte_range[1] - u.byte_range[0])
    started = time.time()
    rows = count_rows(fs, files[0], unit.byte_range, "jsonl", False)
    counted = time.time() - started
    scratch = os.path.join(root, "one_range")
    shutil.rmtree(scratch, ignore_errors=True)
    started = time.time()
    ingest_unit(RunDir(scratch).uri, fs, unit, cfg.data)
    return {"ranges": len(file_units(fs, 0, files[0], cfg.data)), "rows": rows, "count_s": round(counted, 3),
            "ingest_task_s": round(time.time() - started, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--range-bytes", type=int, default=None, help="data.range_bytes of the ranges arm "
                                                                      "(default: as shipped)")
    parser.add_argument("--limit", type=int, default=None, help="data.limit of both arms")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    before = machine()
    root = args.out_dir or tempfile.mkdtemp(prefix="bench_ingest_")
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "pairs.jsonl")
    started = time.time()
    size = write_file(path, args.rows)
    print(f"[bench] wrote {args.rows:,} rows, {size / 2**20:.0f} MiB in {time.time() - started:.0f}s", flush=True)
    warm = os.path.join(root, "warm.jsonl")
    write_file(warm, 100)
    shutil.rmtree(os.path.join(root, "warm"), ignore_errors=True)
    ingest(os.path.join(root, "warm"), warm, [])
    from clusterscale import config

    shipped = config.load(None, []).data.range_bytes
    range_bytes = shipped if args.range_bytes is None else args.range_bytes
    limit = [f"data.limit={args.limit}"] if args.limit else []
    arms = {"whole": ["data.range_bytes=0", *limit], "ranges": [f"data.range_bytes={range_bytes}", *limit]}
    result = {"rows": args.rows, "limit": args.limit, "file_mib": round(size / 2**20, 1), "range_bytes": range_bytes,
              "range_bytes_shipped": shipped, "cpus": os.cpu_count(), "arms": {}}
    ids = {}
    for name, keys in arms.items():
        run_dir = os.path.join(root, name)
        shutil.rmtree(run_dir, ignore_errors=True)
        result["arms"][name] = ingest(run_dir, path, keys)
        ids[name] = pair_ids(run_dir)
        result["arms"][name]["units_read"] = len(os.listdir(os.path.join(run_dir, "pairs", "_units")))
        print(f"[bench] {name}: {result['arms'][name]['command_s']}s", flush=True)
    counted = ("rows_in", "pairs", "heldout", "quarantine", "reasons")
    result["same_output"] = ids["whole"] == ids["ranges"] and all(
        result["arms"]["whole"]["stats"][k] == result["arms"]["ranges"]["stats"][k] for k in counted)
    for arm in result["arms"].values():
        arm["stats"] = {k: arm["stats"][k] for k in counted}
    result["ranges_over_whole"] = round(result["arms"]["ranges"]["stage_wall_s"]
                                        / result["arms"]["whole"]["stage_wall_s"], 3)
    result["one_range"] = one_range(root, path, range_bytes)
    import ray.data

    started = time.time()
    rows = ray.data.read_json(path).count()
    result["ray_read_json"] = {"rows": rows, "seconds": round(time.time() - started, 2)}
    write_result(result, before, root, args.json)


if __name__ == "__main__":
    main()

"""Peak memory per process of fit, assign, dedup, shard, mine and evaluate at N and 4N (the bounded-memory rule).

    python benchmarks/bench_scale.py [--rows 150000 --dim 384 --k 100 --topics 100 --rows-per-part 50000]
                                     [--out-dir DIR] [--keep] [--json OUT]
                                     [--train [--train-rows 40000 ...]]

For N and 4N it writes a synthetic run (`clusterscale synth --set embed.side=both`, so mine has query
vectors without an encoder), then runs each stage as its own CLI process (`python -m clusterscale.cli VERB
--run-dir R --set cluster.k=K ...`; each starts its own local Ray) and samples, every --interval seconds, the
memory of every process of that command's tree: the CLI process (the driver), the gcs_server and raylet it
starts, and the raylet's children (Ray workers: tasks and actors, Ray Data operators).

Memory figure: USS (unique set size, psutil memory_full_info().uss from /proc/PID/smaps_rollup, ~2 ms a
process). RSS counts the object-store pages a worker maps (zero-copy reads of shared Arrow/numpy objects) in
every process that touches them, so a worker reading a large shared object looks as big as the object, and
the sum over processes counts those pages many times; USS counts only the pages a process alone holds, which
is what the per-process rule bounds. The object store itself (shared memory) is in tree_peak_pss_mb: PSS
divides each shared page among its users, so the tree's PSS sum counts every page once. RSS peaks are kept
too (*_rss_mb), for reference.

`peak_rss_mb` (the key the goal names) is therefore the peak USS of the largest single process of the stage
(driver, gcs_server, raylet or one worker); `growth` = its value at 4N / at N (goal <= 1.25);
`max_memory_growth` = the largest growth over the stages. `bytes_moved_per_row` = the bytes read + written
by the stage's whole process tree (rchar + wchar: files, the disk shuffle's partitions, pipes and sockets; the
object store's shared-memory pages, mapped rather than read, are not counted) / N; `bytes_growth` = its
value at 4N / at N. --large-clusters (cluster.k = 4) adds `large_cluster_bytes_growth`: mine's bytes_growth
when every cluster is larger than the old 16,384-row search groups, and `dedup_block_memory_growth`: dedup's
growth with every cluster split into blocks of dedup.max_group_rows = 1,024 rows. --boilerplate (with
--large-clusters) makes 1/(2k) of the rows near-duplicates of one vector (synth --boilerplate: about a third of one
cluster, cosine ~0.99 to one another) and reruns dedup unsplit after the measured one: `dedup_kept_rows` (split,
unsplit) at N and 4N, and `dedup_kept_equal_unsplit`. rows_per_s = N / the stage's
own wall time from RUN/report/costs.json (without Ray's start-up, which the process time `seconds` includes).

Training (`train`, a 2-step tiny from-scratch model) runs before evaluate only because evaluate scores a
trained model; it is sampled and reported under "setup", not in max_memory_growth.

--train adds the training part (benchmarks/bench_scale_train.py, its own scales and options --train-*): per
sampler and with mined negatives, a training rank's peak at N and 4N and its read amplification, in the JSON's
"train" block and max_train_memory_growth.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

try:
    import psutil
except ImportError:  # Ray ships psutil in ray/thirdparty_files and puts that folder on sys.path at import
    import ray  # noqa: F401
    import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("fit", "assign", "dedup", "shard", "mine", "evaluate")
MB = 1024 * 1024
# Stage settings: IVF passage index in mine (a flat one costs 2 N^2 d flops: 2.8e14 at 600k, >12 min here);
# a tiny from-scratch student so the setup training takes seconds; a smaller evaluation set than the default
# (1,000 queries, 2,000 distractors), which only shortens the frozen encoder's pass: its size does not vary with N.
STAGE_KEYS = ["mine.index=ivf", "train.init=scratch", "train.scratch_hidden_size=32", "train.scratch_num_layers=1",
              "train.scratch_num_heads=2", "train.scratch_intermediate_size=64", "train.steps=2",
              "train.warmup_steps=1", "train.name=bench",
              "eval.max_queries=300", "eval.num_distractors=1000"]
# dedup's keys, given to the dedup command only: the shards keep being built from every assigned row.
DEDUP_KEYS = ["dedup.exact=true", "dedup.semantic_threshold=0.9"]
# In the large-cluster regime dedup splits every cluster into blocks of this many rows, as dedup.max_group_rows=auto
# splits a cluster of millions of rows at 100M pairs and k = 1,000: its growth is dedup_block_memory_growth.
LARGE_CLUSTER_DEDUP_KEYS = ["dedup.max_group_rows=1024"]


# --- the sampler --------------------------------------------------------------------------------------------
def process_kind(proc: psutil.Process, root_pid: int) -> tuple[str, str]:
    """(kind, title): driver, gcs_server, raylet, worker (a process titled `ray::<task or actor>`: Ray tasks,
    actors, Ray Data operators, and Ray's own agent actors) or ray_other (log monitor, dashboard, ...)."""
    if proc.pid == root_pid:
        return "driver", "driver"
    name = proc.name()
    cmdline = " ".join(proc.cmdline())
    title = (cmdline or name)[:80]
    if "gcs_server" in name or "gcs_server" in cmdline[:200]:
        return "gcs_server", "gcs_server"
    if name == "raylet" or cmdline.split(" ", 1)[0].endswith("/raylet"):
        return "raylet", "raylet"
    if cmdline.startswith("ray::") or "default_worker.py" in cmdline:
        return "worker", title.split("(")[0].strip()
    return "ray_other", title


def anon_and_shmem(pid: int) -> tuple[int, int]:
    """(RssAnon, RssShmem) in bytes from /proc/PID/status: the process's private heap, and the shared-memory
    pages it maps (Ray's object store lives in /dev/shm), which USS also counts when no other process maps them."""
    values = {"RssAnon:": 0, "RssShmem:": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(None, 1)[0]
                if key in values:
                    values[key] = int(line.split()[1]) * 1024
    except OSError:  # exited, or not Linux
        pass
    return values["RssAnon:"], values["RssShmem:"]


class TreeSampler:
    """Samples the memory of a process and all its descendants every `interval` seconds in a thread."""

    def __init__(self, root_pid: int, interval: float = 0.2):
        self.root_pid, self.interval = root_pid, interval
        self.peaks: dict[str, dict] = {}        # kind -> {"uss", "rss", "title"} of its largest single process
        self.titles: dict[str, float] = {}      # worker title -> peak USS of one process with that title
        self.work: dict[int, str] = {}          # worker pid -> its latest title other than ray::IDLE
        self.tree_uss = self.tree_pss = self.tree_rss = 0
        self.heap = {"anon": 0, "shmem": 0, "title": ""}
        self.title_anon: dict[str, float] = {}  # worker title -> peak RssAnon of one process with that title  # the largest single process by private heap (RssAnon)
        self.io: dict[tuple[int, float], tuple[int, int]] = {}  # (pid, start) -> latest (rchar + wchar, disk bytes)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        total_uss = total_pss = total_rss = 0
        for proc in procs:
            try:
                mem = proc.memory_full_info()
                kind, title = process_kind(proc, self.root_pid)
                if kind == "worker" and title != "ray::IDLE":
                    self.work[proc.pid] = title
                title = self.work.get(proc.pid, title)  # an idle worker keeps the memory of its last work
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue  # exited between the listing and the read
            total_uss, total_pss, total_rss = total_uss + mem.uss, total_pss + mem.pss, total_rss + mem.rss
            peak = self.peaks.setdefault(kind, {"uss": 0, "rss": 0, "title": title})
            if mem.uss > peak["uss"]:
                peak.update(uss=mem.uss, title=title)
            peak["rss"] = max(peak["rss"], mem.rss)
            if kind == "worker":
                self.titles[title] = max(self.titles.get(title, 0), mem.uss)
            self._count_io(proc)
            anon, shmem = anon_and_shmem(proc.pid)
            if kind == "worker":
                self.title_anon[title] = max(self.title_anon.get(title, 0), anon)
            if anon > self.heap["anon"]:
                self.heap = {"anon": anon, "shmem": shmem, "title": f"{kind}: {title}"}
        self.tree_uss, self.tree_pss = max(self.tree_uss, total_uss), max(self.tree_pss, total_pss)
        self.tree_rss = max(self.tree_rss, total_rss)
        self.samples += 1

    def _count_io(self, proc: psutil.Process) -> None:
        """The process's bytes read and written so far: rchar + wchar (every read/write call: files, pipes,
        sockets) and read_bytes + write_bytes (what reached the block layer). Counters only grow, so the latest
        sample of each process (pid and start time, as pids are reused) is its total up to then."""
        try:
            io = proc.io_counters()
            key = (proc.pid, proc.create_time())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, AttributeError):
            return
        chars = getattr(io, "read_chars", 0) + getattr(io, "write_chars", 0)
        self.io[key] = (chars, io.read_bytes + io.write_bytes)

    def summary(self) -> dict:
        """Peaks in MB: per kind (largest single process), the largest process overall, the tree's totals."""
        largest = max(self.peaks.items(), key=lambda kv: kv[1]["uss"], default=("none", {"uss": 0, "title": ""}))
        out = {"peak_uss_mb": round(largest[1]["uss"] / MB, 1),
               "largest_process": f"{largest[0]}: {largest[1]['title']}"}
        for kind, peak in sorted(self.peaks.items()):
            out[f"{kind}_peak_uss_mb"] = round(peak["uss"] / MB, 1)
            out[f"{kind}_peak_rss_mb"] = round(peak["rss"] / MB, 1)
        top = sorted(self.titles.items(), key=lambda kv: -kv[1])[:5]
        out["worker_peaks_by_title_mb"] = {t: round(v / MB, 1) for t, v in top}
        top = sorted(self.title_anon.items(), key=lambda kv: -kv[1])[:5]
        out["worker_anon_by_title_mb"] = {t: round(v / MB, 1) for t, v in top}
        out |= {"peak_anon_mb": round(self.heap["anon"] / MB, 1), "peak_anon_process": self.heap["title"],
                "peak_anon_process_shmem_mb": round(self.heap["shmem"] / MB, 1)}
        out |= {"tree_peak_uss_mb": round(self.tree_uss / MB, 1), "tree_peak_pss_mb": round(self.tree_pss / MB, 1),
                "tree_peak_rss_mb": round(self.tree_rss / MB, 1), "samples": self.samples}
        out |= {"tree_io_chars": sum(c for c, _ in self.io.values()),
                "tree_io_disk_bytes": sum(b for _, b in self.io.values())}
        return out


# --- one command ---------------------------------------------------------------------------------------------
def run_sampled(argv: list[str], log_path: str, interval: float) -> dict:
    """Run argv (cwd = the repo, this checkout first on PYTHONPATH), sampling its tree; summary + seconds + rc."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        with TreeSampler(proc.pid, interval) as sampler:
            rc = proc.wait()
    out = sampler.summary() | {"seconds": round(time.time() - started, 2), "returncode": rc}
    if rc != 0:
        with open(log_path) as f:
            out["error"] = "".join(f.readlines()[-15:]).strip()
    return out


def stage_wall_s(run_dir: str, stage: str) -> float | None:
    """The stage's own wall time from RUN/report/costs.json (None when it recorded none)."""
    path = os.path.join(run_dir, "report", "costs.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        entry = json.load(f).get("train:bench" if stage == "train" else stage)
    return entry.get("wall_s") if isinstance(entry, dict) else None


def dedup_kept_rows(run_dir: str) -> int | None:
    path = os.path.join(run_dir, "dedup", "_DONE.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["stats"]["rows"]


def cli(verb: str, run_dir: str, keys: list[str], extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "clusterscale.cli", verb, "--run-dir", run_dir, *extra, "--set", *keys]


def needed_stages(stages: list[str]) -> set[str]:
    """The stages to run for a --stages selection: the ones named and the ones they read from (fit before
    assign, assign before dedup and shard, shard before mine, train before evaluate); synth always."""
    needs = {"assign": {"fit"}, "dedup": {"fit", "assign"}, "shard": {"fit", "assign"},
             "mine": {"fit", "assign", "shard"}, "evaluate": {"fit", "assign", "shard", "train"}}
    return {"synth", *stages, *(d for s in stages for d in needs.get(s, ()))}


def measure_scale(rows: int, args, root: str) -> dict:
    """Synth, then every stage (and the setup training) at `rows`; {stage: measurement}."""
    run_dir = os.path.join(root, f"rows={rows}")
    logs = os.path.join(root, f"logs-{rows}")
    os.makedirs(logs, exist_ok=True)
    keys = [f"cluster.k={args.k}", "embed.side=both", f"data.rows_per_part={args.rows_per_part}", *STAGE_KEYS,
            *([f"data.heldout_fraction={args.heldout_fraction}"] if args.heldout_fraction is not None else [])]
    dedup_keys = DEDUP_KEYS + (LARGE_CLUSTER_DEDUP_KEYS if args.large_clusters else [])
    out = {}
    boilerplate = ["--boilerplate", str(1 / (2 * args.k))] if args.boilerplate else []
    order = [("synth", cli("synth", run_dir, keys, ["--rows", str(rows), "--dim", str(args.dim),
                                                    "--topics", str(args.topics), *boilerplate])),
             *[(s, cli(s, run_dir, keys + (dedup_keys if s == "dedup" else []))) for s in STAGES[:5]],
             ("train", cli("train", run_dir, keys)),
             ("evaluate", cli("evaluate", run_dir, keys))]
    order = [(stage, argv) for stage, argv in order if stage in needed_stages(args.stages)]
    for stage, argv in order:
        print(f"[bench_scale] rows={rows} {stage} ...", flush=True)
        result = run_sampled(argv, os.path.join(logs, f"{stage}.log"), args.interval)
        result["stage_wall_s"] = stage_wall_s(run_dir, stage)
        out[stage] = result
        with open(os.path.join(root, f"raw-{rows}.json"), "w") as f:  # kept if a later stage or scale fails
            json.dump(out, f, indent=2)
        print(f"[bench_scale] rows={rows} {stage}: {result['seconds']}s, largest process {result['peak_uss_mb']} MB "
              f"({result['largest_process']}){' ERROR' if result['returncode'] else ''}", flush=True)
        if stage == "dedup" and args.boilerplate:  # the same dedup unsplit (not measured): its kept rows
            split_rows = dedup_kept_rows(run_dir)
            unsplit = run_sampled(cli("dedup", run_dir, keys + DEDUP_KEYS + ["dedup.max_group_rows=100000000"],
                                      ["--replace"]), os.path.join(logs, "dedup-unsplit.log"), args.interval)
            result["kept_rows"] = [split_rows, dedup_kept_rows(run_dir) if not unsplit["returncode"] else None]
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


# --- the report ------------------------------------------------------------------------------------------------
DETAIL_KEYS = ("peak_anon_mb", "peak_anon_process", "peak_anon_process_shmem_mb", "worker_anon_by_title_mb", "driver_peak_uss_mb", "worker_peak_uss_mb", "raylet_peak_uss_mb", "gcs_server_peak_uss_mb",
               "tree_peak_uss_mb", "tree_peak_pss_mb", "driver_peak_rss_mb", "worker_peak_rss_mb", "tree_peak_rss_mb",
               "largest_process", "worker_peaks_by_title_mb", "seconds", "stage_wall_s", "samples")


def stage_entry(rows: list[int], runs: list[dict]) -> dict:
    """The per-stage JSON entry over the scales: the goal's keys, then the per-process detail."""
    peaks = [r["peak_uss_mb"] for r in runs]
    walls = [r["stage_wall_s"] or r["seconds"] for r in runs]
    entry = {"rows": rows, "peak_rss_mb": peaks, "growth": round(peaks[-1] / peaks[0], 3) if peaks[0] else None,
             "rows_per_s": [round(n / w, 1) if w else None for n, w in zip(rows, walls)]}
    for key in DETAIL_KEYS:
        entry[key] = [r.get(key) for r in runs]
    moved = [r.get("tree_io_chars") for r in runs]
    entry["bytes_moved_per_row"] = [round(b / n, 1) if b is not None else None for b, n in zip(moved, rows)]
    entry["disk_bytes_per_row"] = [round(r["tree_io_disk_bytes"] / n, 1) if r.get("tree_io_disk_bytes") is not None
                                   else None for r, n in zip(runs, rows)]
    per_row = entry["bytes_moved_per_row"]
    entry["bytes_growth"] = round(per_row[-1] / per_row[0], 3) if per_row[0] and per_row[-1] else None
    anon = entry["peak_anon_mb"]
    entry["anon_growth"] = round(anon[-1] / anon[0], 3) if anon[0] and anon[-1] else None
    for kind in ("driver", "worker"):  # which process grows
        first, last = entry[f"{kind}_peak_uss_mb"][0], entry[f"{kind}_peak_uss_mb"][-1]
        entry[f"{kind}_growth"] = round(last / first, 3) if first and last else None
    errors = [r.get("error") for r in runs]
    if any(errors):
        entry["error"] = errors
    return entry


def markdown_table(result: dict) -> str:
    """The RESULTS.md table: per stage the largest process's peak at N and 4N, growth, rows/s, which process."""
    lines = ["| stage | rows | peak MB (largest process) | growth | rows/s | largest process at 4N | driver MB | "
             "heap MB (largest RssAnon) | heap growth |",
             "|---|---|---|---|---|---|---|---|---|"]
    for stage in (*STAGES, "synth", "train"):
        e = result.get(stage) if stage in STAGES else result["setup"].get(stage)
        if e is None:  # not selected by --stages
            continue
        mark = " (error)" if "error" in e else ""
        lines.append(f"| {stage}{'' if stage in STAGES else ' (setup)'}{mark} | {e['rows'][0]:,} / {e['rows'][1]:,} | "
                     f"{e['peak_rss_mb'][0]:,.0f} / {e['peak_rss_mb'][1]:,.0f} | {e['growth']} | "
                     f"{e['rows_per_s'][0]:,.0f} / {e['rows_per_s'][1]:,.0f} | {e['largest_process'][1]} | "
                     f"{e['driver_peak_uss_mb'][0]:,.0f} / {e['driver_peak_uss_mb'][1]:,.0f} | "
                     f"{_mb(e['peak_anon_mb'][0])} / {_mb(e['peak_anon_mb'][1])} | {e.get('anon_growth')} |")
    return "\n".join(lines)


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def machine() -> dict:
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"cpu_count": os.cpu_count(), "ram_gb": round(psutil.virtual_memory().total / 1024 ** 3, 1),
            "uptime": uptime, "loadavg": [round(x, 2) for x in os.getloadavg()]}


def write_result(result: dict, before: dict, root: str, json_path: str | None) -> None:
    """Add the machine (load before and after), the command and the logs folder; print the JSON and write it."""
    result["machine"] = before | {"uptime_after": machine()["uptime"]}
    result["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])
    result["logs"] = root
    text = json.dumps(result, indent=2)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
    print(text)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_scale_train  # the training part (--train); here, as it imports this module's sampler

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=150_000, help="N; the second scale is 4N (default 150000).")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--topics", type=int, default=100)
    parser.add_argument("--rows-per-part", type=int, default=50_000,
                        help="data.rows_per_part of the synth runs: the files (work units) of both scales are the "
                             "same size, so a stage whose memory is O(a work unit) shows growth 1.0 (default 50000; "
                             "the config's 200,000 would make one 150k file at N and 200k files at 4N).")
    parser.add_argument("--stages", default=None,
                        help="Comma-separated stages to measure (with the stages they need); default all six "
                             "(with --large-clusters: mine and dedup).")
    parser.add_argument("--large-clusters", action="store_true",
                        help="The large-cluster regime: cluster.k = 4, so clusters (~N/4 rows) exceed the 16,384 "
                             "rows of the old fixed search groups as a 100M-pair run's clusters at k = 1,000 do, and "
                             "dedup splits them into blocks (dedup.max_group_rows=1024); the JSON gets "
                             "large_cluster_bytes_growth (mine's bytes_moved_per_row at 4N / at N) and "
                             "dedup_block_memory_growth (dedup's largest process at 4N / at N).")
    parser.add_argument("--boilerplate", action="store_true",
                        help="With --large-clusters: 1/(2k) of the rows are near-duplicates of one vector (about a "
                             "third of one cluster); dedup is rerun unsplit, and the JSON gets dedup_kept_rows and "
                             "dedup_kept_equal_unsplit.")
    parser.add_argument("--heldout-fraction", type=float, default=None,
                        help="data.heldout_fraction of the synth runs (default: the config's 0.05). A large one "
                             "(0.5) grows heldout/ with N, the regime of evaluate's driver at 100M pairs.")
    parser.add_argument("--interval", type=float, default=0.2, help="Seconds between memory samples.")
    parser.add_argument("--out-dir", help="Where the synthetic runs go (default: a temporary folder).")
    parser.add_argument("--keep", action="store_true", help="Keep the run directories.")
    parser.add_argument("--json", dest="json_path", help="Write the results here.")
    parser.add_argument("--train", action="store_true",
                        help="Also measure training (bench_scale_train.py) with the --train-* options.")
    bench_scale_train.add_arguments(parser, prefix="train-")
    args = parser.parse_args()
    train_options = bench_scale_train.train_args(args, prefix="train-") if args.train else None
    if args.boilerplate and not args.large_clusters:
        parser.error("--boilerplate goes with --large-clusters (it measures dedup's split clusters)")
    if args.large_clusters:
        args.k = 4
    args.stages = [s for s in (args.stages or ("mine,dedup" if args.large_clusters else ",".join(STAGES))).split(",")
                   if s]
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        parser.error(f"--stages: unknown {unknown}; choose from {', '.join(STAGES)}")
    root = os.path.abspath(args.out_dir) if args.out_dir else tempfile.mkdtemp(prefix="bench_scale-")
    os.makedirs(root, exist_ok=True)
    scales = [args.rows, 4 * args.rows]
    before = machine()
    runs = [measure_scale(n, args, root) for n in scales]
    result = {stage: stage_entry(scales, [r[stage] for r in runs]) for stage in STAGES if stage in runs[0]}
    growths = [e["growth"] for e in result.values() if e["growth"] is not None and "error" not in e]
    result["max_memory_growth"] = max(growths) if growths else None
    if args.heldout_fraction is not None:
        result["heldout_fraction"] = args.heldout_fraction
    if args.large_clusters:
        result["regime"] = "large_clusters (cluster.k = 4)"
        result["large_cluster_bytes_growth"] = result.get("mine", {}).get("bytes_growth")
        result["dedup_block_memory_growth"] = result.get("dedup", {}).get("growth")
    if args.boilerplate:
        result["dedup_kept_rows"] = [r.get("dedup", {}).get("kept_rows") for r in runs]  # (split, unsplit) per scale
        result["dedup_kept_equal_unsplit"] = all(k and k[0] is not None and k[0] == k[1]
                                                 for k in result["dedup_kept_rows"])
    result["setup"] = {s: stage_entry(scales, [r[s] for r in runs]) for s in ("synth", "train") if s in runs[0]}
    if train_options is not None:
        result |= bench_scale_train.run(train_options, root)
    result["memory_measure"] = "USS (private pages) of one process; tree_peak_pss_mb counts shared pages once"
    write_result(result, before, root, args.json_path)
    print(markdown_table(result))
    if train_options is not None:
        print(bench_scale_train.markdown_table(result))


if __name__ == "__main__":
    main()

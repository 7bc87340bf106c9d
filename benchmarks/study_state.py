"""Carry a compare study's finished arms from one machine to the next (issue 30's MiniLM study is ~4-8 h of CPU
training on a 2-core box, and a session's machine is gone with it): the arms' results, not their weights, and the
preprocessing the next arms train on.

    python benchmarks/study_state.py evaluate RUN_DIR -- COMPARE_ARGS  # the finished arms of a study stopped midway
    python benchmarks/study_state.py save RUN_DIR STATE.tar.gz     # finished arms, their costs and digests
    python benchmarks/study_state.py save-preprocessing RUN_DIR PRE.tar.gz   # once: what training and eval read
    python benchmarks/study_state.py restore STATE.tar.gz RUN_DIR [--preprocessing PRE.tar.gz]  # before the study
    python benchmarks/study_state.py verify STATE.tar.gz RUN_DIR [-- COMPARE_ARGS]  # once its preprocessing is done

`evaluate` takes the study's own compare arguments (--arms, --arm, --seeds, --set ...; see run_study.sh) and
evaluates, with compare's own arm configs, every arm that has finished training, so that the results carry the
fingerprints the final compare looks for. `save` keeps, per finished arm (train/<name>/ with a done marker): its
done marker, metrics, config and cost records, and its held-out result eval/<name>.json, so that `clusterscale
compare` skips its training (done marker) and its evaluation (the result's fingerprint) on the new machine; the
frozen encoder's result; report/costs.json. It leaves out the weights, checkpoints and the batches logs: the compare
summary needs none of them. An arm stopped midway is left out (its checkpoints are what resume needs): it trains again.

The preprocessing is the same row for row only on the same kind of CPU: the encoder and k-means run on the CPU's
own vector kernels, whose rounding differs from one CPU to another, so rows near a cluster boundary can change
cluster (seen in session 28: the shards and mined candidates of an AMD EPYC box with AVX-512 differ from those of
the box that trained seed 0, same harvest and packages, same config; the pairs and held-out set are the same). So `save-preprocessing` keeps,
once, what the next arms read: the pairs, the held-out set, the clusters' shards and manifest, the mined candidates
and padding pool, the centroids, and every stage's done marker (not the embeddings, the assignments, the random shard
set or the negatives' per-row sidecars: training rebuilds the last two from the shards and candidates, with no
arithmetic on floats). `restore --preprocessing` puts it in the new run dir, so the study reuses every stage and the
next arms train on it. Each arm's record says which preprocessing it trained on (a digest of the rows of every
Parquet file of pairs, held-out set, shards and mined candidates); `verify` recomputes the run dir's and fails,
naming the folder, when an arm restored from another preprocessing shares its seed with an arm that is to train here
(with the study's compare arguments; without them, when any restored arm's preprocessing differs). The seeds of a
compare are paired within a seed: one seed's arms on one preprocessing and another seed's on another is a
difference between seeds, like the seed itself. Run it as soon as the study's log shows its first `== compare:` line.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import sys
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DIGESTS = "study_state.json"  # in a state file, and in a run dir after a restore (the restored arms' digests)
# Preprocessing outputs the arms were trained and evaluated on (the random shard set and the negatives' sidecars are
# made by training from the shards and candidates, and are covered by them). States saved before session 28 digest
# the sidecars ("negatives": "negatives/rows/shards/k=*/cluster=*") instead of the candidates; folders are compared
# where both records have them.
DIGESTED = {"pairs": "pairs", "heldout": "heldout", "shards": "shards/k=*/cluster=*",
            "candidates": "negatives/part-*.parquet"}
# What save-preprocessing keeps (globs under the run dir), besides every stage's done marker outside train/ and eval/.
PREPROCESSING = ("config.yaml", "pairs/**/*", "heldout/**/*", "kmeans/**/*", "shards/*/manifest.json",
                 "shards/*/cluster=*/**/*", "negatives/_plan.json", "negatives/part-*.parquet",
                 "negatives/padding.parquet", "embeddings/_units.json")
# Under a finished arm's folder: what training writes that the compare summary does not read, and is large.
LEFT_OUT = ("model", "ray", "batches", "checkpoints")


def digest(run_dir: Path, pattern: str) -> tuple[str, int]:
    """sha256 over the rows of every Parquet file under the folders matching `pattern` (sorted relative paths,
    columns in name order, Arrow IPC of each column) and the number of files."""
    h = hashlib.sha256()
    files = sorted(f for d in sorted(run_dir.glob(pattern))
                   for f in (d.rglob("*.parquet") if d.is_dir() else [d]))
    for f in files:
        h.update(str(f.relative_to(run_dir)).encode())
        table = pq.read_table(f)
        table = table.select(sorted(table.column_names)).replace_schema_metadata(None)
        sink = io.BytesIO()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        h.update(sink.getvalue())
    return h.hexdigest(), len(files)


def finished_arms(run_dir: Path) -> list[str]:
    return sorted(d.name for d in (run_dir / "train").glob("*") if (d / "_DONE.json").exists())


def save(run_dir: Path, out: Path) -> None:
    arms = finished_arms(run_dir)
    if not arms:
        sys.exit(f"{run_dir}/train holds no finished arm (train/<name>/_DONE.json): nothing to save.")
    members = [run_dir / "report" / "costs.json", run_dir / "eval" / "frozen.json"]
    for name in arms:
        members += [f for f in (run_dir / "train" / name).rglob("*")
                    if f.is_file() and f.relative_to(run_dir / "train" / name).parts[0] not in LEFT_OUT]
        members.append(run_dir / "eval" / f"{name}.json")
    missing = [str(m.relative_to(run_dir)) for m in members if not m.exists()]
    if missing:
        sys.exit(f"Not evaluated yet: {', '.join(missing)}. Evaluate the finished arms first (compare evaluates "
                 f"every arm once all have trained), then save.")
    now = digests_of(run_dir)
    restored = _restored(run_dir)
    state = {"arms": arms, "digests": now, "arm_digests": {a: restored.get(a, now) for a in arms}}
    with tarfile.open(out, "w:gz") as tar:
        for m in members:
            tar.add(m, arcname=str(m.relative_to(run_dir)))
        data = json.dumps(state, indent=1).encode()
        info = tarfile.TarInfo(DIGESTS)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    print(f"saved {len(arms)} finished arm(s) to {out} ({out.stat().st_size / 1e3:.0f} kB): {', '.join(arms)}")


def digests_of(run_dir: Path) -> dict:
    return {name: list(digest(run_dir, pattern)) for name, pattern in DIGESTED.items()}


def _restored(run_dir: Path) -> dict:
    """{arm: digests} of the arms restored into run_dir (their preprocessing, which may not be this run dir's)."""
    path = run_dir / DIGESTS
    return json.loads(path.read_text())["arm_digests"] if path.exists() else {}


def _arm_digests(state: dict) -> dict:
    return state.get("arm_digests") or {a: state["digests"] for a in state["arms"]}


def save_preprocessing(run_dir: Path, out: Path) -> None:
    markers = [m for m in run_dir.rglob("_DONE.json") if m.relative_to(run_dir).parts[0] not in ("train", "eval")
               and "random" not in m.relative_to(run_dir).parts and "rows" not in m.relative_to(run_dir).parts]
    members = sorted({f for pattern in PREPROCESSING for f in run_dir.glob(pattern) if f.is_file()} | set(markers))
    if not any(m.relative_to(run_dir).parts[0] == "negatives" for m in markers):
        sys.exit(f"{run_dir} has no finished mine stage (negatives/_DONE.json): run the study's preprocessing first.")
    with tarfile.open(out, "w:gz") as tar:
        for m in members:
            tar.add(m, arcname=str(m.relative_to(run_dir)))
    print(f"saved the preprocessing of {run_dir} ({len(members)} files) to {out} ({out.stat().st_size / 1e6:.1f} MB)")


def _compare_arms(run_dir: Path, compare_argv: list[str]):
    """(the compare's arm configs, flat, and the run) for the study's own compare arguments."""
    from clusterscale import cli, experiments, pipeline

    args = cli.build_parser().parse_args(["compare", "--run-dir", str(run_dir), *compare_argv])
    cfg, run = pipeline.open_run(args.run_dir, args.config, args.overrides)
    custom = dict(experiments.parse_arm(text) for text in args.custom_arms)
    arms = experiments.compare_arms(cfg, experiments.parse_list(args.samplers, "--arms"), args.seeds, custom)
    return [a for arm_cfgs in arms.values() for a in arm_cfgs], run


def evaluate(run_dir: Path, compare_argv: list[str]) -> None:
    from clusterscale import experiments
    from clusterscale.io.layout import train_dir
    from clusterscale.io.rundir import DONE
    from clusterscale.stages.evaluate import evaluate_together

    arms, run = _compare_arms(run_dir, compare_argv)
    finished = [a for a in arms if run.exists(train_dir(a.train_name()), DONE)]
    if not finished:
        sys.exit(f"No arm of this compare has finished training in {run_dir}.")
    with evaluate_together():
        for arm_cfg in finished:
            metrics = experiments._evaluate(arm_cfg, run, {})[arm_cfg.train_name()]["metrics"]
            print(f"{arm_cfg.train_name()}: NDCG@10 {metrics['ndcg_at_10']:.4f}  MRR@10 {metrics['mrr_at_10']:.4f}",
                  flush=True)


def _state(tar_path: Path) -> dict:
    with tarfile.open(tar_path) as tar:
        return json.load(tar.extractfile(DIGESTS))


def restore(tar_path: Path, run_dir: Path) -> None:
    state = _state(tar_path)
    clash = [a for a in state["arms"] if (run_dir / "train" / a).exists()]
    if clash:
        sys.exit(f"{run_dir}/train already holds {', '.join(clash)}: restore into a run dir without those arms.")
    run_dir.mkdir(parents=True, exist_ok=True)
    _extract(tar_path, run_dir)
    (run_dir / DIGESTS).write_text(json.dumps({"arm_digests": {**_restored(run_dir), **_arm_digests(state)}}, indent=1))
    print(f"restored {len(state['arms'])} arm(s) into {run_dir}: {', '.join(state['arms'])}. After the study's "
          f"preprocessing, run: python {sys.argv[0]} verify {tar_path} {run_dir}")


def restore_preprocessing(tar_path: Path, run_dir: Path) -> None:
    if (run_dir / "pairs" / "_DONE.json").exists():
        sys.exit(f"{run_dir} already holds a preprocessing (pairs/_DONE.json): restore it into a new run dir.")
    run_dir.mkdir(parents=True, exist_ok=True)
    files = _extract(tar_path, run_dir)
    print(f"restored the preprocessing of {tar_path} ({files} files) into {run_dir}: the study reuses it")


def _extract(tar_path: Path, run_dir: Path) -> int:
    """Extract a state or preprocessing file (its plain files, inside run_dir; not the state's digests); how many."""
    with tarfile.open(tar_path) as tar:
        members = [m for m in tar.getmembers() if m.name != DIGESTS]
        bad = [m.name for m in members if not m.isfile() or m.name.startswith("/") or ".." in Path(m.name).parts]
        if bad:
            sys.exit(f"{tar_path} holds entries that are not plain files inside the run dir: {bad}")
        tar.extractall(run_dir, members=members, filter="data")
    return len(members)


def _seed(arm: str) -> str:
    match = re.search(r"-seed(\d+)$", arm)
    return match.group(1) if match else arm


def _differences(saved: dict, now: dict) -> list[str]:
    patterns = {**DIGESTED, "negatives": "negatives/rows/shards/k=*/cluster=*"}
    return [f"{name} ({patterns[name]}): saved {list(saved[name])}, now {now[name]}"
            for name in saved if name in now and list(saved[name]) != now[name]]


def verify(tar_path: Path, run_dir: Path, compare_argv: list[str] | None = None) -> None:
    state = _state(tar_path)
    now = digests_of(run_dir)
    recorded = _arm_digests(state)
    other = {arm: diff for arm, saved in recorded.items() if (diff := _differences(saved, now))}
    if compare_argv:  # the seeds that have arms to train here
        arms, _ = _compare_arms(run_dir, compare_argv)
        training = {_seed(a.train_name()) for a in arms if a.train_name() not in state["arms"]}
    else:  # any arm of the study may still train here
        training = {_seed(arm) for arm in other}
    # Per seed, the preprocessings its arms trained (or will train) on: "here", or another one (its rows' digests).
    kinds: dict[str, set] = {seed: {"here"} for seed in training}
    for arm, saved in recorded.items():
        kind = json.dumps({k: list(saved[k]) for k in ("pairs", "heldout", "shards")}) if arm in other else "here"
        kinds.setdefault(_seed(arm), set()).add(kind)
    mixed = {arm: diff for arm, diff in other.items() if len(kinds[_seed(arm)]) > 1}
    if mixed:
        lines = [f"{arm}: {d}" for arm, diff in mixed.items() for d in diff]
        sys.exit("The preprocessing differs from the one these restored arms trained on, and other arms of their seed "
                 "trained or are to train on another, so the seed would mix two preprocessings: stop the study, "
                 "restore the preprocessing they trained on (restore --preprocessing) into a new run dir, or remove "
                 "their train/<name>/ and eval/<name>.json and run them again:\n  " + "\n  ".join(lines))
    same = len(state["arms"]) - len(other)
    print((f"preprocessing identical to the one {same} restored arm(s) trained on ({', '.join(now)})" if same else
           f"no restored arm trained on this preprocessing ({', '.join(now)})")
          + (f"; seed(s) {', '.join(sorted({_seed(a) for a in other}))} trained wholly on another preprocessing "
             f"({len(other)} arm(s)): paired within their seed, they stand" if other else "")
          + ": the restored arms stand")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("evaluate")
    p.add_argument("run_dir", type=Path)
    p.add_argument("compare_argv", nargs=argparse.REMAINDER, help="compare's arguments, after --")
    for verb in ("save", "save-preprocessing"):
        p = sub.add_parser(verb)
        p.add_argument("run_dir", type=Path)
        p.add_argument("state", type=Path)
    p = sub.add_parser("restore")
    p.add_argument("state", type=Path)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--preprocessing", type=Path, help="a save-preprocessing file to restore first")
    p = sub.add_parser("verify")
    p.add_argument("state", type=Path)
    p.add_argument("run_dir", type=Path)
    p.add_argument("compare_argv", nargs=argparse.REMAINDER, help="the study's compare arguments, after --")
    args = parser.parse_args()
    argv = getattr(args, "compare_argv", None)
    argv = argv[1:] if argv and argv[0] == "--" else argv
    if args.verb == "evaluate":
        evaluate(args.run_dir, argv)
    elif args.verb == "save":
        save(args.run_dir, args.state)
    elif args.verb == "save-preprocessing":
        save_preprocessing(args.run_dir, args.state)
    elif args.verb == "restore":
        if args.preprocessing:
            restore_preprocessing(args.preprocessing, args.run_dir)
        restore(args.state, args.run_dir)
    else:
        verify(args.state, args.run_dir, argv)


if __name__ == "__main__":
    main()

"""Carry a compare study's finished arms from one machine to the next (issue 30's MiniLM study is ~4-8 h of CPU
training on a 2-core box, and a session's machine is gone with it): the arms' results, not their weights.

    python benchmarks/study_state.py evaluate RUN_DIR -- COMPARE_ARGS  # the finished arms of a study stopped midway
    python benchmarks/study_state.py save RUN_DIR STATE.tar.gz     # finished arms, their costs and digests
    python benchmarks/study_state.py restore STATE.tar.gz RUN_DIR  # into a new run dir, before the study runs
    python benchmarks/study_state.py verify STATE.tar.gz RUN_DIR   # once the study's preprocessing is done

`evaluate` takes the study's own compare arguments (--arms, --arm, --seeds, --set ...; see run_study.sh) and
evaluates, with compare's own arm configs, every arm that has finished training, so that the results carry the
fingerprints the final compare looks for. `save` keeps, per finished arm (train/<name>/ with a done marker): its
done marker, metrics, config and cost records, and its held-out result eval/<name>.json, so that `clusterscale
compare` skips its training (done marker) and its evaluation (the result's fingerprint) on the new machine; the
frozen encoder's result; report/costs.json. It leaves out the weights, checkpoints and the batches logs: the compare
summary needs none of them. An arm stopped midway is left out (its checkpoints are what resume needs): it trains again.

Preprocessing is not carried: the study recomputes it (a few minutes) from the same config. The restored arms are
valid only if that gives the same pairs, held-out set, clusters, shards and mined negatives; `save` records a digest
of each (the rows of every Parquet file, not its bytes), and `verify` recomputes them on the new run dir and fails
on any difference, naming the folder. Run it as soon as the study's log shows its first `== compare:` line.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DIGESTS = "study_state.json"
# Preprocessing outputs the restored arms were trained and evaluated on (the random shard set and the random
# sidecars are made by training and are covered by the shards they are drawn from).
DIGESTED = {"pairs": "pairs", "heldout": "heldout", "shards": "shards/k=*/cluster=*",
            "negatives": "negatives/rows/shards/k=*/cluster=*"}
# Under a finished arm's folder: what training writes that the compare summary does not read, and is large.
LEFT_OUT = ("model", "ray", "batches", "checkpoints")


def digest(run_dir: Path, pattern: str) -> tuple[str, int]:
    """sha256 over the rows of every Parquet file under the folders matching `pattern` (sorted relative paths,
    columns in name order, Arrow IPC of each column) and the number of files."""
    h = hashlib.sha256()
    files = sorted(f for d in sorted(run_dir.glob(pattern)) for f in d.rglob("*.parquet"))
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
    state = {"arms": arms, "digests": {name: digest(run_dir, pattern) for name, pattern in DIGESTED.items()}}
    with tarfile.open(out, "w:gz") as tar:
        for m in members:
            tar.add(m, arcname=str(m.relative_to(run_dir)))
        data = json.dumps(state, indent=1).encode()
        info = tarfile.TarInfo(DIGESTS)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    print(f"saved {len(arms)} finished arm(s) to {out} ({out.stat().st_size / 1e3:.0f} kB): {', '.join(arms)}")


def evaluate(run_dir: Path, compare_argv: list[str]) -> None:
    from clusterscale import cli, experiments, pipeline
    from clusterscale.io.layout import train_dir
    from clusterscale.io.rundir import DONE
    from clusterscale.stages.evaluate import evaluate_together

    args = cli.build_parser().parse_args(["compare", "--run-dir", str(run_dir), *compare_argv])
    cfg, run = pipeline.open_run(args.run_dir, args.config, args.overrides)
    custom = dict(experiments.parse_arm(text) for text in args.custom_arms)
    arms = experiments.compare_arms(cfg, experiments.parse_list(args.samplers, "--arms"), args.seeds, custom)
    finished = [a for arm_cfgs in arms.values() for a in arm_cfgs if run.exists(train_dir(a.train_name()), DONE)]
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
    with tarfile.open(tar_path) as tar:
        members = [m for m in tar.getmembers() if m.name != DIGESTS]
        bad = [m.name for m in members if not m.isfile() or m.name.startswith("/") or ".." in Path(m.name).parts]
        if bad:
            sys.exit(f"{tar_path} holds entries that are not plain files inside the run dir: {bad}")
        tar.extractall(run_dir, members=members, filter="data")
    print(f"restored {len(state['arms'])} arm(s) into {run_dir}: {', '.join(state['arms'])}. After the study's "
          f"preprocessing, run: python {sys.argv[0]} verify {tar_path} {run_dir}")


def verify(tar_path: Path, run_dir: Path) -> None:
    state = _state(tar_path)
    bad = []
    for name, pattern in DIGESTED.items():
        now = list(digest(run_dir, pattern))
        if now != list(state["digests"][name]):
            bad.append(f"{name} ({pattern}): saved {state['digests'][name]}, now {now}")
    if bad:
        sys.exit("The preprocessing differs from the one the restored arms trained on, so they are not comparable "
                 "with arms trained here; stop the study, remove their train/<name>/ and eval/<name>.json, and "
                 "run them again:\n  " + "\n  ".join(bad))
    print(f"preprocessing identical to the saved state's ({', '.join(DIGESTED)}): the {len(state['arms'])} restored "
          f"arm(s) stand")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("evaluate")
    p.add_argument("run_dir", type=Path)
    p.add_argument("compare_argv", nargs=argparse.REMAINDER, help="compare's arguments, after --")
    p = sub.add_parser("save")
    p.add_argument("run_dir", type=Path)
    p.add_argument("state", type=Path)
    for verb in ("restore", "verify"):
        p = sub.add_parser(verb)
        p.add_argument("state", type=Path)
        p.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    if args.verb == "evaluate":
        argv = args.compare_argv[1:] if args.compare_argv[:1] == ["--"] else args.compare_argv
        evaluate(args.run_dir, argv)
    elif args.verb == "save":
        save(args.run_dir, args.state)
    else:
        {"restore": restore, "verify": verify}[args.verb](args.state, args.run_dir)


if __name__ == "__main__":
    main()

"""The `clusterscale` command: `clusterscale VERB [CONFIG.yaml] --run-dir DIR [--set section.key=value ...]`."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from clusterscale import __version__
from clusterscale import config as config_mod
from clusterscale import experiments, pipeline
from clusterscale.errors import bounded_repr, user_message
from clusterscale.io.layout import load_manifest, shards_dir
from clusterscale.redact import redact_uri, redacted_command
from clusterscale.io.rundir import RunDir, StageMissingError
from clusterscale.knobs import check_text
from clusterscale.pipeline import STAGE_VERBS, STAGES, execute, open_run
from clusterscale.runtime import interrupt
from clusterscale.runtime.session import check_run_dir_shared, init_ray
from clusterscale.stages.mteb_eval import LOCAL_PREFIX, run_mteb
from clusterscale.stages.shards import cluster_table, format_cluster_table
from clusterscale.stages.synthetic import SynthSpec

VERBS = {
    "run": f"Run every stage in order: {', '.join(STAGE_VERBS)} (mine only with train.negatives_per_query).",
    "synth": "Write a synthetic run (topical pairs, held-out split, clustered unit vectors) in place of ingest + embed.",
    **{name: STAGES[name].help for name in STAGE_VERBS},
    "compare": "Train and evaluate every sampler x seed arm on the same shards; mean and spread per arm.",
    "sweep": "Cluster at several k (and data sizes) from one embedding pass each; optionally train and evaluate.",
    "inspect": "Print the cluster table (rows, intra-cluster cosine, sample queries) of a run.",
    "plan": "Predict per-stage time, GPU/CPU-hours, cost, memory, disk and files of N pairs at k clusters on a "
            "cluster, from measured rates (a run's costs, `plan --calibrate`, a GPU calibration).",
    "config": "Print every config key with its default and documentation.",
}


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("clusterscale")
    except PackageNotFoundError:  # run from a source tree that was never pip-installed
        return f"{__version__} (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clusterscale", description=(
        "Embed, cluster and shard (query, passage) pairs, then train an embedding model with every global "
        "batch drawn from one cluster. Stages read and write one run directory."))
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, text in VERBS.items():
        p = sub.add_parser(verb, help=text, description=text,
                           epilog="Config keys: `clusterscale config`." if verb != "config" else None)
        if verb == "config":
            p.add_argument("--markdown", action="store_true",
                           help="Print the reference as Markdown tables (docs/configuration.md).")
            continue
        if verb == "plan":
            add_plan_arguments(p)
            continue
        if verb == "inspect":
            p.add_argument("run", nargs="?", help="The run directory (or use --run-dir).")
            p.add_argument("--run-dir", dest="run_dir_opt", help="The run directory.")
            p.add_argument("--k", type=int, help="Which clustering to show (default: cluster.k of the run's config).")
            p.add_argument("--json", dest="json_path", help="Also write the table as JSON to this path.")
            continue
        p.add_argument("config", nargs="?", help="Pipeline config YAML; omitted = the embedded default.")
        p.add_argument("--run-dir", required=True, help="Run directory: a local folder or a URI (s3://...).")
        p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                       help="Override config keys, e.g. --set cluster.k=16 train.steps=100.")
        if verb == "train":
            p.add_argument("--resume", action="store_true",
                           help="Continue train/<name>/ from its latest checkpoint (same config).")
        if verb in REPLACEABLE:
            add_replace_argument(p)
        if verb == "synth":
            add_synth_arguments(p)
        add_experiment_arguments(verb, p)
    return parser


REPLACEABLE = ("run", *(name for name in STAGE_VERBS if STAGES[name].marks_done), "compare", "sweep")


def add_replace_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replace", action="store_true",
                   help="Remove this stage's output (for run, compare and sweep: every output made with a different "
                        "config) and every output made from it, then rerun. Without it such a rerun is refused.")


def add_synth_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=row_count, required=True, help="Pairs to generate (held-out ones included).")
    p.add_argument("--dim", type=int, default=384, help="Embedding dimension (default 384).")
    p.add_argument("--topics", type=int, default=100, help="Topics: vocabularies and vector directions (default 100).")
    p.add_argument("--heldout-fraction", type=float,
                   help="data.heldout_fraction of the run (default: the config's, 0.05).")
    p.add_argument("--seed", type=int, default=0, help="Generator seed (default 0).")
    p.add_argument("--boilerplate", type=float, default=0.0,
                   help="Fraction of rows that are boilerplate: near-duplicates of one vector (cosine ~0.99 to one "
                        "another), so one cluster holds them all (default 0).")


def row_count(text: str) -> int:
    """--rows: an integer, also as 1e9 or 100_000_000."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of rows (e.g. 100000000 or 1e8)")
    return int(value)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="Pipeline config YAML; omitted = the run's, or the embedded default.")
    p.add_argument("--run-dir", help="A finished run: its report/costs.json calibrates the rates, its clusters the "
                                     "sizes, its folders the bytes per row.")
    p.add_argument("--rows", type=row_count, help="Pairs to plan for, e.g. 100000000 or 1e8 (default: counted in "
                                                  "data.path).")
    p.add_argument("--k", dest="k_values", help="Comma-separated cluster counts (default: cluster.k).")
    p.add_argument("--cluster", help="A Ray launcher YAML or KubeRay manifest (cluster_configs/).")
    p.add_argument("--gpus", type=int, help="GPUs in all (instead of --cluster).")
    p.add_argument("--gpu-type", help="H100, H200, A100, L40S, L4, ...")
    p.add_argument("--nodes", type=int, help="Nodes (instead of, or overriding, --cluster).")
    p.add_argument("--price-per-gpu-hour", type=float, help="Price of one GPU-hour; cost = cluster GPUs x hours.")
    p.add_argument("--imbalance", type=float,
                   help="k-means imbalance factor k*sum(n^2)/N^2 when no run measured one (default 1.5).")
    p.add_argument("--calibration", help="The calibration file (default ~/.clusterscale/plan_calibration.json).")
    p.add_argument("--gpu-calibration", help="JSON written by benchmarks/gpu_check.sh on a GPU node.")
    p.add_argument("--calibrate", action="store_true",
                   help="Time ingest, fit, assign and shard on small synth runs on this machine and write the "
                        "calibration file.")
    p.add_argument("--calibrate-rows", default="25000,100000,200000",
                   help="Synth sizes of --calibrate (default 25000,100000,200000): a least-squares line per "
                        "stage over them.")
    p.add_argument("--json", dest="json_path", help="Also write the plan as JSON to this path.")
    p.add_argument("--save-in", help="Write the plan into RUN/report/plan_prediction.json (a run about to be made "
                                     "at these rows and k), so that `clusterscale report` shows predicted vs measured.")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="Override config keys, e.g. --set train.global_batch_size=4096.")


def run_plan_verb(args) -> None:
    from clusterscale.plan import calibrate, render
    from clusterscale.io.layout import PREDICTION_PATH
    from clusterscale.plan.build import PlanRequest, make_plan

    if args.calibrate:
        rows = experiments.parse_list(args.calibrate_rows, "--calibrate-rows", int)
        path = calibrate.calibrate(rows, args.calibration, args.overrides)
        print(f"calibration written to {path}")
        if args.rows is None:
            return
    k_values = experiments.parse_list(args.k_values, "--k", int) if args.k_values else None
    request = PlanRequest(args.config, args.overrides, args.run_dir, args.rows, k_values, args.cluster, args.gpus,
                          args.gpu_type, args.nodes, args.price_per_gpu_hour, args.calibration, args.gpu_calibration,
                          args.imbalance)
    plan = make_plan(request)
    print(render.plan_text(plan))
    document = render.plan_json(plan)
    if args.json_path:
        json_path = os.path.abspath(os.path.expanduser(args.json_path))
        if not os.path.isdir(os.path.dirname(json_path)):
            raise config_mod.ConfigError(f"--json {args.json_path}: the folder {os.path.dirname(json_path)} does not "
                                         f"exist; create it or pass a path in an existing folder.")
        with open(json_path, "w") as f:
            json.dump(document, f, indent=2)
        print(f"plan written to {json_path}")
    if args.save_in:
        RunDir(args.save_in).write_json(PREDICTION_PATH, document)
        print(f"prediction written to {RunDir(args.save_in).path(PREDICTION_PATH)}")


def run_synth_verb(args) -> None:
    spec = SynthSpec(rows=args.rows, dim=args.dim, topics=args.topics, seed=args.seed, boilerplate=args.boilerplate)
    spec.check()
    extra = [f"data.path={spec.data_path()}"]
    if args.heldout_fraction is not None:
        extra.append(f"data.heldout_fraction={args.heldout_fraction}")
    cfg, run = open_run(args.run_dir, args.config, args.overrides + extra)
    init_ray(cfg.ray)
    check_run_dir_shared(run, cfg.ray.shared_run_dir)
    if run.config_in_force() is None:
        run.write_config(cfg)
    execute(STAGES["synth"], cfg, run)


def add_experiment_arguments(verb: str, p: argparse.ArgumentParser) -> None:
    """Options of the evaluate, compare and sweep verbs."""
    if verb == "evaluate":
        p.add_argument("--mteb", metavar="TASK[,TASK...]",
                       help="Also run MTEB tasks: retrieval or STS task names (data from the HF hub) or local:FOLDER "
                            "(BEIR files corpus.jsonl, queries.jsonl, qrels/test.tsv; or sts.tsv / sts.jsonl).")
    elif verb == "compare":
        p.add_argument("--samplers", "--arms", dest="samplers", default="clustered,random",
                       help=f"Comma-separated arms: train.sampler values ({', '.join(experiments.ARM_SAMPLERS)}), "
                            "any of them with mined negatives (e.g. clustered+mined, random+mined), "
                            "or named arms (mined, clustered_mined, clp, moe, recluster; see docs/training.md). "
                            "Default: clustered,random.")
        p.add_argument("--arm", dest="custom_arms", action="append", default=[], metavar="NAME:train.key=value,...",
                       help="Define an extra arm by its train keys, e.g. --arm hard:train.negatives_per_query=4.")
        p.add_argument("--seeds", type=int, default=3, help="Seeds per arm: train.seed, +1, ... (default 3).")
        p.add_argument("--mteb", metavar="TASK[,TASK...]",
                       help="Also score every arm (each seed) and the frozen encoder on MTEB tasks (names, or "
                            "local:FOLDER), with seed-paired differences per task in report/compare.json.")
    elif verb == "sweep":
        p.add_argument("--k", dest="k_values", required=True, help="Comma-separated cluster counts, e.g. 10,100,1000.")
        p.add_argument("--limit", dest="limits",
                       help="Comma-separated data sizes (data.limit); each gets its own RUN/limit=<N>/ and embedding pass.")
        p.add_argument("--preprocess-only", action="store_true", help="Only fit/assign/shard per k; no training.")


def mteb_specs(text: str) -> list[str]:
    """--mteb's tasks; local:FOLDER made absolute (a Ray task reads it, in another working directory)."""
    specs = [LOCAL_PREFIX + os.path.abspath(s.removeprefix(LOCAL_PREFIX)) if s.startswith(LOCAL_PREFIX) else s
             for s in experiments.parse_list(text, "--mteb")]
    for spec in specs:  # before Ray starts, and said as what it is (not a folder that "lacks corpus.jsonl")
        folder = spec.removeprefix(LOCAL_PREFIX)
        if spec.startswith(LOCAL_PREFIX) and not os.path.isdir(folder):
            raise config_mod.ConfigError(f"--mteb {spec}: {folder} is not a folder here ("
                                         f"{'a file' if os.path.exists(folder) else 'no such path'}); local:FOLDER "
                                         f"names a folder of corpus.jsonl, queries.jsonl and qrels/test.tsv "
                                         f"(retrieval) or sts.tsv (STS).")
    return specs


def run_experiment(args, cfg, run, stage_options: dict) -> None:

    if args.verb == "compare":
        samplers = experiments.parse_list(args.samplers, "--arms", example="clustered,random")
        custom = dict(experiments.parse_arm(text) for text in args.custom_arms)
        summary = experiments.run_compare(cfg, run, samplers, args.seeds, custom, stage_options,
                                          mteb_specs(args.mteb) if args.mteb else None)
        for name, arm in summary["arms"].items():
            n = arm["metrics"]["ndcg_at_10"]
            print(f"{name}: NDCG@10 {n['mean']:.4f} ± {n['std']:.4f} ({n['min']:.4f}..{n['max']:.4f}) over "
                  f"{len(arm['seeds'])} seeds")
    else:
        limits = experiments.parse_list(args.limits, "--limit", int) if args.limits else None
        sweep = experiments.run_sweep(cfg, run.uri, experiments.parse_list(args.k_values, "--k", int), limits,
                                      args.preprocess_only, stage_options)
        print(experiments.sweep_line(sweep, run))


def saved_k(run) -> int:
    """cluster.k of RUN/config.yaml (a hand-edited or truncated one included)."""
    where = run.path("config.yaml")
    saved = config_mod.parse_yaml(run.read_bytes("config.yaml"), where)
    cluster = saved.get("cluster") if isinstance(saved, dict) else None
    k = cluster.get("k") if isinstance(cluster, dict) else None
    if isinstance(k, bool) or not isinstance(k, int):
        raise config_mod.ConfigError(f"{where} has no integer cluster.k (found {bounded_repr(cluster)} under "
                                     f"`cluster`): pass --k K to choose the clustering to show.")
    return k


def inspect_run(run_dir: str, k: int | None, json_path: str | None) -> None:
    """Print the cluster table of shards/k=<k>/ and write it as JSON (default RUN/shards/k=<k>/inspect.json)."""

    if k is not None and k < 1:
        raise config_mod.ConfigError(f"--k must be a number of clusters of at least 1, got {k}.")
    run = RunDir(run_dir)
    if not run.exists():  # a mistyped path: not a run whose shard stage is missing
        raise StageMissingError(f"{run_dir}: no such run directory (check the path).")
    json_folder = os.path.dirname(os.path.abspath(json_path)) if json_path else None
    if json_folder and not os.path.isdir(json_folder):
        raise config_mod.ConfigError(f"--json {json_path}: the folder {json_folder} does not exist; create it or "
                                     f"pass a path in an existing folder.")
    if k is None:
        if not run.exists("config.yaml"):
            raise config_mod.ConfigError(f"{run_dir} has no config.yaml: pass --k or check the run directory.")
        k = saved_k(run)
    table = cluster_table(load_manifest(run, k))
    print(format_cluster_table(table))
    if json_path:
        json_path = os.path.abspath(os.path.expanduser(json_path))
        with open(json_path, "w") as f:
            json.dump(table, f, indent=2)
    else:
        run.write_json(f"{shards_dir(k)}/inspect.json", table)
        json_path = run.path(shards_dir(k), "inspect.json")
    print(f"table written to {json_path}")


# Options naming a path or URI (argparse dest -> as the user wrote it), refused before any work when they hold a
# control character or are an ambiguous URI (knobs.check_text); open_run checks --run-dir and --set again (jobs).
PATH_OPTIONS = {"config": "the config file", "run_dir": "--run-dir", "run_dir_opt": "--run-dir", "run": "RUN",
                "save_in": "--save-in", "json_path": "--json", "cluster": "--cluster", "calibration": "--calibration",
                "gpu_calibration": "--gpu-calibration"}


def check_arguments(args: argparse.Namespace) -> None:
    for dest, option in PATH_OPTIONS.items():
        if isinstance(getattr(args, dest, None), str):
            check_text(option, getattr(args, dest))
    for text in getattr(args, "overrides", []):
        config_mod.parse_override(text)


@redacted_command
def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself (console script, python -m), not a caller passing arguments
        interrupt.install()
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        check_arguments(args)
        if args.verb == "config":
            print(config_mod.describe_markdown() if args.markdown else config_mod.describe())
            return 0
        if args.verb == "inspect":
            run_dir = args.run or args.run_dir_opt
            if not run_dir:
                raise config_mod.ConfigError("inspect needs the run directory: `clusterscale inspect RUN --k K`.")
            inspect_run(run_dir, args.k, args.json_path)
            return 0
        if args.verb == "plan":
            run_plan_verb(args)
            return 0
        if args.verb == "synth":
            started = time.time()
            run_synth_verb(args)
            print(f"done in {time.time() - started:.1f}s; run directory: {redact_uri(args.run_dir)}", flush=True)
            return 0
        cfg, run = pipeline.open_run(args.run_dir, args.config, args.overrides)
        # A stage verb's --replace redoes that stage; run, compare and sweep replace what another config made.
        replace = ("always" if args.verb in STAGE_VERBS else "changed") if getattr(args, "replace", False) \
            else ""
        stage_options = {"replace": replace,
                         "command": shlex.join(["clusterscale", *(sys.argv[1:] if argv is None else argv)])}
        if args.verb in ("compare", "sweep"):
            started = time.time()
            run_experiment(args, cfg, run, stage_options)
            print(f"done in {time.time() - started:.1f}s", flush=True)
            return 0
        verbs = pipeline.pipeline(cfg) if args.verb == "run" else (args.verb,)
        specs = mteb_specs(args.mteb) if args.verb == "evaluate" and args.mteb else None
        started = time.time()
        results = pipeline.run_stages(cfg, run, verbs, resume=getattr(args, "resume", False), **stage_options)
        if specs:
            run_mteb(cfg, run, specs)
        if args.verb in ("run", "evaluate", "report"):
            print(pipeline.summary(cfg, run, results))
        print(f"done in {time.time() - started:.1f}s; run directory: {redact_uri(run.uri)}", flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 - user faults become one paragraph; bugs keep their traceback
        message = user_message(exc)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

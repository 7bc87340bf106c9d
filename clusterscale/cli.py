"""The `clusterscale` command: `clusterscale VERB [CONFIG.yaml] --run-dir DIR [--set section.key=value ...]`."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

from clusterscale import config as config_mod
from clusterscale.errors import bounded_repr, user_message
from clusterscale.redact import redact_uri

VERBS = {
    "run": "Run every stage in order: ingest, embed, fit, assign, shard, train, evaluate, report.",
    "ingest": "Read, validate and split the input pairs into pairs/, heldout/ and quarantine/.",
    "embed": "Embed the configured side of every pair with the frozen encoder (Ray Data actor pool).",
    "fit": "Fit spherical k-means (faiss) on a seeded sample of the embeddings.",
    "assign": "Assign every embedded pair to its nearest centroid (Ray Data pass).",
    "shard": "Write one shuffled Parquet shard set per cluster and the manifest.",
    "mine": "Mine hard negatives for every training query (faiss over the training passages, Ray Data pass).",
    "train": "Train the student with Ray Train DDP, every global batch from one cluster.",
    "evaluate": "Held-out retrieval metrics of the frozen encoder and the trained model.",
    "report": "Write report/report.md with PNG plots: clusters, costs, evaluation, experiments, curves.",
    "compare": "Train and evaluate every sampler x seed arm on the same shards; mean and spread per arm.",
    "sweep": "Cluster at several k (and data sizes) from one embedding pass each; optionally train and evaluate.",
    "inspect": "Print the cluster table (rows, intra-cluster cosine, sample queries) of a run.",
    "config": "Print every config key with its default and documentation.",
}
PIPELINE = ("ingest", "embed", "fit", "assign", "shard", "train", "evaluate", "report")


def pipeline(cfg) -> tuple[str, ...]:
    """The stages of `run`: mining joins them when training uses mined negatives."""
    if not cfg.train.negatives_per_query:
        return PIPELINE
    return PIPELINE[:5] + ("mine",) + PIPELINE[5:]


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("clusterscale")
    except PackageNotFoundError:  # run from a source tree that was never pip-installed
        from clusterscale import __version__

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
        add_experiment_arguments(verb, p)
    return parser


def add_experiment_arguments(verb: str, p: argparse.ArgumentParser) -> None:
    """Options of the evaluate, compare and sweep verbs."""
    if verb == "evaluate":
        p.add_argument("--mteb", metavar="TASK[,TASK...]",
                       help="Also run MTEB retrieval tasks: MTEB task names (data from the HF hub) or "
                            "local:FOLDER (BEIR files corpus.jsonl, queries.jsonl, qrels/test.tsv).")
    elif verb == "compare":
        p.add_argument("--samplers", "--arms", dest="samplers", default="clustered,random",
                       help="Comma-separated arms: train.sampler values (clustered, random, random_clusters, source) "
                            "or named arms (mined, clustered_mined, clp, moe, recluster; see README). "
                            "Default: clustered,random.")
        p.add_argument("--arm", dest="custom_arms", action="append", default=[], metavar="NAME:train.key=value,...",
                       help="Define an extra arm by its train keys, e.g. --arm hard:train.negatives_per_query=4.")
        p.add_argument("--seeds", type=int, default=3, help="Seeds per arm: train.seed, +1, ... (default 3).")
    elif verb == "sweep":
        p.add_argument("--k", dest="k_values", required=True, help="Comma-separated cluster counts, e.g. 10,100,1000.")
        p.add_argument("--limit", dest="limits",
                       help="Comma-separated data sizes (data.limit); each gets its own RUN/limit=<N>/ and embedding pass.")
        p.add_argument("--preprocess-only", action="store_true", help="Only fit/assign/shard per k; no training.")


def run_experiment(args, cfg) -> None:
    from clusterscale import experiments
    from clusterscale.rundir import RunDir

    if args.verb == "compare":
        samplers = experiments.parse_list(args.samplers, "--samplers")
        custom = dict(experiments.parse_arm(text) for text in args.custom_arms)
        summary = experiments.run_compare(cfg, RunDir(args.run_dir), samplers, args.seeds, custom)
        for name, arm in summary["arms"].items():
            n = arm["metrics"]["ndcg_at_10"]
            print(f"{name}: NDCG@10 {n['mean']:.4f} ± {n['std']:.4f} ({n['min']:.4f}..{n['max']:.4f}) over "
                  f"{len(arm['seeds'])} seeds")
    else:
        limits = experiments.parse_list(args.limits, "--limit", int) if args.limits else None
        sweep = experiments.run_sweep(cfg, args.run_dir, experiments.parse_list(args.k_values, "--k", int), limits,
                                      args.preprocess_only)
        print(f"sweep: {len(sweep['points'])} points; table in {redact_uri(args.run_dir)}/report/report.md")


def stage_functions() -> dict[str, Callable]:
    from clusterscale.embed import run_embed
    from clusterscale.evaluate import run_evaluate
    from clusterscale.ingest import run_ingest
    from clusterscale.kmeans import run_assign, run_fit
    from clusterscale.mine import run_mine
    from clusterscale.report import run_report
    from clusterscale.shards import run_shard
    from clusterscale.train.loop import run_train

    return {"ingest": run_ingest, "embed": run_embed, "fit": run_fit, "assign": run_assign,
            "shard": run_shard, "mine": run_mine, "train": run_train, "evaluate": run_evaluate, "report": run_report}


def run_stages(cfg, run, verbs: tuple[str, ...], resume: bool = False, write_config: bool = True,
               cost_keys: dict[str, str] | None = None) -> dict:
    """Run stages in order, recording each one's cost; returns {verb: result}. `resume`: train only.

    cost_keys renames a verb's entry in report/costs.json (e.g. {"fit": "fit:k=100"} in a sweep);
    write_config=False keeps RUN/config.yaml as it is (experiments run variants of one config)."""
    from clusterscale.session import init_ray

    init_ray(cfg.ray)
    if write_config:
        run.write_config(cfg)
    functions, results = stage_functions(), {}
    for verb in verbs:
        print(f"== {verb} ==", flush=True)
        started = time.time()
        results[verb] = functions[verb](cfg, run, resume=True) if verb == "train" and resume else \
            functions[verb](cfg, run)
        if verb not in ("report",):
            stats = results[verb]["stats"] if verb == "evaluate" else results[verb]
            key = f"train:{cfg.train_name()}" if verb == "train" else verb
            run.record_cost((cost_keys or {}).get(verb, key),
                            {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
                            | {"invocation_s": round(time.time() - started, 3)})
    return results


def summary(cfg, run, results: dict) -> str:
    lines = ["", "== summary =="]
    if run.exists("pairs", "_DONE.json"):
        s = run.done_stats("pairs")
        shard_rows = run.read_json(f"shards/k={cfg.cluster.k}/manifest.json")["stats"] \
            if run.exists(f"shards/k={cfg.cluster.k}", "manifest.json") else None
        lines.append(f"rows in {s['rows_in']} | quarantined {s['quarantine']} | held out {s['heldout']} | "
                     f"sharded {shard_rows['rows'] if shard_rows else '-'}")
        if shard_rows:
            lines.append(f"k={cfg.cluster.k}: {shard_rows['shards']} shards, sizes {shard_rows['min_rows']}.."
                         f"{shard_rows['max_rows']}")
    if "evaluate" in results:
        for name, r in results["evaluate"]["results"].items():
            lines.append(f"held-out NDCG@10 {name}: {r['metrics']['ndcg_at_10']:.4f}")
    if run.exists("report/report.md"):
        lines.append(f"report: {run.path('report/report.md')}")
    return "\n".join(lines)


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
    import json

    from clusterscale.rundir import RunDir
    from clusterscale.shards import cluster_table, format_cluster_table, load_manifest, shards_dir

    run = RunDir(run_dir)
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
        with open(json_path, "w") as f:
            json.dump(table, f, indent=2)
    else:
        run.write_json(f"{shards_dir(k)}/inspect.json", table)
        json_path = run.path(shards_dir(k), "inspect.json")
    print(f"table written to {json_path}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if args.verb == "config":
            print(config_mod.describe())
            return 0
        if args.verb == "inspect":
            run_dir = args.run or args.run_dir_opt
            if not run_dir:
                raise config_mod.ConfigError("inspect needs the run directory: `clusterscale inspect RUN --k K`.")
            inspect_run(run_dir, args.k, args.json_path)
            return 0
        from clusterscale.rundir import RunDir

        cfg = config_mod.load(args.config, args.overrides)
        if args.verb in ("compare", "sweep"):
            started = time.time()
            run_experiment(args, cfg)
            print(f"done in {time.time() - started:.1f}s", flush=True)
            return 0
        run = RunDir(args.run_dir)
        verbs = pipeline(cfg) if args.verb == "run" else (args.verb,)
        started = time.time()
        results = run_stages(cfg, run, verbs, resume=getattr(args, "resume", False))
        if args.verb == "evaluate" and args.mteb:
            from clusterscale.experiments import parse_list
            from clusterscale.mteb_eval import run_mteb

            run_mteb(cfg, run, parse_list(args.mteb, "--mteb"))
        if args.verb in ("run", "evaluate", "report"):
            print(summary(cfg, run, results))
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

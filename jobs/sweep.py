"""Ray job: a sweep over cluster.k that embeds once and fits, assigns and shards once per k.

Ingest and embed run (or are reused) once; each k writes beside the others (kmeans/k=<k>/, shards/k=<k>/).
With --train, each k also trains (train/sweep-<sampler>-k<k>-seed<seed>/, as `clusterscale sweep` names it, so
never the run's own train.name) and is evaluated.

    ray job submit --working-dir . -- python jobs/sweep.py CONFIG --run-dir URI --k 10 100 1000 [--train]
"""
import sys

from _job import PREPROCESS, build_parser, run_job, stage_options

from clusterscale import cli
from clusterscale.experiments import arm_name, check_arm_names, variant


def sweep(cfg, run, args) -> None:
    rows = []
    names = {k: arm_name("sweep", f"{cfg.train.sampler}-k{k}", cfg.train.seed) for k in args.k}
    if args.train:
        check_arm_names(cfg, list(names.values()))
    for k in args.k:
        cfg_k = variant(cfg, cluster={"k": k}, train={"name": names[k]} if args.train else {})
        verbs = PREPROCESS + (("train", "evaluate") if args.train else ())
        print(f"== k={k} ==", flush=True)
        results = cli.run_stages(cfg_k, run, verbs, **stage_options(args))
        shard = results["shard"]
        rows.append(f"k={k}: {shard['shards']} shards, rows per shard {shard['min_rows']}..{shard['max_rows']}, "
                    f"fit objective {results['fit']['objective']:.1f}"
                    + (f", NDCG@10 {results['evaluate']['results'][cfg_k.train_name()]['metrics']['ndcg_at_10']:.4f}"
                       if args.train else ""))
    if args.train:
        cli.run_stages(cfg_k, run, ("report",))
    print("\n== sweep ==\n" + "\n".join(rows), flush=True)


if __name__ == "__main__":
    parser = build_parser(__doc__)
    parser.add_argument("--k", type=int, nargs="+", required=True, help="The cluster.k values to sweep.")
    parser.add_argument("--train", action="store_true", help="Also train and evaluate one model per k.")
    sys.exit(run_job(__doc__, sweep, parser=parser))

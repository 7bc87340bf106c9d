"""Ray job: a sweep over cluster.k that embeds once and fits, assigns and shards once per k.

Ingest and embed run (or are reused) once; each k writes beside the others (kmeans/k=<k>/, shards/k=<k>/).
With --train, each k also trains (train/<train name>-k<k>/, e.g. clustered-seed0-k100) and is evaluated.

    ray job submit --working-dir . -- python jobs/sweep.py CONFIG --run-dir URI --k 10 100 1000 [--train]
"""
import sys

from _job import PREPROCESS, build_parser, run_job

from clusterscale import cli
from clusterscale.experiments import variant


def sweep(cfg, run, args) -> None:
    rows = []
    for k in args.k:
        # One training run per k, named so that runs of different k never collide (nor with the main run's).
        cfg_k = variant(cfg, cluster={"k": k}, train={"name": f"{cfg.train_name()}-k{k}"} if args.train else {})
        verbs = PREPROCESS + (("train", "evaluate") if args.train else ())
        print(f"== k={k} ==", flush=True)
        results = cli.run_stages(cfg_k, run, verbs, replace="changed" if args.replace else "")
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

"""Ray job: `clusterscale sweep` as a job: one embedding pass per data size, fit, assign and shard per k.

Each k writes beside the others (kmeans/k=<k>/, shards/k=<k>/); --limit N1,N2 sweeps data sizes too, each
in RUN/limit=<N>/. With --train, each k also trains (train/sweep-<sampler>-k<k>-seed<seed>/) and is evaluated.
The table goes to report/sweep.json and report/report.md, as with `clusterscale sweep`.

    ray job submit --working-dir . -- python jobs/sweep.py CONFIG --run-dir URI --k 10,100 [--limit N1,N2] [--train]
"""
import sys

from _job import build_parser, run_job, stage_options

from clusterscale.experiments import parse_list, run_sweep, sweep_line


def sweep(cfg, run, args) -> None:
    ks = parse_list(",".join(args.k), "--k", int)  # `--k 10,100` as in the CLI, or the older `--k 10 100`
    limits = parse_list(args.limits, "--limit", int) if args.limits else None
    print(sweep_line(run_sweep(cfg, run.uri, ks, limits, not args.train, stage_options(args)), run), flush=True)


if __name__ == "__main__":
    parser = build_parser(__doc__)
    parser.add_argument("--k", nargs="+", required=True, help="Comma-separated cluster counts, e.g. 10,100,1000.")
    parser.add_argument("--limit", dest="limits", help="Comma-separated data sizes (data.limit); each gets its own "
                                                       "RUN/limit=<N>/ and embedding pass.")
    parser.add_argument("--train", action="store_true", help="Also train and evaluate one model per k.")
    sys.exit(run_job(__doc__, sweep, parser=parser))

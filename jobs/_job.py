"""What every job entry point shares: arguments, joining the cluster, the run directory, exit codes.

Exit status: 0 done, 2 a user error (bad config, missing stage; the message says what to fix),
1 anything else (the traceback is printed). The run directory is printed first and last, so a
failed job still says where its partial output is.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import traceback
from pathlib import Path
from typing import Callable

# The package shipped with the job (`--working-dir .`) wins over an older one installed on the image.
REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from clusterscale import pipeline  # noqa: E402

from clusterscale.runtime import interrupt, session  # noqa: E402
from clusterscale.errors import user_message  # noqa: E402
from clusterscale.redact import redact_uri, redacted_command  # noqa: E402


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="Pipeline config YAML (e.g. cluster_configs/msmarco-paper.yaml); "
                                                  "omitted = the embedded default.")
    parser.add_argument("--run-dir", required=True, help="Run directory: an object-store URI (s3://bucket/runs/x) "
                                                         "or a folder on storage shared by every node.")
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help="Override config keys, e.g. --set cluster.k=16 train.num_workers=8.")
    parser.add_argument("--replace", action="store_true",
                        help="Replace every output made with a different config, and every output made from it, "
                             "instead of refusing (see docs/cli.md, Reruns).")
    return parser


@redacted_command
def run_job(description: str, body: Callable, argv: list[str] | None = None,
            parser: argparse.ArgumentParser | None = None) -> int:
    """Parse arguments, load and validate the config, join Ray, call body(cfg, run, args); an exit status.
    Ctrl-C: exit 130 (SIGTERM, as `ray job stop` sends: 143), finished units kept (runtime.interrupt; only when
    run as a program, argv None)."""
    if argv is None:
        interrupt.install()
    args = (parser or build_parser(description)).parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_uri = redact_uri(args.run_dir)
    try:
        cfg, run = pipeline.open_run(args.run_dir, args.config, args.overrides)  # validated before any cluster time
        run_uri = redact_uri(run.uri)
        print(f"run directory: {run_uri}", flush=True)
        session.init_ray(cfg.ray)
        address = session.cluster_address(cfg.ray)
        print(f"ray: {'joined ' + address if address else 'local instance'}", flush=True)
        session.check_run_dir_shared(run, cfg.ray.shared_run_dir)
        body(cfg, run, args)
    except Exception as exc:  # noqa: BLE001 - a job must end with a status, never hang on an exception
        message = user_message(exc)
        if message is not None:
            print(f"error: {message}\nrun directory: {run_uri}", file=sys.stderr, flush=True)
            return 2
        print(redact_uri(traceback.format_exc()), file=sys.stderr, end="", flush=True)
        print(f"failed; run directory: {run_uri}", file=sys.stderr, flush=True)
        return 1
    print(f"done; run directory: {run_uri}", flush=True)
    return 0


def stage_options(args) -> dict:
    """run_stages' replace and command (for the advice of a refused rerun) of this job's arguments."""
    return {"replace": "changed" if args.replace else "", "command": shlex.join(["python", *sys.argv])}


def stages_job(description: str, verbs: tuple[str, ...] | Callable, argv: list[str] | None = None) -> int:
    """A job that runs `verbs` (or verbs(cfg)) in order with the pipeline's stage runner, as the CLI does."""
    def body(cfg, run, args):
        stages = verbs(cfg) if callable(verbs) else verbs
        results = pipeline.run_stages(cfg, run, stages, **stage_options(args))
        if "evaluate" in stages or "report" in stages:
            print(pipeline.summary(cfg, run, results), flush=True)

    return run_job(description, body, argv)

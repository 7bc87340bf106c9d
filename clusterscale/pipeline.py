"""The pipeline: which stages a config runs, and the runner every entry point shares (CLI, jobs, compare, sweep).

run_stages takes each stage's output lock, replaces or refuses an output made with another config, runs
the stage and records its cost in report/costs.json. The stage names and their order are layout.STAGES.
"""
from __future__ import annotations

import time
from typing import Callable

from clusterscale import config as config_mod
from clusterscale.runtime import session
from clusterscale.config import Config
from clusterscale.stages.embed import run_embed
from clusterscale.stages.evaluate import run_evaluate
from clusterscale.stages.ingest import run_ingest
from clusterscale.stages.kmeans import run_assign, run_fit
from clusterscale.io.layout import (EVAL, NEGATIVES, STAGES, TRAIN, assign_dir, eval_path, kmeans_dir, manifest_path,
                                    shards_dir, train_dir)
from clusterscale.stages.mine import run_mine
from clusterscale.stages.report import run_report
from clusterscale.io.rundir import ConfigMismatchError, RunDir
from clusterscale.stages.shards import run_shard
from clusterscale.train.loop import run_train

STAGE_FUNCTIONS: dict[str, Callable] = {
    "ingest": run_ingest, "embed": run_embed, "fit": run_fit, "assign": run_assign, "shard": run_shard,
    "mine": run_mine, "train": run_train, "evaluate": run_evaluate, "report": run_report}


def pipeline(cfg: Config, first: str = STAGES[0], last: str = STAGES[-1]) -> tuple[str, ...]:
    """The stages from `first` to `last` that cfg runs: `mine` only when training uses mined negatives."""
    chosen = STAGES[STAGES.index(first):STAGES.index(last) + 1]
    return tuple(s for s in chosen if s != "mine" or cfg.train.negatives_per_query)


def stage_output(cfg: Config, verb: str) -> str:
    """The folder of the run that `verb` writes with `cfg` (what it locks and what --replace removes)."""
    k = cfg.cluster.k
    return {"ingest": "pairs", "embed": "embeddings", "fit": kmeans_dir(k), "assign": assign_dir(k),
            "shard": shards_dir(k), "mine": NEGATIVES, "train": train_dir(cfg.train_name()), "evaluate": EVAL,
            "report": "report"}[verb]


def open_run(run_dir: str, config_path: str | None, overrides: list[str]) -> tuple[Config, RunDir]:
    """(config, RunDir) of a command: an existing run starts from its own RUN/config.yaml, a new one from the
    default (or the config file); --set applies on top. Local paths come back absolute, so that nothing
    relative to this working directory reaches a Ray worker."""
    run = RunDir(run_dir)
    return config_mod.load(config_path, overrides, run_config=run.config_in_force()), run


def run_stages(cfg: Config, run: RunDir, verbs: tuple[str, ...], resume: bool = False, write_config: bool = True,
               cost_keys: dict[str, str] | None = None, replace: str = "", command: str = "") -> dict:
    """Run stages in order, each holding the lock of its output folder, recording each one's cost;
    returns {verb: result}. `resume`: train only.

    cost_keys renames a verb's entry in report/costs.json (e.g. {"fit": "fit:k=100"} in a sweep);
    write_config writes RUN/config.yaml for a new run (see RunDir.config_in_force) or when replacing: an
    existing run's config is never rewritten otherwise; False keeps it as it is (experiments run variants).
    replace: "" refuses outputs made with another config; "changed" replaces them (and what was made from
    them); "always" also replaces outputs made with this config. command: the user's command line, for the
    advice of a refusal."""
    session.init_ray(cfg.ray)
    if write_config and (replace or run.config_in_force() is None):
        run.write_config(cfg)
    results = {}
    for verb in verbs:
        print(f"== {verb} ==", flush=True)
        started = time.time()
        with run.lock(stage_output(cfg, verb)):
            if replace == "always":
                _replace(run, stage_output(cfg, verb))
            results[verb] = _run_stage(STAGE_FUNCTIONS[verb], verb, cfg, run, resume, replace, command)
        if verb not in ("report",):
            stats = results[verb]["stats"] if verb == "evaluate" else results[verb]
            key = f"train:{cfg.train_name()}" if verb == "train" else verb
            run.record_cost((cost_keys or {}).get(verb, key),
                            {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
                            | {"invocation_s": round(time.time() - started, 3)})
    return results


def _run_stage(function: Callable, verb: str, cfg: Config, run: RunDir, resume: bool, replace: str, command: str):
    """One stage; an output made with another config is replaced (replace set) or refused with the way on."""
    call = (lambda: function(cfg, run, resume=True)) if verb == "train" and resume else (lambda: function(cfg, run))
    try:
        return call()
    except ConfigMismatchError as exc:
        if not replace or not exc.stage_dir:
            again = command or f"clusterscale {verb} --run-dir {run.uri} [your CONFIG and --set keys]"
            raise ConfigMismatchError(
                f"{exc} To go on, either use a new --run-dir, or replace {exc.stage_dir or 'that output'}/ and every "
                f"output made from it: {again} --replace", exc.stage_dir) from None
        _replace(run, exc.stage_dir)
        return call()


def _replace(run: RunDir, stage_dir: str) -> None:
    removed = run.replace(stage_dir)
    for folder in removed:  # a replaced model's cached evaluation goes with it
        if folder.startswith(f"{TRAIN}/"):
            run.remove(eval_path(folder.removeprefix(f"{TRAIN}/")))
    print(f"replaced: removed {', '.join(f + '/' for f in removed)}", flush=True)


def summary(cfg: Config, run: RunDir, results: dict) -> str:
    lines = ["", "== summary =="]
    if run.exists("pairs", "_DONE.json"):
        s = run.done_stats("pairs")
        manifest = manifest_path(cfg.cluster.k)
        shard_rows = run.read_json(manifest)["stats"] if run.exists(manifest) else None
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

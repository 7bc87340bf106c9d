"""Restartable work units: a stage's plan of units, fixed at its first attempt, each unit one output file.

A unit's output is written atomically (RunDir.write_bytes), so a file under its final name is complete:
a rerun skips it and redoes the rest into the same names, so no row is lost or duplicated. The plan
carries the config fingerprint; a rerun with another config is refused rather than mixing outputs.
Used by embed (row ranges of pairs/ files) and mine (one unit per embeddings file).
"""
from __future__ import annotations

import posixpath
from typing import Callable

from clusterscale.io.rundir import ConfigMismatchError, RunDir, changed_keys

TMP_PREFIX = ".tmp-"  # RunDir.write_bytes's temporary names: what a write cut short by a kill leaves


def load_or_make_plan(run: RunDir, out_dir: str, plan_rel: str, fingerprint: str, what: str,
                      make_plan: Callable[[], dict]) -> dict:
    """The plan of `out_dir`: an interrupted attempt's (same fingerprint only), else a fresh one.

    make_plan() returns {"units": [{"output": run-relative path, ...}, ...], ...extra fields}; a fresh
    plan clears out_dir first (never mixed with the leftovers of another plan). what: the stage's work,
    in the refusal message ('embedding')."""
    if run.exists(plan_rel):
        plan = run.read_json(plan_rel)
        if plan["fingerprint"] != fingerprint:
            raise ConfigMismatchError(
                f"{run.path(out_dir)} holds an interrupted {what} made with a different config; changed: "
                f"{changed_keys(plan.get('covers'), getattr(fingerprint, 'values', None))}. Outputs are never "
                f"mixed: rerun with that config to finish it.", out_dir)
        return plan
    run.clear(out_dir)
    plan = {"fingerprint": fingerprint, "covers": getattr(fingerprint, "values", None)} | make_plan()
    run.write_json(plan_rel, plan)
    return plan


def split_done(run: RunDir, out_dir: str, units: list[dict]) -> tuple[list[dict], list[dict]]:
    """(units whose output is complete, units still to do); removes the temp files of interrupted writes."""
    existing = set(run.listdir(out_dir))
    for name in existing:
        if name.startswith(TMP_PREFIX):
            run.remove(out_dir, name)
    done = [u for u in units if posixpath.basename(u["output"]) in existing]
    todo = [u for u in units if posixpath.basename(u["output"]) not in existing]
    return done, todo

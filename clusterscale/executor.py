"""The executor: what a stage of the pipeline is (Stage, Input, ExtraOutput) and `execute`, which runs one.

A stage declares the folders it reads, the folder it writes, the config sections its output depends on and the
resources each actor of its pool asks for; its run function gets a StageContext and returns a StageResult.
`execute` owns the rest: the output's lock, the input check, the fingerprint, reuse of an output made with the
same config (refusal or replacement of one made with another), clearing an interrupted attempt, the done marker
and the cost record in report/costs.json. No stage module does any of that itself. The list of stages is
clusterscale.pipeline.STAGES.

An output made with another config is refused (or replaced with --replace), except the output of a stage that
holds one clustering at a time (Stage.one_clustering: dedup/), which the same stage at another clustering
replaces; a stage reading such an output checks it was made with its own config (Input.made_with).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import shlex
import time
from typing import Callable, Iterator

from clusterscale import config as config_mod
from clusterscale.config import Config, Fingerprint
from clusterscale.io.layout import TRAIN, eval_path
from clusterscale.io.rundir import (ConfigMismatchError, RunDir, StageMissingError, StageResult, UnreadableFileError,
                                    changed_keys)
from clusterscale import run_protocol
from clusterscale.errors import UserError, user_error
from clusterscale.runtime import interrupt, nodes
from clusterscale.runtime.resources import Resources
from clusterscale.runtime.stage_context import RunStage, StageContext

PerConfig = str | Callable[[Config], str]  # a folder or text, or a named function of the config giving it
Sections = tuple[str, ...] | Callable[[Config], tuple[str, ...]]  # config sections, or a function of the config


def resolve(value: PerConfig, cfg: Config) -> str:
    return value(cfg) if callable(value) else value


@dataclasses.dataclass(frozen=True)
class PerK:
    """A folder of one clustering: `layout(cfg.cluster.k)` (io/layout's kmeans_dir, assign_dir, shards_dir...)."""
    layout: Callable[[int], str]

    def __call__(self, cfg: Config) -> str:
        return self.layout(cfg.cluster.k)

    @property
    def shown(self) -> str:
        return self.layout("<k>")  # type: ignore[arg-type]  # the layout functions only format k


@dataclasses.dataclass(frozen=True)
class PerConfigFolder:
    """A folder that depends on more of the config than k: `of(cfg)`; `shown`: its name in the architecture diagram
    (train/<name>/)."""
    of: Callable[[Config], str]
    shown: str

    def __call__(self, cfg: Config) -> str:
        return self.of(cfg)


def shown(folder: str | PerK | PerConfigFolder) -> str:
    """How the architecture diagram names a folder."""
    if isinstance(folder, PerConfigFolder):
        return folder.shown
    return f"{folder if isinstance(folder, str) else folder.shown}/"


@dataclasses.dataclass(frozen=True)
class Input:
    """A folder a stage reads: it must carry a done marker; otherwise the user is told to run `verb` first."""
    folder: str | PerK | PerConfigFolder
    verb: str
    what: str
    """What the folder holds, for the message when it is missing ("Centroids"; a PerK folder adds "for k=<k>")."""
    made_with: Sections = ()
    """For a folder that holds one config's output at a time (dedup/kept/): the config sections its marker must
    have been made with (this config's values), checked before the stage runs (not when its output is reused)."""
    reads_every_file: bool = True
    """The stage reads every Parquet file in the folder (a listing), so a stray one added there is refused with the
    files its marker lists (RunDir.check_complete); False: it reads the files a manifest names (the shards)."""
    covers: bool = True
    """The reading stage's fingerprint covers what the producer's covers (pipeline.chain). False where the output
    does not depend on the producer's keys (mine requires the shards but reads its vectors from assign/), or does
    through `extra` only when it applies (shard's dedup input)."""
    not_made_with: tuple[str, ...] = ()
    """Keys ('section.key') the producer's fingerprint covers but its output does not depend on (fit's centroids:
    cluster.assign_index and cluster.ivf_nprobe, which only assign reads); a reader at other values of them is not
    refused (_check_input_config)."""

    def describe(self, cfg: Config) -> str:
        return f"{self.what} for k={cfg.cluster.k}" if isinstance(self.folder, PerK) else self.what


@dataclasses.dataclass(frozen=True)
class ExtraOutput:
    """A folder written besides the stage's output and marked done with it (ingest: heldout/, quarantine/).
    Its marker stats come from result.outputs[folder] (a StageResult)."""
    folder: PerConfig
    sections: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What a stage tells `plan` about a run of some shape (Stage.estimate): the bytes its largest task or actor and
    the driver hold, what it writes (folder -> bytes) in how many files, and its CPU seconds per training pair (spread
    over the cluster's CPUs; None: plan times it from a run's cost record with --run-dir, else says it has none)."""
    task_bytes: float = 0.0
    driver_bytes: float = 0.0
    disk_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    files: int = 0
    cpu_s_per_pair: float | None = None


def _always(cfg: Config) -> bool:
    """always"""
    return True


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of the pipeline. Every field the executor reads is documented here."""
    name: str
    help: str
    """Its line in `clusterscale --help`."""
    run: Callable[[StageContext], StageResult]
    """The stage's work: run(ctx) -> StageResult, the one signature of every stage."""
    output: str | PerK | PerConfigFolder
    """The folder it writes (locked while it runs, marked done after)."""
    inputs: tuple[Input, ...] = ()
    sections: tuple[str, ...] = ()
    """The config sections of its own that the output depends on. In pipeline.STAGES the fingerprint covers them and,
    through each Input that `covers`, what that input's producer covers (pipeline.chain): embed declares ("embed",)
    and covers ("data", "embed") through pairs/."""
    marks_done: bool = True
    """False: the stage writes no done marker and runs every time (evaluate caches per model, report is rewritten
    each time)."""
    extra: Callable[[Config, RunDir], dict | None] | None = None
    """Values beyond `sections` that the fingerprint covers (the shards: the global batch size)."""
    extra_outputs: tuple[ExtraOutput, ...] = ()
    resources: Resources | None = None
    """What each actor of the stage's pool asks for: handed to run() as ctx.resources, from which the stage's
    runtime.resources.plan_actors call sizes its pool. None: the stage starts no actor pool."""
    cost_key: PerConfig | None = None
    """Its entry in report/costs.json (default: the name); "" = the stage records no cost (report)."""
    after_done: Callable[[Config, RunDir, StageResult], None] | None = None
    """Work that needs the done marker (train: the model card, dropping checkpoints)."""
    refusal_hint: str = ""
    """Said instead of the --replace advice when an output made with another config cannot be replaced."""
    check_reuse: Callable[[StageContext, str], None] | None = None
    """Called with the output folder before a done output is reused; raises ConfigMismatchError to refuse it (ingest:
    an input file changed since), which --replace then replaces like an output made with another config."""
    precheck: Callable[[Config, RunDir, bool], None] | None = None
    """Checks of what earlier commands wrote that need no Ray, called with (cfg, run, resume) before Ray starts when
    the stage is a command's first (pipeline.run_stages): a refusal in a second, not ~5 s later (train: the mined
    negatives its config asks for; with --resume, an attempt to continue). Its inputs are checked there too; the
    stage itself still checks whatever it needs."""
    changes_after_done: tuple[str, ...] = ()
    """Paths inside the output (a folder ends with '/') that change after its done marker is written, so the marker
    does not list them for its readers' check (train: the checkpoints after_done drops, the model card evaluate
    rewrites)."""
    keeps_units: bool = False
    """The stage resumes an interrupted attempt from its own unit plan (ingest, embed, assign, dedup, shard,
    mine), so the
    executor does not clear its outputs before running it."""
    shared: bool = False
    """Preprocessing: made once and shared by compare's arms and sweep's values (its cost counts as preprocessing
    in the report). A shared stage whose fingerprint covers `cluster` runs once per cluster.k in a sweep."""
    one_clustering: bool = False
    """The output holds one clustering at a time (dedup/): made at another clustering (only cluster.* differs),
    the stage replaces it instead of refusing."""
    interrupted: str = ""
    """What Ctrl-C says while the stage runs ('' = runtime.interrupt.MESSAGE: finished units are kept, rerun)."""
    in_run: Callable[[Config], bool] | None = _always
    """Whether `clusterscale run` (and a stage verb of the CLI) runs it for a config (mine only with mined
    negatives, dedup only when on); None: no step of `run` and no verb: another stage runs it through ctx.stage
    when needed (the shard sets of training) or a command of its own does (synth). Its docstring says when, in
    the architecture diagram (docs/stages.md)."""
    run_by: str = "train"
    """With in_run None: the stage that runs it when needed (the diagram: 'run by <run_by> when needed')."""
    replaces: str | None = None
    """A folder this stage stands in for: the stages after it in the list that read that folder read this stage's
    output instead, and their fingerprints cover this stage's (pipeline.wire). A filter between ingest and embed
    reads pairs/, writes its own folder and replaces "pairs"."""
    config: type | None = None
    """A config section of its own: a knobs.Section subclass (in the stage's module) named like the stage, so its
    keys are `<name>.<key>` in YAML and --set, `clusterscale config` lists them and the stage reads them as
    ctx.cfg.<name>.<key>; its fingerprint covers the section (pipeline hands the sections to config)."""

    estimate: Callable[[Config, object], Estimate] | None = None
    """estimate(cfg, shape) -> Estimate for `plan` (shape: plan.shape.RunShape: train_rows, heldout_rows, k, dim). The
    built-in stages' rules live in plan/estimate.py; a stage without either gets a row with no memory or disk."""

    def __post_init__(self) -> None:
        if self.config is not None and self.name not in self.sections:
            object.__setattr__(self, "sections", (*self.sections, self.name))

    @property
    def per_k(self) -> bool:
        """Run once per cluster.k by a sweep (kmeans/k=<k>/, or dedup/ one clustering at a time)."""
        return self.shared and "cluster" in self.sections

    def output_of(self, cfg: Config) -> str:
        return resolve(self.output, cfg)

    def fingerprint_of(self, cfg: Config, run: RunDir) -> Fingerprint:
        return cfg.fingerprint(self.sections, extra=self.extra(cfg, run) if self.extra else None)


def execute(stage: Stage, cfg: Config, run: RunDir, *, run_stage: RunStage | None = None, source: RunDir | None = None,
            resume: bool = False, fail_at_step: int | None = None, max_tasks_in_flight: int | None = None,
            replace: str = "", command: str = "", cost_key: str | None = None,
            costs_run: RunDir | None = None, inputs: dict[str, str] | None = None) -> StageResult:
    """Run one stage holding the lock of its output; record its cost.

    run_stage: how the stage runs another one (ctx.stage; pipeline.execute passes its run_stage). replace: ""
    refuses an output made with another config (but replaces a one_clustering stage's output made for another
    clustering); "changed" replaces it (and what was made from it); "always" also replaces one made with this
    config. command: the user's command line, for the advice of a refusal. cost_key: the entry in
    report/costs.json ("" = none; default: the stage's); costs_run: the run whose report/costs.json gets it
    (default: run). A result whose stats say `reused` (a stage without a marker that found every output cached,
    e.g. evaluate) keeps the cost record of the invocation that did the work. inputs: the folder of each declared
    input, by name (ctx.inputs; pipeline.wire)."""
    with _releasing_abandoned_work():
        return _execute(stage, cfg, run, run_stage=run_stage, source=source, resume=resume, fail_at_step=fail_at_step,
                        max_tasks_in_flight=max_tasks_in_flight, replace=replace, command=command, cost_key=cost_key,
                        costs_run=costs_run, inputs=inputs or {})


@contextlib.contextmanager
def _releasing_abandoned_work() -> Iterator[None]:
    """A stage that fails leaves its Ray Data iterators to the garbage collector, and their executors hold their
    actor pools' CPUs until it runs: collect them at once, so the next stage of this process (a notebook, a test, a
    sweep) finds its resources (a Ray Train worker group waited forever for a CPU an abandoned encoder held)."""
    try:
        yield
    except BaseException:
        gc.collect()
        raise


def _execute(stage: Stage, cfg: Config, run: RunDir, *, run_stage: RunStage | None, source: RunDir | None,
             resume: bool, fail_at_step: int | None, max_tasks_in_flight: int | None, replace: str, command: str,
             cost_key: str | None, costs_run: RunDir | None, inputs: dict[str, str]) -> StageResult:
    started, alive = time.time(), nodes.alive_nodes()
    ctx = StageContext(cfg, run, source, resources=stage.resources, run_stage=run_stage, resume=resume,
                       fail_at_step=fail_at_step, max_tasks_in_flight=max_tasks_in_flight, inputs=inputs)
    lost_node_said = _naming_lost_nodes(stage, run, alive, command)
    with run_protocol.lock(run, stage.output_of(cfg)), interrupt.saying(stage.interrupted), lost_node_said, \
            _naming_unreadable(stage, ctx):
        if replace == "always":
            _check_inputs(stage, ctx, command)  # before anything is removed: a replace that cannot run destroys nothing
            _replace(run, stage.output_of(cfg))
        try:
            result = _run_once(stage, ctx, command)
        except ConfigMismatchError as exc:
            _check_inputs(stage, ctx, command)  # a missing or unreadable input is what to fix, not this output
            if stage.refusal_hint:
                raise ConfigMismatchError(f"{exc} {stage.refusal_hint}", exc.stage_dir) from None
            if exc.stage_dir and not replace and _other_clustering(stage, cfg, run, exc.stage_dir):
                run.remove(exc.stage_dir)  # only it: what was made from it stays right for its own clustering
            elif not exc.stage_dir or not replace:
                again = command or f"clusterscale {stage.name} --run-dir {run.uri} [your CONFIG and --set keys]"
                raise ConfigMismatchError(
                    f"{exc} To go on, either use a new --run-dir, or replace {exc.stage_dir or 'that output'}/ and "
                    f"every output made from it: {again} --replace", exc.stage_dir) from None
            else:
                _replace(run, exc.stage_dir)
            result = _run_once(stage, ctx, command)
    key = resolve(stage.name if stage.cost_key is None else stage.cost_key, cfg) if cost_key is None else cost_key
    if key and not result.stats.get("reused"):  # a reuse keeps the record of the work
        record = {k: v for k, v in result.stats.items() if isinstance(v, (int, float, str))}
        record["invocation_s"] = round(time.time() - started, 3)
        record["started_unix"] = round(started, 3)  # when: per-stage GPU samples (benchmarks/gpu_pipeline.py)
        if stage.shared and key.split(":", 1)[0] == stage.name:  # not a re-clustering segment's (recluster:...)
            record["preprocess"] = True  # what costs and the report count as preprocessing
        run_protocol.record_cost(costs_run or run, key, record)
    return result


class NodeLostError(UserError, RuntimeError):
    """A Ray node left the cluster during a stage and Ray could not finish the stage without it."""


@contextlib.contextmanager
def _naming_lost_nodes(stage: Stage, run: RunDir, alive: dict[str, str], command: str) -> Iterator[None]:
    """Turn a failure of Ray's (not a user fault) that follows the loss of a node into one paragraph naming the node
    and the rerun. Ray retries tasks and restarts actors elsewhere by itself; what it cannot redo (an object whose
    only copy was on that node and whose owner is gone, an actor out of restarts) fails the stage, and the stage's
    units written whole before stay for the rerun."""
    try:
        yield
    except Exception as exc:
        lost = nodes.lost_nodes(alive) if user_error(exc) is None else []
        if not lost:
            raise
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        if stage.name == "train":
            again = (f"`{command} --resume`" if command.startswith("clusterscale train") else
                     f"`clusterscale train --run-dir {run.uri} --resume` (same config), then the rest of the command")
            rerun = f"Rerun {again}: training continues from its latest checkpoint (train.checkpoint_every_steps)."
        else:
            again = command or f"clusterscale {stage.name} --run-dir {run.uri} [your CONFIG and --set keys]"
            rerun = f"Rerun the same command to finish it (units written before are kept): `{again}`."
        raise NodeLostError(f"{stage.name}: Ray node {', '.join(lost)} left the cluster while the stage ran, and Ray "
                            f"could not finish the stage without it ({reason}). {rerun}") from exc


def _run_once(stage: Stage, ctx: StageContext, command: str) -> StageResult:
    """Inputs, then reuse, or clear + run + mark done."""
    cfg, run = ctx.cfg, ctx.run
    for need in stage.inputs:
        ctx.source.require(resolve(need.folder, cfg), need.verb, need.describe(cfg))
    if not stage.marks_done:  # no marker: it runs every time, reusing what it cached (its inputs maybe unread)
        for need in stage.inputs:  # evaluate --set train.lr=...: not the model it would evaluate and describe
            _check_input_config(ctx.source, need, cfg, stage.name, command)
        return stage.run(ctx)
    out, fingerprint = stage.output_of(cfg), stage.fingerprint_of(cfg, run)
    extras = [(resolve(e.folder, cfg), cfg.fingerprint(e.sections), e.sections == stage.sections)
              for e in stage.extra_outputs]
    if stage.check_reuse and run.is_done(out, fingerprint, quiet=True) and all(
            run.is_done(f, fp, quiet=True) for f, fp, _ in extras):
        stage.check_reuse(ctx, out)  # before "reused" is said
    # An extra output fingerprinted like the stage's own is said with it; one with its own sections is said too.
    if run.is_done(out, fingerprint) and all(run.is_done(f, fp, quiet=same) for f, fp, same in extras):
        return StageResult(run.done_stats(out))
    for need in stage.inputs:
        _check_made_with(ctx.source, need, cfg)
        _check_input_config(ctx.source, need, cfg, stage.name, command)
    _check_complete(ctx.source, stage, cfg)
    if not (stage.keeps_units or ctx.resume):  # an interrupted attempt's partial output
        for folder in (out, *(f for f, _, _ in extras)):
            run.clear(folder)
    try:
        result = stage.run(dataclasses.replace(ctx, fingerprint=fingerprint))
    except BaseException:
        _drop_empty(run, (out, *(f for f, _, _ in extras)))  # a stage refused before it wrote: no empty train/<name>/
        raise
    if result.complete:
        for folder, extra_fingerprint, _ in extras:
            marker = result.outputs[folder]
            run.mark_done(folder, extra_fingerprint, marker.stats, marker.config)
        run.mark_done(out, fingerprint, result.stats, result.config, unlisted=stage.changes_after_done)
        if stage.after_done:
            stage.after_done(cfg, run, result)
    return result


def _drop_empty(run: RunDir, folders: tuple[str, ...]) -> None:
    """Remove each folder that holds no file (one listing each), leaving the failure that got here to be said."""
    for folder in folders:
        with contextlib.suppress(Exception):
            if run.exists(folder) and not run.files(folder, suffix="", include_private=True):
                run.remove(folder)


def _check_inputs(stage: Stage, ctx: StageContext, command: str) -> None:
    """Every input there, its marker readable, and (a one-config folder) made with this config (else the error that
    names the verb to run): checked before an output is replaced or a refusal advises replacing it."""
    for need in stage.inputs:
        folder = resolve(need.folder, ctx.cfg)
        ctx.source.require(folder, need.verb, need.describe(ctx.cfg))
        ctx.source.done_marker(folder)  # a marker that does not parse is named with the command that rebuilds it
        _check_made_with(ctx.source, need, ctx.cfg)
        _check_input_config(ctx.source, need, ctx.cfg, stage.name, command)


def _check_complete(source: RunDir, stage: Stage, cfg: Config) -> None:
    """Each input folder (once) against the files its done marker lists, before the stage reads it: one listing per
    folder (RunDir.check_complete)."""
    checked = set()
    for need in stage.inputs:
        folder = resolve(need.folder, cfg)
        if folder not in checked:
            checked.add(folder)
            source.check_complete(folder, need.describe(cfg), need.verb, strays=need.reads_every_file)


@contextlib.contextmanager
def _naming_unreadable(stage: Stage, ctx: StageContext) -> Iterator[None]:
    """A run file that does not parse (a done marker, a manifest, a Parquet footer) inside an input folder or the
    output: said with the command that rebuilds that folder (the verb that writes it, with --replace)."""
    try:
        yield
    except UnreadableFileError as exc:
        if not getattr(exc, "generic", False):  # its reader said what rebuilds it (or it crossed a Ray task)
            raise
        writers = [(ctx.source, resolve(need.folder, ctx.cfg), need.verb) for need in stage.inputs]
        if stage.in_run is not None and stage.marks_done:  # a verb of its own, whose --replace redoes the output
            writers.append((ctx.run, stage.output_of(ctx.cfg), stage.name))
        for run, folder, verb in writers:
            if exc.rel.startswith(f"{folder}/"):
                raise exc.advised(run.rebuild_advice(folder, verb)) from None
        raise


def _check_made_with(source: RunDir, need: Input, cfg: Config) -> None:
    """Refuse an input folder that holds one config's output at a time and holds another config's now."""
    sections = need.made_with(cfg) if callable(need.made_with) else need.made_with
    if not sections:
        return
    folder = resolve(need.folder, cfg)
    done = source.done_marker(folder)
    expected = cfg.fingerprint(sections)
    if done.fingerprint != expected:
        raise StageMissingError(
            f"{source.path(folder)} holds the output of another config (changed: "
            f"{changed_keys(done.covers, expected.values)}), not of this one: run `clusterscale {need.verb}` "
            f"with the same config and --run-dir first (it replaces that output).")


def _check_input_config(source: RunDir, need: Input, cfg: Config, reader: str, command: str) -> None:
    """Refuse an input folder made with other values of keys its producer's output depends on (`train --set
    embed.max_length=16` on shards of embeddings made at 32): reading it would mix outputs, and replacing only the
    reader's output (the --replace a refusal of it advises) would train on the old embeddings under a marker
    recording 16. Compared key by key over the config sections the input's marker covers (a key absent there was
    at its default), less need.not_made_with; an input that does not `cover` its producer's keys is left to
    made_with. `clusterscale run` never meets it: the first stale stage refuses its own output first."""
    if not need.covers:
        return
    folder = resolve(need.folder, cfg)
    old = source.done_marker(folder).covers
    if not old:  # a marker from before covered values were recorded: nothing to compare
        return
    sections = tuple(s for s in old if s in config_mod.all_sections())
    if not sections:
        return
    new = json.loads(json.dumps(cfg.fingerprint(sections).values))
    missing = object()
    changed = sorted(f"{s}.{k}" for s in sections for k in (old[s] or {}).keys() | new[s].keys()
                     if f"{s}.{k}" not in need.not_made_with
                     and (old[s] or {}).get(k, missing) != new[s].get(k, missing))
    if not changed:
        return
    flat = {s: {k: v for k, v in (old[s] or {}).items() if f"{s}.{k}" in changed} for s in sections}
    now = {s: {k: v for k, v in new[s].items() if f"{s}.{k}" in changed} for s in sections}
    words = shlex.split(command) if command.startswith(f"clusterscale {reader} ") else []
    again = (shlex.join(["clusterscale", "run", *(w for w in words[2:] if w not in ("--replace", "--resume"))])
             if words else f"clusterscale run --run-dir {source.uri} [this config and --set keys]")
    raise StageMissingError(
        f"{source.path(folder)}, which {reader} reads, was made with other values of keys it depends on (changed: "
        f"{changed_keys(flat, now)}): {reader} on it would mix outputs, and replacing {reader}'s output alone "
        f"would not help. Drop those --set keys to read it as it is, or redo it and what was made from it first: "
        f"`{again} --replace` (it redoes each stage made with other values, from {need.verb} or before, and keeps "
        f"the rest), or use a new --run-dir.")


def _other_clustering(stage: Stage, cfg: Config, run: RunDir, stage_dir: str) -> bool:
    """Whether `stage_dir` is the output of a one_clustering stage made with this config but for another
    clustering: its marker's covered values differ from this config's in the cluster section only. Said."""
    if not stage.one_clustering or stage_dir != stage.output_of(cfg):
        return False
    old = run.done_marker(stage_dir).covers or {}
    new = json.loads(json.dumps(stage.fingerprint_of(cfg, run).values))
    if old.get("cluster") == new.get("cluster") or {s: v for s, v in old.items() if s != "cluster"} != \
            {s: v for s, v in new.items() if s != "cluster"}:
        return False
    print(f"[{stage_dir}] holds the output of another clustering ({changed_keys(old, new)}); it holds one "
          f"clustering at a time: replaced (what was made from it stays)", flush=True)
    return True


def _replace(run: RunDir, stage_dir: str) -> None:
    removed = run_protocol.replace(run, stage_dir)
    for folder in removed:  # a replaced model's cached evaluation goes with it
        if folder.startswith(f"{TRAIN}/"):
            run.remove(eval_path(folder.removeprefix(f"{TRAIN}/")))
    print(f"replaced: removed {', '.join(f + '/' for f in removed)}", flush=True)

"""The pipeline: the one list of stages, and the executor every entry point shares (CLI, jobs, compare, sweep,
re-clustering).

A stage is a record (Stage): the folders it reads, the folder it writes, the config sections its output
depends on, the resources its Ray work asks for, and a run function returning a StageResult. `execute` owns
the rest: the output's lock, the input check, the fingerprint, reuse of an output made with the same config
(refusal or replacement of one made with another), clearing an interrupted attempt, the done marker and the
cost record in report/costs.json. No stage module does any of that itself.

An output made with another config is refused (or replaced with --replace), except the output of a stage that
holds one clustering at a time (Stage.one_clustering: dedup/), which the same stage at another clustering
replaces; a stage reading such an output checks it was made with its own config (Input.made_with).
"""
from __future__ import annotations

import dataclasses
import json
import posixpath
import time
from typing import Any, Callable

from clusterscale import config as config_mod
from clusterscale.config import Config, Fingerprint
from clusterscale.io.layout import (DEDUP, DEDUP_KEPT, DEDUP_SET, EVAL, NEGATIVES, TRAIN, assign_dir, eval_path,
                                    kmeans_dir, manifest_path, shard_set_dir, shards_dir, train_dir)
from clusterscale.io.filesystems import filesystem_errors
from clusterscale.io.rundir import DONE, ConfigMismatchError, RunDir, StageMissingError, StageResult, changed_keys
from clusterscale.runtime import session
from clusterscale.stages.dedup import dedup_applied, run_dedup, shard_input, train_dedup_config
from clusterscale.stages.embed import run_embed
from clusterscale.stages.evaluate import run_evaluate
from clusterscale.stages.ingest import run_ingest
from clusterscale.stages.kmeans import run_assign, run_fit
from clusterscale.stages.mine import run_mine
from clusterscale.stages.mine_rows import sidecars_for_training
from clusterscale.stages.report import run_report
from clusterscale.stages.shard_sets import run_shard_set
from clusterscale.stages.shards import run_shard
from clusterscale.stages.synthetic import SynthSpec, run_synth
from clusterscale.train import loop, recluster
from clusterscale.train.negatives import MINE_SECTIONS, mine_extra, mine_fingerprint

PerConfig = str | Callable[[Config], str]  # a folder or text that may depend on the config (kmeans/k=<k>)


def _resolve(value: PerConfig, cfg: Config) -> str:
    return value(cfg) if callable(value) else value


@dataclasses.dataclass(frozen=True)
class Resources:
    """What one Ray actor or task of a stage asks for (the runtime sizes pools from the cluster's resources).
    gpus_per_actor applies when the cluster has GPUs; 0 = the stage never uses one."""
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0


Sections = tuple[str, ...] | Callable[[Config], tuple[str, ...]]  # config sections, or a function of the config


@dataclasses.dataclass(frozen=True)
class Input:
    """A folder a stage reads: it must carry a done marker; otherwise the user is told to run `verb` first.
    made_with: for a folder that holds one config's output at a time (dedup/kept/), the config sections its
    marker must have been made with (this config's values), checked before the stage runs (not when its output
    is reused)."""
    folder: PerConfig
    verb: str
    what: PerConfig
    made_with: Sections = ()


@dataclasses.dataclass(frozen=True)
class ExtraOutput:
    """A folder written besides the stage's output and marked done with it (ingest: heldout/, quarantine/).
    Its marker stats come from result.outputs[folder] (a StageResult)."""
    folder: PerConfig
    sections: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class StageCall:
    """What a stage's run function gets. source: the run directory its inputs are read from (a child run
    directory re-embeds its parent's pairs); resume and fail_at_step: train only."""
    cfg: Config
    run: RunDir
    source: RunDir
    fingerprint: Fingerprint | None = None
    resume: bool = False
    fail_at_step: int | None = None


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of the pipeline (help: its line in `clusterscale --help`).

    sections (+ extra): what the output's fingerprint covers; () = the stage writes no done marker (evaluate
    caches per model, report is rewritten each time). keeps_units: the stage resumes an interrupted attempt from
    its own unit plan, so the executor does not clear its output. after_done: work that needs the marker."""
    name: str
    help: str
    run: Callable[[StageCall], StageResult]
    output: PerConfig
    inputs: tuple[Input, ...] = ()
    sections: tuple[str, ...] = ()
    extra: Callable[[Config, RunDir], dict | None] | None = None
    extra_outputs: tuple[ExtraOutput, ...] = ()
    keeps_units: bool = False
    resources: Resources = Resources()
    cost_key: PerConfig | None = None  # the entry in report/costs.json (default: the name)
    records_cost: bool = True
    after_done: Callable[[Config, RunDir, StageResult], None] | None = None
    refusal_hint: str = ""  # said instead of the --replace advice when the stage cannot be replaced
    shared: bool = False  # preprocessing: made once and shared by compare's arms and sweep's values
    per_k: bool = False  # run for every cluster.k by a sweep (one output per k, kmeans/k=<k>/, or one_clustering)
    # The output holds one clustering at a time (dedup/): made at another clustering (only cluster.* differs), the
    # stage replaces it instead of refusing.
    one_clustering: bool = False

    def output_of(self, cfg: Config) -> str:
        return _resolve(self.output, cfg)

    def fingerprint_of(self, cfg: Config, run: RunDir) -> Fingerprint:
        return cfg.fingerprint(self.sections, extra=self.extra(cfg, run) if self.extra else None)


# --- the stages ----------------------------------------------------------------------------------------------
def _train_dir(cfg: Config) -> str:
    return train_dir(cfg.train_name())


def _train_extra(cfg: Config, run: RunDir) -> dict | None:
    """Training with mined negatives depends on the negatives/ it reads; with train.dedup, on the dedup keys."""
    extra = {"negatives": mine_fingerprint(cfg, run)} if cfg.train.negatives_per_query else {}
    if cfg.train.dedup:
        extra["dedup"] = config_mod.output_keys(train_dedup_config(cfg).dedup)
    return extra or None


def _mine(call: StageCall) -> StageResult:
    """Mine; a non-frozen mine.encoder first re-embeds the pairs into a child run with the embed stage."""
    def embed_into(child_cfg: Config, child: RunDir) -> dict:
        return execute(STAGES["embed"], child_cfg, child, source=call.run, cost_key="").stats

    return run_mine(call.cfg, call.run, call.fingerprint, embed_into)


def _train(call: StageCall) -> StageResult:
    """Train in segments; between two segments (train.recluster_every) the pairs are re-clustered with the
    model so far, by the ordinary embed, fit, assign and shard stages into the segment's child run."""
    cfg, run = call.cfg, call.run
    if cfg.train.dedup:  # the clustered shards of the kept pairs, after the dedup stage (once per clustering)
        dedup_cfg = train_dedup_config(cfg)
        execute(STAGES["dedup"], dedup_cfg, run)
        execute(DEDUP_SHARDS, dedup_cfg, run)
    elif cfg.train.sampler != "clustered":  # the sampler's shard set, an input built once per clustering
        execute(SHARD_SET, cfg, run)
    plan = loop.plan_training(cfg, run, call.resume)
    if cfg.train.negatives_per_query:  # the rows of the shard set this sampler reads carry their negatives
        sidecars_for_training(cfg, run, run)
    shards_uri, recluster_s, result = run.uri, 0.0, None
    for segment in loop.segments_to_train(run, plan):
        if segment > 0:
            started = time.time()
            shards_uri = _recluster(cfg, run, plan.name, segment).uri
            recluster_s += time.time() - started
        result = loop.train_segment(cfg, run, plan, segment, shards_uri, call.resume or segment > 0,
                                    call.fail_at_step)
    return loop.finish_training(cfg, run, plan, result, recluster_s)


def _recluster(cfg: Config, run: RunDir, name: str, segment: int) -> RunDir:
    """Embed, fit, assign and shard the training pairs with the segment's encoder into its child run directory
    (its own done markers; costs recorded in the parent run as recluster:<name>:seg-<s>:<stage>)."""
    child = RunDir(run.child_uri(recluster.segment_dir(name, segment)))
    # A URI (or local path) every node can read: embed actors copy an object-store model locally.
    child_cfg = recluster.segment_config(cfg, run.child_uri(recluster.segment_dir(name, segment), "encoder"))
    print(f"[recluster] segment {segment}: re-embedding, re-fitting (k={cfg.cluster.k}) and re-sharding the "
          f"training pairs with the model after step {recluster.segment_start_step(cfg, segment)}", flush=True)
    for verb in ("embed", "fit", "assign", "shard"):
        execute(STAGES[verb], child_cfg, child, source=run if verb == "embed" else None,
                cost_key=f"recluster:{name}:seg-{segment}:{verb}", costs_run=run)
    if cfg.train.negatives_per_query:  # the run's mined negatives, aligned to the segment's shards
        sidecars_for_training(cfg, run, child)
    return child


def _shard_extra(cfg: Config, run: RunDir) -> dict:
    """Shards depend on the batch size (small-cluster policy) and, when built from dedup's kept rows, on the dedup
    keys."""
    extra = {"global_batch_size": cfg.train.global_batch_size}
    return extra | ({"dedup": config_mod.output_keys(cfg.dedup)} if dedup_applied(cfg) else {})


def _report(call: StageCall) -> StageResult:
    return StageResult({}, outputs={"report": run_report(call.cfg, call.run)})


_CLUSTERING = ("data", "embed", "cluster")
_DEDUP = (*_CLUSTERING, "dedup")  # dedup/ (one clustering at a time): its semantic pass is per cluster
_ON_GPU = Resources(cpus_per_actor=1.0, gpus_per_actor=1.0)

# The stages in pipeline order: the one list of them.
STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("ingest", "Read, validate and split the input pairs into pairs/, heldout/ and quarantine/.",
          lambda c: run_ingest(c.cfg, c.run), "pairs", sections=("data",), shared=True,
          extra_outputs=(ExtraOutput("heldout", ("data",)), ExtraOutput("quarantine", ("data",)))),
    Stage("embed", "Embed the configured side of every pair with the frozen encoder (Ray Data actor pool).",
          lambda c: run_embed(c.cfg, c.run, c.fingerprint, pairs_run=c.source), "embeddings",
          inputs=(Input("pairs", "ingest", "Ingested pairs"),), sections=("data", "embed"), keeps_units=True,
          resources=_ON_GPU, shared=True),
    Stage("fit", "Fit spherical k-means (faiss) on a seeded sample of the embeddings.",
          lambda c: run_fit(c.cfg, c.run), lambda cfg: kmeans_dir(cfg.cluster.k),
          inputs=(Input("embeddings", "embed", "Embeddings"),), sections=_CLUSTERING, resources=_ON_GPU,
          shared=True, per_k=True),
    Stage("assign", "Assign every embedded pair to its nearest centroid (Ray Data pass).",
          lambda c: run_assign(c.cfg, c.run), lambda cfg: assign_dir(cfg.cluster.k),
          inputs=(Input(lambda cfg: kmeans_dir(cfg.cluster.k), "fit", lambda cfg: f"Centroids for k={cfg.cluster.k}"),),
          sections=_CLUSTERING, resources=Resources(cpus_per_actor=0.5, gpus_per_actor=1.0), shared=True, per_k=True),
    Stage("dedup", "Remove exact and semantic (per cluster) duplicates and held-out leaks before sharding (dedup.*).",
          lambda c: run_dedup(c.cfg, c.run), DEDUP,
          inputs=(Input(lambda cfg: assign_dir(cfg.cluster.k), "assign",
                        lambda cfg: f"Cluster assignments for k={cfg.cluster.k}"),
                  Input("heldout", "ingest", "Held-out pairs")),
          sections=_DEDUP, extra_outputs=(ExtraOutput(DEDUP_KEPT, _DEDUP),),
          resources=Resources(cpus_per_actor=1.0), shared=True, per_k=True, one_clustering=True),
    Stage("shard", "Write one shuffled Parquet shard set per cluster and the manifest.",
          lambda c: run_shard(c.cfg, c.run, c.fingerprint), lambda cfg: shards_dir(cfg.cluster.k),
          inputs=(Input(lambda cfg: assign_dir(cfg.cluster.k), "assign",
                        lambda cfg: f"Cluster assignments for k={cfg.cluster.k}"),
                  Input(shard_input, "dedup", "Deduplicated pairs (dedup is on)",
                        made_with=lambda cfg: _DEDUP if dedup_applied(cfg) else ())),
          sections=(*_CLUSTERING, "shard"), extra=_shard_extra,
          resources=Resources(cpus_per_actor=0.5), shared=True, per_k=True),
    Stage("mine", "Mine hard negatives for every training query (faiss over the training passages, Ray Data pass).",
          _mine, NEGATIVES, inputs=(Input("embeddings", "embed", "Embeddings"),
                                            Input(lambda cfg: assign_dir(cfg.cluster.k), "assign",
                                                  lambda cfg: f"Cluster assignments for k={cfg.cluster.k}"),
                                            Input(lambda cfg: shards_dir(cfg.cluster.k), "shard",
                                                  lambda cfg: f"Shards for k={cfg.cluster.k}")),
          sections=MINE_SECTIONS,
          extra=mine_extra, keeps_units=True, resources=_ON_GPU),
    Stage("train", "Train the student with Ray Train DDP, every global batch from one cluster.",
          _train, _train_dir,
          inputs=(Input(lambda cfg: shards_dir(cfg.cluster.k), "shard", lambda cfg: f"Shards for k={cfg.cluster.k}"),),
          sections=(*_CLUSTERING, "shard", "train"), extra=_train_extra, resources=_ON_GPU,
          cost_key=lambda cfg: f"train:{cfg.train_name()}", after_done=loop.after_training),
    Stage("evaluate", "Held-out retrieval metrics of the frozen encoder and the trained model.",
          lambda c: run_evaluate(c.cfg, c.run), EVAL,
          inputs=(Input("heldout", "ingest", "Held-out pairs"),
                  Input(_train_dir, "train", lambda cfg: f"Trained model {cfg.train_name()!r}")), resources=_ON_GPU),
    Stage("report", "Write report/report.md with PNG plots: clusters, costs, evaluation, experiments, curves.",
          _report, "report", records_cost=False, resources=Resources(cpus_per_actor=0.0)),
)}
PREPROCESS = tuple(name for name, s in STAGES.items() if s.shared)  # what compare and sweep share across arms
PER_K_STAGES = tuple(name for name, s in STAGES.items() if s.per_k)


_SHARDS_INPUT = Input(lambda cfg: shards_dir(cfg.cluster.k), "shard", lambda cfg: f"Shards for k={cfg.cluster.k}")
# The shards of train.sampler random / random_clusters / source, written from the clustered ones when a training
# run needs them (not a step of its own in the list above).
SHARD_SET = Stage("shard_set", "Write the shards of train.sampler random, random_clusters or source.",
                  lambda c: run_shard_set(c.cfg, c.run, c.fingerprint), lambda cfg: shard_set_dir(cfg.cluster.k, cfg.train.sampler), inputs=(_SHARDS_INPUT,),
                  sections=(*_CLUSTERING, "shard"),
                  extra=lambda cfg, run: {"global_batch_size": cfg.train.global_batch_size,
                                          "sampler": cfg.train.sampler},
                  resources=Resources(cpus_per_actor=0.5), cost_key=lambda cfg: f"shard:{cfg.train.sampler}")
# The clustered shards of the pairs dedup keeps, for train.dedup=true (compare's clustered_dedup arm) beside the
# run's shards of every assigned pair; the shard stage's code with dedup/kept/ (of this k) as input.
DEDUP_SHARDS = Stage("dedup_shards", "Write the clustered shards of the deduplicated pairs (train.dedup).",
                     lambda c: run_shard(c.cfg, c.run, c.fingerprint, source=DEDUP_KEPT,
                                         folder=shard_set_dir(c.cfg.cluster.k, DEDUP_SET)),
                     lambda cfg: shard_set_dir(cfg.cluster.k, DEDUP_SET),
                     inputs=(_SHARDS_INPUT, Input(DEDUP_KEPT, "dedup", "Deduplicated pairs", made_with=_DEDUP)),
                     sections=(*_CLUSTERING, "shard"),
                     extra=lambda cfg, run: {"global_batch_size": cfg.train.global_batch_size,
                                             "dedup": config_mod.output_keys(cfg.dedup)},
                     resources=Resources(cpus_per_actor=0.5), cost_key=f"shard:{DEDUP_SET}")


def synth_stage(spec: SynthSpec, max_tasks_in_flight: int | None = None) -> Stage:
    """`clusterscale synth`: the stage that writes what ingest and embed would, from a generator."""
    return Stage("synth", "Write a synthetic run in place of ingest + embed.", lambda c: run_synth(c.cfg, c.run, spec, max_tasks_in_flight), "pairs", sections=("data",),
                 extra_outputs=(ExtraOutput("heldout", ("data",)), ExtraOutput("quarantine", ("data",)),
                                ExtraOutput("embeddings", ("data", "embed"))),
                 refusal_hint="Write the synthetic run into a new --run-dir.")


# --- the executor --------------------------------------------------------------------------------------------
def execute(stage: Stage, cfg: Config, run: RunDir, *, source: RunDir | None = None, resume: bool = False,
            fail_at_step: int | None = None, replace: str = "", command: str = "", cost_key: str | None = None,
            costs_run: RunDir | None = None) -> StageResult:
    """Run one stage holding the lock of its output; record its cost.

    replace: "" refuses an output made with another config (but replaces a one_clustering stage's output made for
    another clustering); "changed" replaces it (and what was made from it);
    "always" also replaces one made with this config. command: the user's command line, for the advice of a
    refusal. cost_key: the entry in report/costs.json ("" = none; default: the stage's); costs_run: the run
    whose report/costs.json gets it (default: run). A result whose stats say `reused` (a stage without a marker
    that found every output cached, e.g. evaluate) keeps the cost record of the invocation that did the work."""
    started = time.time()
    call = StageCall(cfg, run, source or run, resume=resume, fail_at_step=fail_at_step)
    with run.lock(stage.output_of(cfg)):
        if replace == "always":
            _replace(run, stage.output_of(cfg))
        try:
            result = _run_once(stage, call)
        except ConfigMismatchError as exc:
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
            result = _run_once(stage, call)
    key = _resolve(stage.name if stage.cost_key is None else stage.cost_key, cfg) if cost_key is None else cost_key
    if key and stage.records_cost and not result.stats.get("reused"):  # a reuse keeps the record of the work
        record = {k: v for k, v in result.stats.items() if isinstance(v, (int, float, str))}
        record["invocation_s"] = round(time.time() - started, 3)
        if stage.shared and key.split(":", 1)[0] == stage.name:  # not a re-clustering segment's (recluster:...)
            record["preprocess"] = True  # what costs and the report count as preprocessing
        (costs_run or run).record_cost(key, record)
    return result


def _run_once(stage: Stage, call: StageCall) -> StageResult:
    """Inputs, then reuse, or clear + run + mark done."""
    cfg, run = call.cfg, call.run
    for need in stage.inputs:
        call.source.require(_resolve(need.folder, cfg), need.verb, _resolve(need.what, cfg))
    if not stage.sections:
        return stage.run(call)
    out, fingerprint = stage.output_of(cfg), stage.fingerprint_of(cfg, run)
    extras = [(_resolve(e.folder, cfg), cfg.fingerprint(e.sections), e.sections == stage.sections)
              for e in stage.extra_outputs]
    # An extra output fingerprinted like the stage's own is said with it; one with its own sections is said too.
    if run.is_done(out, fingerprint) and all(run.is_done(f, fp, quiet=same) for f, fp, same in extras):
        return StageResult(run.done_stats(out))
    for need in stage.inputs:
        _check_made_with(call.source, need, cfg)
    if not (stage.keeps_units or call.resume):  # an interrupted attempt's partial output
        for folder in (out, *(f for f, _, _ in extras)):
            run.begin(folder)
    result = stage.run(dataclasses.replace(call, fingerprint=fingerprint))
    if result.complete:
        for folder, extra_fingerprint, _ in extras:
            marker = result.outputs[folder]
            run.mark_done(folder, extra_fingerprint, marker.stats, marker.config)
        run.mark_done(out, fingerprint, result.stats, result.config)
        if stage.after_done:
            stage.after_done(cfg, run, result)
    return result


def _check_made_with(source: RunDir, need: Input, cfg: Config) -> None:
    """Refuse an input folder that holds one config's output at a time and holds another config's now."""
    sections = need.made_with(cfg) if callable(need.made_with) else need.made_with
    if not sections:
        return
    folder = _resolve(need.folder, cfg)
    done = source.read_json(posixpath.join(folder, DONE))
    expected = cfg.fingerprint(sections)
    if done.get("fingerprint") != expected:
        raise StageMissingError(
            f"{source.path(folder)} holds the output of another config (changed: "
            f"{changed_keys(done.get('covers'), expected.values)}), not of this one: run `clusterscale {need.verb}` "
            f"with the same config and --run-dir first (it replaces that output).")


def _other_clustering(stage: Stage, cfg: Config, run: RunDir, stage_dir: str) -> bool:
    """Whether `stage_dir` is the output of a one_clustering stage made with this config but for another
    clustering: its marker's covered values differ from this config's in the cluster section only. Said."""
    if not stage.one_clustering or stage_dir != stage.output_of(cfg):
        return False
    old = run.read_json(posixpath.join(stage_dir, DONE)).get("covers") or {}
    new = json.loads(json.dumps(stage.fingerprint_of(cfg, run).values))
    if old.get("cluster") == new.get("cluster") or {s: v for s, v in old.items() if s != "cluster"} != \
            {s: v for s, v in new.items() if s != "cluster"}:
        return False
    print(f"[{stage_dir}] holds the output of another clustering ({changed_keys(old, new)}); it holds one "
          f"clustering at a time: replaced (what was made from it stays)", flush=True)
    return True


def _replace(run: RunDir, stage_dir: str) -> None:
    removed = run.replace(stage_dir)
    for folder in removed:  # a replaced model's cached evaluation goes with it
        if folder.startswith(f"{TRAIN}/"):
            run.remove(eval_path(folder.removeprefix(f"{TRAIN}/")))
    print(f"replaced: removed {', '.join(f + '/' for f in removed)}", flush=True)


# --- entry points' helpers -----------------------------------------------------------------------------------
def pipeline(cfg: Config, first: str = "ingest", last: str = "report") -> tuple[str, ...]:
    """The stages from `first` to `last` that cfg runs: `mine` only when training uses mined negatives, `dedup`
    only when it is on."""
    names = list(STAGES)
    chosen = names[names.index(first):names.index(last) + 1]
    return tuple(s for s in chosen if (s != "mine" or cfg.train.negatives_per_query)
                 and (s != "dedup" or cfg.dedup.enabled))


def open_run(run_dir: str, config_path: str | None, overrides: list[str]) -> tuple[Config, RunDir]:
    """(config, RunDir) of a command: an existing run starts from its own RUN/config.yaml, a new one from the
    default (or the config file); --set applies on top. Local paths come back absolute, so that nothing
    relative to this working directory reaches a Ray worker."""
    with filesystem_errors(run_dir):  # the first contact with an object store names the --run-dir
        run = RunDir(run_dir)
        run_config = run.config_in_force()
    return config_mod.load(config_path, overrides, run_config=run_config), run


def run_stage(name: str, cfg: Config, run: RunDir, **options: Any) -> StageResult:
    """One stage by name through the executor (the options of `execute`)."""
    return execute(STAGES[name], cfg, run, **options)


def run_stages(cfg: Config, run: RunDir, verbs: tuple[str, ...], resume: bool = False, write_config: bool = True,
               cost_keys: dict[str, str] | None = None, replace: str = "", command: str = "") -> dict[str, StageResult]:
    """Run stages in order with the executor; returns {verb: StageResult}. `resume`: train only.

    cost_keys renames a verb's entry in report/costs.json (e.g. {"fit": "fit:k=100"} in a sweep);
    write_config writes RUN/config.yaml for a new run (see RunDir.config_in_force) or when replacing: an
    existing run's config is never rewritten otherwise; False keeps it as it is (experiments run variants).
    replace and command: see execute."""
    session.init_ray(cfg.ray)
    session.check_run_dir_shared(run, cfg.ray.shared_run_dir)
    if write_config and (replace or run.config_in_force() is None):
        run.write_config(cfg)
    results = {}
    for verb in verbs:
        print(f"== {verb} ==", flush=True)
        results[verb] = execute(STAGES[verb], cfg, run, resume=resume and verb == "train", replace=replace,
                                command=command, cost_key=(cost_keys or {}).get(verb))
    return results


def summary(cfg: Config, run: RunDir, results: dict[str, StageResult]) -> str:
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
        for name, r in results["evaluate"].outputs["results"].items():
            lines.append(f"held-out NDCG@10 {name}: {r['metrics']['ndcg_at_10']:.4f}")
    if run.exists("report/report.md"):
        lines.append(f"report: {run.path('report/report.md')}")
    return "\n".join(lines)

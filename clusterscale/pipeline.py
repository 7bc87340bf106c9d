"""The pipeline: the one list of stages (STAGES), and the entry points every command shares (CLI, jobs, compare,
sweep, re-clustering). What a stage is and how one runs is clusterscale.executor.

`architecture_diagram()` renders the list as docs/stages.md's Architecture section (a test keeps them equal).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from clusterscale import config as config_mod
from clusterscale import executor
from clusterscale.config import Config
from clusterscale.executor import ExtraOutput, Input, PerConfigFolder, PerK, Stage, shown
from clusterscale.io.layout import (DEDUP, DEDUP_KEPT, DEDUP_SET, EVAL, HELDOUT_EMBEDDINGS, NEGATIVES, assign_dir,
                                    dedup_set_dir, kmeans_dir, manifest_path, read_manifest, shard_set_dir,
                                    shards_dir, train_dir)
from clusterscale.io.filesystems import filesystem_errors
from clusterscale.io.rundir import RunDir, StageResult
from clusterscale.modeling.model_code import check_model_code
from clusterscale.knobs import check_text
from clusterscale.runtime import session
from clusterscale.runtime.resources import Resources
from clusterscale.stages.dedup import dedup_applied, run_dedup, shard_input, train_dedup_config
from clusterscale.stages.embed import run_embed, run_embed_heldout
from clusterscale.stages.evaluate import run_evaluate
from clusterscale.io.input_files import refuse_run_dir_in_data
from clusterscale.stages.ingest import more_pairs, refuse_changed_inputs, run_ingest
from clusterscale.stages.kmeans import run_assign, run_fit
from clusterscale.stages.mine import run_mine
from clusterscale.stages.report import run_report
from clusterscale.stages.shard_sets import run_shard_set
from clusterscale.stages.shards import run_dedup_shards, run_shard
from clusterscale.stages.synthetic import run_synth
from clusterscale.stages.train import after_training, run_train
from clusterscale.stages.train import precheck as train_precheck
from clusterscale.io.negatives import mine_extra, mine_fingerprint

__all__ = ["STAGES", "STAGE_VERBS", "PREPROCESS", "PER_K_STAGES", "Stage", "Input", "ExtraOutput", "PerK",
           "PerConfigFolder", "execute", "run_stage", "run_stages", "pipeline", "open_run", "summary",
           "architecture_diagram"]


# --- what the stages' fingerprints cover beyond their sections, and their per-config names ---------------------
def _train_dir(cfg: Config) -> str:
    return train_dir(cfg.train_name())


def _train_cost_key(cfg: Config) -> str:
    return f"train:{cfg.train_name()}"


def _train_extra(cfg: Config, run: RunDir) -> dict | None:
    """Training with mined negatives depends on the negatives/ it reads; with train.dedup, on the dedup keys."""
    extra = {"negatives": mine_fingerprint(cfg, run)} if cfg.train.objective.negatives_per_query else {}
    if cfg.train.shards.dedup:
        extra["dedup"] = config_mod.output_keys(train_dedup_config(cfg).dedup)
    return extra or None


def _shard_extra(cfg: Config, run: RunDir) -> dict:
    """Shards depend on the batch size (small-cluster policy) and, when built from dedup's kept rows, on the dedup
    keys."""
    extra = {"global_batch_size": cfg.train.schedule.global_batch_size}
    return extra | ({"dedup": config_mod.output_keys(cfg.dedup)} if dedup_applied(cfg) else {})


def _shard_set_dir(cfg: Config) -> str:
    return shard_set_dir(cfg.cluster.k, cfg.train.schedule.sampler)


def _shard_set_cost_key(cfg: Config) -> str:
    return f"shard:{cfg.train.schedule.sampler}"


def _shard_set_extra(cfg: Config, run: RunDir) -> dict:
    return {"global_batch_size": cfg.train.schedule.global_batch_size, "sampler": cfg.train.schedule.sampler}


def _dedup_shards_extra(cfg: Config, run: RunDir) -> dict:
    return {"global_batch_size": cfg.train.schedule.global_batch_size, "dedup": config_mod.output_keys(cfg.dedup)}


def _dedup_sections_when_applied(cfg: Config) -> tuple[str, ...]:
    return _DEDUP if dedup_applied(cfg) else ()


def _mining(cfg: Config) -> bool:
    """with train.negatives_per_query"""
    return bool(cfg.train.objective.negatives_per_query)


def _deduplicating(cfg: Config) -> bool:
    """when dedup is on"""
    return cfg.dedup.enabled


def _holding_out(cfg: Config) -> bool:
    """when data.heldout_fraction > 0"""
    return cfg.data.heldout_fraction > 0


_DEDUP = ("data", "embed", "cluster", "dedup")  # what dedup/kept/ is made with (dedup/ holds one clustering at a time)
_ON_GPU = Resources(gpus=1)  # one actor per GPU; on a CPU cluster the stage's own rule (a CPU count, or a share)
_HALF_CPU = Resources(cpus=0.5)  # fractional: Ray Data's read and shuffle tasks keep CPUs on small nodes
_PARTS_WRITTEN = (ExtraOutput("heldout", ("data",)), ExtraOutput("quarantine", ("data",)))

_PAIRS = Input("pairs", "ingest", "Ingested pairs")
_HELDOUT = Input("heldout", "ingest", "Held-out pairs")
_EMBEDDINGS = Input("embeddings", "embed", "Embeddings")
_ASSIGNED = Input(PerK(assign_dir), "assign", "Cluster assignments")
_SHARDED = Input(PerK(shards_dir), "shard", "Shards", reads_every_file=False)  # read through its manifest
# fit's fingerprint covers assign's index keys (runs made before keep theirs); its centroids do not depend on them
_CENTROIDS = Input(PerK(kmeans_dir), "fit", "Centroids", not_made_with=("cluster.assign_index", "cluster.ivf_nprobe"))
_TRAINED = PerConfigFolder(_train_dir, f"{train_dir('<name>')}/")

def chain(stages: dict[str, Stage]) -> dict[str, Stage]:
    """The stages with their fingerprints chained through their inputs: each covers its own sections and, through
    every Input that `covers`, what the input's producer (an earlier stage) covers, in that order. So fit, declaring
    ("cluster",), covers ("data", "embed", "cluster") through embeddings/; the built-in stages cover what they always
    did (tests/test_config_compat.py: every fingerprint of a run made before is unchanged)."""
    chained: dict[str, Stage] = {}
    for name, stage in stages.items():
        inherited = [section for need in stage.inputs if need.covers and need.verb in chained
                     for section in chained[need.verb].sections] if stage.marks_done else []
        chained[name] = dataclasses.replace(stage, sections=tuple(dict.fromkeys((*inherited, *stage.sections))))
    return chained


# The stages in pipeline order: the one list of them.
STAGES: dict[str, Stage] = chain({s.name: s for s in (
    Stage("synth", "Write a synthetic run in place of ingest + embed.", run_synth, "pairs", sections=("data",),
          extra_outputs=(*_PARTS_WRITTEN, ExtraOutput("embeddings", ("data", "embed"))),
          refusal_hint="Write the synthetic run into a new --run-dir.", in_run=None),
    Stage("ingest", "Read, validate and split the input pairs into pairs/, heldout/ and quarantine/.", run_ingest,
          "pairs", sections=("data",), extra_outputs=_PARTS_WRITTEN, shared=True, check_reuse=refuse_changed_inputs,
          keeps_units=True),
    Stage("embed", "Embed the configured side of every pair with the frozen encoder (Ray Data actor pool).",
          run_embed, "embeddings", inputs=(_PAIRS,), sections=("embed",), keeps_units=True,
          resources=_ON_GPU, shared=True),
    Stage("embed_heldout", "Embed the held-out pairs with the frozen encoder (the vectors of dedup's leak check).",
          run_embed_heldout, HELDOUT_EMBEDDINGS, inputs=(_HELDOUT,), sections=("embed",), keeps_units=True,
          resources=_ON_GPU, shared=True, in_run=None, run_by="dedup"),
    Stage("fit", "Fit spherical k-means (faiss) on a seeded sample of the embeddings.", run_fit, PerK(kmeans_dir),
          inputs=(_EMBEDDINGS,), sections=("cluster",), resources=_ON_GPU, shared=True),
    Stage("assign", "Assign every embedded pair to its nearest centroid (Ray Data pass).", run_assign,
          PerK(assign_dir), inputs=(_CENTROIDS, _EMBEDDINGS),
          resources=Resources(cpus=0.5, gpus=1, cpus_with_gpu=None), shared=True, keeps_units=True),
    Stage("dedup", "Remove exact and semantic (per cluster) duplicates and held-out leaks before sharding (dedup.*).",
          run_dedup, DEDUP, inputs=(_ASSIGNED, _HELDOUT), sections=("dedup",),
          extra_outputs=(ExtraOutput(DEDUP_KEPT, _DEDUP),), shared=True, one_clustering=True, in_run=_deduplicating,
          keeps_units=True),
    Stage("shard", "Write one shuffled Parquet shard set per cluster and the manifest.", run_shard, PerK(shards_dir),
          inputs=(_ASSIGNED, Input(PerConfigFolder(shard_input, f"{DEDUP_KEPT}/ (dedup on)"), "dedup",
                                   "Deduplicated pairs (dedup is on)", made_with=_dedup_sections_when_applied,
                                   covers=False)),
          sections=("shard",), extra=_shard_extra, resources=_HALF_CPU, shared=True, keeps_units=True),
    Stage("shard_set", "Write the shards of train.sampler random, random_clusters or source from the clustered ones.",
          run_shard_set, PerConfigFolder(_shard_set_dir, f"{shard_set_dir('<k>', '<sampler>')}/"),
          inputs=(_SHARDED,), extra=_shard_set_extra,
          resources=_HALF_CPU, cost_key=_shard_set_cost_key, in_run=None),
    Stage("dedup_shards", "Write the clustered shards of the deduplicated pairs (train.dedup).", run_dedup_shards,
          PerK(dedup_set_dir), inputs=(_SHARDED, Input(DEDUP_KEPT, "dedup", "Deduplicated pairs", made_with=_DEDUP,
                                                       covers=False)),
          extra=_dedup_shards_extra, resources=_HALF_CPU, cost_key=f"shard:{DEDUP_SET}",
          in_run=None),
    Stage("mine", "Mine hard negatives for every training query (faiss over the training passages, Ray Data pass).",
          run_mine, NEGATIVES, inputs=(_EMBEDDINGS, _ASSIGNED, dataclasses.replace(_SHARDED, covers=False)),
          sections=("mine",), extra=mine_extra,
          keeps_units=True, resources=Resources(gpus=1, cpus_with_gpu=None), in_run=_mining,
          changes_after_done=("rows/",)),  # each training writes the sidecars of its draw and shard sets
    Stage("train", "Train the student with Ray Train DDP, every global batch from one cluster.", run_train, _TRAINED,
          inputs=(_SHARDED,), sections=("train",), extra=_train_extra, resources=_ON_GPU, precheck=train_precheck,
          cost_key=_train_cost_key, after_done=after_training, changes_after_done=("ray/", "model/README.md"),
          interrupted="interrupted: finished stages are kept; `clusterscale train --resume` (same config and "
                      "--run-dir) continues from train's latest checkpoint (train.checkpoint_every_steps)"),
    Stage("evaluate", "Held-out retrieval metrics of the frozen encoder and the trained model.", run_evaluate, EVAL,
          inputs=(_HELDOUT, Input(_TRAINED, "train", "Trained model")), resources=_ON_GPU, marks_done=False,
          in_run=_holding_out),
    Stage("report", "Write report/report.md with PNG plots: clusters, costs, evaluation, experiments, curves.",
          run_report, "report", cost_key="", marks_done=False),
)})
PREPROCESS = tuple(name for name, s in STAGES.items() if s.shared)  # what compare and sweep share across arms
PER_K_STAGES = tuple(name for name, s in STAGES.items() if s.per_k)
STAGE_VERBS = tuple(name for name, s in STAGES.items() if s.in_run is not None)  # `run`'s steps and CLI verbs
# A stage's own config section (Stage.config) is a section of every config made while the stage is in the list.
config_mod.set_stage_sections(lambda: {s.name: s.config for s in STAGES.values() if s.config is not None})


def execute(stage: Stage, cfg: Config, run: RunDir, **options: Any) -> StageResult:
    """Run one stage through the executor (its options: executor.execute's), able to run the others of the list,
    with its inputs wired (wire)."""
    wired, inputs = wire(stage, cfg)
    return executor.execute(wired, cfg, run, run_stage=run_stage, inputs=inputs, **options)


def wire(stage: Stage, cfg: Config) -> tuple[Stage, dict[str, str]]:
    """(the stage with its inputs wired, the folder of each input by its declared name). A stage earlier in STAGES
    that runs for cfg and `replaces` a folder the stage reads sends it to its own output instead: the Input then
    names that stage (its verb, its folder), and the fingerprint covers what that stage's covers (itself wired: its
    sections and extra values), so a changed filter invalidates what was made from its output, by key. Without such a stage the stage is returned as it is (every
    built-in stage: their fingerprints are unchanged)."""
    standing_in: dict[str, Stage] = {}
    for name, earlier in STAGES.items():
        if name == stage.name:
            break
        if earlier.replaces and earlier.in_run is not None and earlier.in_run(cfg):
            standing_in[earlier.replaces] = earlier
    via = {need.folder: standing_in[need.folder] for need in stage.inputs
           if isinstance(need.folder, str) and need.folder in standing_in}
    if not via:
        return stage, {}
    inputs = tuple(dataclasses.replace(need, folder=via[need.folder].output, verb=via[need.folder].name)
                   if need.folder in via else need for need in stage.inputs)
    producers = [wire(producer, cfg)[0] for producer in via.values()]  # each itself wired: a chain is covered whole
    own_extra = stage.extra

    def extra(cfg: Config, run: RunDir) -> dict:
        chained = {f"via {p.name}": p.extra(cfg, run) if p.extra else None for p in producers}
        return (own_extra(cfg, run) or {}) | chained if own_extra else chained

    # The producers' sections and extra values join the stage's: the refusal of an output made from another filter
    # then names the filter's changed key.
    sections = tuple(dict.fromkeys((*stage.sections, *(name for p in producers for name in p.sections))))
    wired = dataclasses.replace(stage, inputs=inputs, extra=extra, sections=sections)
    return wired, {folder: executor.resolve(producer.output, cfg) for folder, producer in via.items()}


def run_stage(name: str, cfg: Config, run: RunDir, **options: Any) -> StageResult:
    """One stage by name through the executor (the options of `execute`)."""
    return execute(STAGES[name], cfg, run, **options)


# --- entry points' helpers -----------------------------------------------------------------------------------
def pipeline(cfg: Config, first: str = "ingest", last: str = "report") -> tuple[str, ...]:
    """The stages from `first` to `last` that cfg runs: `mine` only when training uses mined negatives, `dedup`
    only when it is on."""
    chosen = STAGE_VERBS[STAGE_VERBS.index(first):STAGE_VERBS.index(last) + 1]
    return tuple(name for name in chosen if STAGES[name].in_run(cfg))


def open_run(run_dir: str, config_path: str | None, overrides: list[str]) -> tuple[Config, RunDir]:
    """(config, RunDir) of a command: an existing run starts from its own RUN/config.yaml, a new one from the
    default (or the config file); --set applies on top. Local paths come back absolute, so that nothing
    relative to this working directory reaches a Ray worker."""
    check_text("--run-dir", run_dir)  # a control character, an ambiguous URI: before any network request
    for text in overrides:
        config_mod.parse_override(text)
    with filesystem_errors(run_dir):  # the first contact with an object store names the --run-dir
        run = RunDir(run_dir)
        run_config = run.config_in_force()
    cfg = config_mod.load(config_path, overrides, run_config=run_config)
    check_model_code(cfg)  # a model folder's own code: refused here, not in every actor that loads it
    return cfg, run


def run_stages(cfg: Config, run: RunDir, verbs: tuple[str, ...], resume: bool = False, write_config: bool = True,
               cost_keys: dict[str, str] | None = None, replace: str = "", command: str = "") -> dict[str, StageResult]:
    """Run stages in order with the executor; returns {verb: StageResult}. `resume`: train only.

    cost_keys renames a verb's entry in report/costs.json (e.g. {"fit": "fit:k=100"} in a sweep);
    write_config writes RUN/config.yaml for a new run (see RunDir.config_in_force) or, replacing, once the first
    stage has run (a refused --replace leaves it as it was): an existing run's config is never rewritten otherwise;
    False keeps it as it is (experiments run variants).
    replace and command: see execute."""
    if "ingest" in verbs:  # before the run writes its config.yaml and locks inside the data folder
        refuse_run_dir_in_data(cfg.data, run.uri)
    if verbs:  # the first stage's inputs come from earlier commands: a missing one is said before Ray starts (~5 s)
        first, _ = wire(STAGES[verbs[0]], cfg)
        for need in first.inputs:
            run.require(executor.resolve(need.folder, cfg), need.verb, need.describe(cfg))
        if first.precheck:
            first.precheck(cfg, run, resume)
    session.init_ray(cfg.ray)
    session.check_run_dir_shared(run, cfg.ray.shared_run_dir)
    new_run = run.config_in_force() is None
    if write_config and new_run:
        run.write_config(cfg)
    results = {}
    for verb in verbs:
        print(f"== {verb} ==", flush=True)
        results[verb] = execute(STAGES[verb], cfg, run, resume=resume and verb == "train", replace=replace,
                                command=command, cost_key=(cost_keys or {}).get(verb))
        if write_config and replace and not new_run and len(results) == 1:  # not before: a refused replace
            run.write_config(cfg)  # left the run's config as it was (later commands without --set start from it)
    return results


def summary(cfg: Config, run: RunDir, results: dict[str, StageResult]) -> str:
    lines = ["", "== summary =="]
    if run.exists("pairs", "_DONE.json"):
        s = run.done_stats("pairs")
        manifest = manifest_path(cfg.cluster.k)
        shard_rows = read_manifest(run, manifest).stats if run.exists(manifest) else None
        lines.append(f"rows in {s['rows_in']}{more_pairs(s)} | quarantined {s['quarantine']} | held out {s['heldout']} | "
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


# --- the Architecture diagram (docs/stages.md) -----------------------------------------------------------------------
def _resources_text(stage: Stage) -> str:
    need = stage.resources
    if need is None:
        return "no actor pool"
    on_cpu = f"{need.cpus:g} CPU" if need.cpus is not None else "a CPU share"
    return f"{need.gpus:g} GPU, else {on_cpu}" if need.gpus else on_cpu


def architecture_diagram() -> str:
    """The stages of STAGES in order, each with the folders it reads and writes, what each actor of its pool asks
    for, and when it runs: docs/stages.md's Architecture section holds exactly this text (tests/test_docs.py)."""
    rows = []
    for stage in STAGES.values():
        reads = ", ".join(shown(need.folder) for need in stage.inputs) or (
            "data.path" if stage.sections == ("data",) else "the whole run")
        writes = ", ".join([shown(stage.output), *(shown(e.folder) for e in stage.extra_outputs)])
        when = stage.in_run.__doc__ if stage.in_run else f"run by {stage.run_by} when needed" if stage.name != "synth" \
            else "its own command, instead of ingest + embed"
        rows.append((stage.name, f"{reads} -> {writes}", f"[{_resources_text(stage)}; {when}]"))
    width = max(len(name) for name, _, _ in rows)
    lines = []
    for name, flow, notes in rows:
        lines += [f"{name:<{width}}  {flow}", f"{'':<{width}}    {notes}"]
    return "\n".join(lines)

"""Experiments over one config: `compare` (samplers x seeds on the same shards) and `sweep` (k x data size).

compare's clustered_dedup arm differs from clustered only by dedup: it trains on the shards of the pairs the dedup
stage keeps (train.dedup), made on demand beside the run's shards of every assigned pair.

compare: clusterscale compare [CONFIG] --run-dir R --samplers clustered,random --seeds 3
         -> train/compare-<arm>-seed<s>/, eval/compare-<arm>-seed<s>.json, report/compare.json, report/report.md
sweep:   clusterscale sweep [CONFIG] --run-dir R --k 10,100,1000 [--limit N1,N2] [--preprocess-only]
         -> one embedding pass per data size (R itself, or R/limit=<N>/ per size), fit/assign/[dedup/]shard per k,
            optionally train + evaluate per k (train/sweep-<sampler>-k<k>-seed<s>/); report/sweep.json, report.md
            With dedup on, dedup/ holds one clustering at a time: each k replaces the previous k's (its shards
            stay), so a rerun of a finished sweep deduplicates every k again (and reuses every k's shards).
Both run on the run directory of a finished `run` and reuse its outputs: arm names carry the experiment's
prefix, so they never replace the main run's train/<train.name>/. A compare arm whose seed the run already trained
with exactly the arm's config (e.g. compare's clustered arm, seed 0, on a `run`) reuses that training and its
evaluation instead of training the same model again under the arm's name; so does a sweep's point at the run's own k.
"""
from __future__ import annotations

import json
import time

import numpy as np

from clusterscale.config import Config, ConfigError, output_keys, parse_override, variant
from clusterscale.stages.costs import summarize
from clusterscale.stages.dedup import train_dedup_config
from clusterscale.stages.evaluate import evaluate_together
from clusterscale.stages.kmeans import ClusteringError
from clusterscale.io.layout import fit_stats_path, manifest_path, read_manifest, train_dir
from clusterscale.pipeline import PER_K_STAGES, PREPROCESS, STAGES, pipeline, run_stage, run_stages, wire
from clusterscale.redact import redact_uri
from clusterscale.io.rundir import DONE, RunDir, join_uri
from clusterscale.train.metrics import read_metrics
from clusterscale.arm_costs import arm_preprocess, gain_per_hour
from clusterscale.stages.train import check_student, stopped_attempt
from clusterscale.train.schedule_config import SAMPLERS

ARM_SAMPLERS = SAMPLERS  # an arm named after a registered sampler (train/samplers/) trains with it
MINED_SUFFIX = "+mined"  # `<sampler>+mined`: that sampler with one mined negative per query


def arm_name(experiment: str, arm: str, seed: int) -> str:
    """train.name of an experiment's arm: the prefix keeps it apart from the main run's own training."""
    return f"{experiment}-{arm}-seed{seed}"


def check_arm_names(cfg: Config, names: list[str]) -> None:
    if cfg.train_name() in names:
        raise ConfigError(f"train.name={cfg.train_name()!r} is also the name of an experiment arm, whose training "
                          f"would replace it: choose a train.name that does not start with 'compare-' or 'sweep-'.")


def parse_list(text: str, what: str, cast=str, example: str = "10,100") -> list:
    try:
        values = [cast(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(f"{what} must be a comma-separated list, got {text!r} ({exc}).") from exc
    if not values:
        raise ConfigError(f"{what} is empty: give a comma-separated list, e.g. {what} {example}.")
    twice = sorted({str(v) for v in values if values.count(v) > 1})
    if twice:  # `sweep --k 4,4` ran one point and reported two
        raise ConfigError(f"{what} lists {', '.join(twice)} more than once ({text!r}): give each value once.")
    return values


def paired_difference(values: list[float]) -> dict:
    """spread() of per-seed differences, plus the 95% Student-t interval of their mean (none for one seed)."""
    from scipy import stats

    out = spread(values)
    n = len(values)
    half = float(stats.t.ppf(0.975, n - 1) * out["std"] / np.sqrt(n)) if n > 1 else None
    return out | {"n": n, "wins": int(sum(v > 0 for v in values)),
                  "ci95": [out["mean"] - half, out["mean"] + half] if half is not None else None}


# (arm, baseline) pairs compared seed by seed when both arms ran: the method against the global shuffle, and
# against the control with the same cluster sizes but random membership.
PAIRED_BASELINES = ("random", "random_clusters")


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), min, max and the values themselves."""
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
            "min": float(arr.min()), "max": float(arr.max()), "values": [float(v) for v in arr]}


def _train(cfg: Config, run: RunDir, stage_options: dict) -> None:
    """Train one arm. An arm whose earlier attempt stopped midway with this very config (Ctrl-C, a lost node, a
    killed job: its checkpoints kept, no done marker) continues from its latest checkpoint on the same batches, so a
    study of hours runs in pieces; --replace trains it afresh."""
    stopped = None if stage_options.get("replace") else stopped_attempt(run, cfg.train_name())
    resume = stopped is not None and stopped == wire(STAGES["train"], cfg)[0].fingerprint_of(cfg, run)
    if resume:
        print(f"[{train_dir(cfg.train_name())}] an earlier attempt with this config stopped midway: continuing from "
              f"its latest checkpoint", flush=True)
    run_stages(cfg, run, ("train",), resume=resume, write_config=False, **stage_options)


def _evaluate(cfg: Config, run: RunDir, stage_options: dict) -> dict:
    """The frozen encoder's and cfg's trained model's results; inside evaluate_together (one encoder process for
    an experiment's arms), after every arm has trained."""
    name = cfg.train_name()
    results = run_stages(cfg, run, ("evaluate",), write_config=False, **stage_options,
                         cost_keys={"evaluate": f"evaluate:{name}"})
    return results["evaluate"].outputs["results"]


# --- compare ------------------------------------------------------------------------------------------
# Named arms beyond the samplers (issue: the seeds' other methods, side by side). Each is a set of train
# keys over the user's config; `--arm NAME:train.key=value,...` defines more.
ARMS: dict[str, dict] = {
    "mined": {"sampler": "random", "negatives_per_query": 1},              # ANCE-style: what clustering replaces
    "clustered_mined": {"sampler": "clustered", "negatives_per_query": 1},
    "clp": {"sampler": "clustered", "negatives_per_query": 1, "loss": "clp"},  # clustered + mined + CLP penalty
    "moe": {"sampler": "clustered", "moe_experts": 4, "moe_top_k": 2},
    "recluster": {"sampler": "clustered", "recluster_every": "half"},       # once, halfway
    "clustered_dedup": {"sampler": "clustered", "dedup": True},             # on the pairs dedup keeps
}


def parse_arm(text: str) -> tuple[str, dict]:
    """'NAME:train.key=value,train.key=value' -> (NAME, {key: value}) (train keys only)."""
    name, sep, body = text.partition(":")
    if not sep or not name or "/" in name:
        raise ConfigError(f"--arm expects NAME:train.key=value[,train.key=value...], got {text!r}.")
    keys = {}
    for item in body.split(","):
        try:
            section, key, value = parse_override(item)
        except ConfigError as exc:
            raise ConfigError(f"--arm {name}: {str(exc).replace('--set expects', 'each key expects')}") from None
        if section != "train":
            raise ConfigError(f"--arm {name}: only train.* keys may differ between arms (the shards are shared), "
                              f"got {section}.{key}.")
        if key in ("name", "seed"):  # compare sets both for every arm: the value was dropped without a word
            raise ConfigError(f"--arm {name}: train.{key} is compare's own (each arm's runs are named "
                              f"compare-<arm>-seed<s>, from train.seed and --seeds): leave it out of --arm.")
        keys[key] = value
    return name, keys


def arm_keys(name: str, cfg: Config, custom: dict[str, dict]) -> dict:
    """An arm's train keys: a custom arm's (--arm NAME:...) over those its name gives when it names an arm (e.g.
    --arm random+mined:train.negatives_curriculum_steps=200 is random+mined with the easy-first phase)."""
    if name in custom:
        try:
            named = _named_arm_keys(name, cfg)
        except ConfigError:  # a name of the user's own
            named = {}
        return named | dict(custom[name])
    return _named_arm_keys(name, cfg)


def _named_arm_keys(name: str, cfg: Config) -> dict:
    if name in ARM_SAMPLERS:
        return {"sampler": name}
    if name.endswith(MINED_SUFFIX) and name.removesuffix(MINED_SUFFIX) in ARM_SAMPLERS:
        return {"sampler": name.removesuffix(MINED_SUFFIX), "negatives_per_query": 1}
    if name not in ARMS:
        raise ConfigError(f"Unknown compare arm {name!r}: use a train.sampler value ({', '.join(ARM_SAMPLERS)}), "
                          f"one with mined negatives (e.g. clustered{MINED_SUFFIX}), a named arm ({', '.join(ARMS)}), "
                          f"or define it with --arm {name}:train.key=value,...")
    keys = dict(ARMS[name])
    if keys.get("recluster_every") == "half":
        if not cfg.train.schedule.steps or cfg.train.schedule.steps < 2:
            raise ConfigError("The recluster arm re-clusters halfway through train.steps: set train.steps (>= 2), or "
                              "define the arm yourself with --arm NAME:train.recluster_every=N.")
        keys["recluster_every"] = (cfg.train.schedule.steps + 1) // 2  # two segments, also for odd step counts
    return keys


def run_compare(cfg: Config, run: RunDir, samplers: list[str], seeds: int, custom_arms: dict[str, dict] | None = None,
                stage_options: dict | None = None, mteb: list[str] | None = None) -> dict:
    """Train every (arm, seed) on the same shards for the same steps; evaluate; mean and spread per arm.

    An arm is a sampler name, a named arm of ARMS, or a custom arm (custom_arms: name -> train keys).
    stage_options: keyword arguments of every run_stages call (replace, command). mteb: MTEB task specs every arm
    (and the frozen encoder) is also scored on, with the arms' spread and seed-paired differences per task."""
    if mteb:
        from clusterscale.stages.mteb_eval import resolve_tasks

        resolve_tasks(mteb)  # a bad task name fails before any training
    # Build (and so validate) every arm's config before any work: a typo fails in a second, not an hour.
    arms = compare_arms(cfg, samplers, seeds, custom_arms)
    seed_list = [a.train.schedule.seed for a in next(iter(arms.values()))]
    for name, arm_cfgs in arms.items():  # e.g. train.dedup with dedup applied to the shared shards: refused now
        if arm_cfgs[0].train.shards.dedup:
            train_dedup_config(arm_cfgs[0])
        arm_batch = arm_cfgs[0].train.schedule.global_batch_size
        if arm_batch != cfg.train.schedule.global_batch_size:  # refused by its training, after the arms before it
            raise ConfigError(f"--arm {name}: train.global_batch_size={arm_batch} differs from the run's "
                              f"{cfg.train.schedule.global_batch_size}, but it sets the shards' batches, which "
                              f"every arm shares: set it for the whole compare with --set instead.")
        check_student(arm_cfgs[0].train)  # its model folder, tokenizer, Matryoshka dimensions
    started = time.time()
    mining = [a[0] for a in arms.values() if a[0].train.objective.negatives_per_query]
    stage_options = stage_options or {}
    run_stages(cfg, run, pipeline(cfg, last=PREPROCESS[-1]), **stage_options)
    if mining:  # one mining pass serves every arm with mined negatives (same mine config); it writes the sidecars
        # of the clustered shards, and each arm's training those of its own shard set (random's, made on demand)
        run_stages(variant(mining[0], train={"sampler": "clustered"}), run, ("mine",), write_config=False,
                   **stage_options)
    metrics: dict[str, dict[str, list]] = {}
    frozen = None
    # Every arm trains, seed by seed (seed 0 of every arm before seed 1 of any: a compare run in pieces has the same
    # seeds of every arm done first), then every arm is evaluated by one encoder process.
    for i in range(len(seed_list)):
        for arm_cfgs in arms.values():
            arm_cfg = arm_cfgs[i] = _the_runs_own_when_same(cfg, run, arm_cfgs[i], stage_options)
            print(f"== compare: {arm_cfg.train_name()} ==", flush=True)
            _train(arm_cfg, run, stage_options)
    with evaluate_together():
        for sampler, arm_cfgs in arms.items():
            for arm_cfg in arm_cfgs:
                results = _evaluate(arm_cfg, run, stage_options)
                frozen = results["frozen"]["metrics"]
                metrics.setdefault(sampler, {})[arm_cfg.train_name()] = results[arm_cfg.train_name()]["metrics"]
    summary = summarize_compare(cfg, run, arms, metrics, frozen)
    if mteb:
        summary["mteb"] = compare_mteb(cfg, run, arms, mteb)
    summary["wall_s"] = round(time.time() - started, 1)
    run.write_json("report/compare.json", summary)
    run_stage("report", cfg, run)
    return summary


def compare_arms(cfg: Config, samplers: list[str], seeds: int, custom_arms: dict[str, dict] | None = None
                 ) -> dict[str, list[Config]]:
    """compare's arm configs: arm name -> one config per seed (train.seed, +1, ...), named compare-<arm>-seed<s>."""
    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {seeds}.")
    custom_arms = custom_arms or {}
    seed_list = [cfg.train.schedule.seed + i for i in range(seeds)]
    arms = {s: [variant(cfg, train=arm_keys(s, cfg, custom_arms) | {"seed": seed, "name": arm_name("compare", s, seed)})
                for seed in seed_list] for s in list(dict.fromkeys(samplers + list(custom_arms)))}
    check_arm_names(cfg, [a.train_name() for arm_cfgs in arms.values() for a in arm_cfgs])
    same: dict[str, str] = {}
    for name, arm_cfgs in arms.items():  # an arm of another's keys: one training reported twice
        keys = json.dumps({k: v for k, v in output_keys(arm_cfgs[0].train).items() if k != "name"}, sort_keys=True,
                          default=str)
        if keys in same:
            raise ConfigError(f"Arms {same[keys]} and {name} train the same config (the same train keys): give "
                              f"{name} keys of its own with --arm {name}:train.key=value, or leave it out.")
        same[keys] = name
    return arms


def _the_runs_own_when_same(cfg: Config, run: RunDir, arm_cfg: Config, stage_options: dict) -> Config:
    """arm_cfg, or the config of the run's own finished training of the same model: train/<train.name>/ or
    train/<sampler>-seed<seed>/ whose done marker has the arm's train fingerprint under that name (every train key,
    the shards and the mined negatives equal). Training it again under compare's name would only cost time; with
    --replace the arm trains anew, as asked."""
    if stage_options.get("replace"):
        return arm_cfg
    for name in dict.fromkeys((cfg.train.schedule.name, "")):
        own = variant(arm_cfg, train={"name": name})
        folder = train_dir(own.train_name())
        trained_with = wire(STAGES["train"], own)[0].fingerprint_of(own, run)
        if run.exists(folder, DONE) and run.done_marker(folder).fingerprint == trained_with:
            print(f"[{folder}] the run's own training is this arm's seed {own.train.schedule.seed}: reused",
                  flush=True)
            return own
    return arm_cfg


def summarize_compare(cfg: Config, run: RunDir, arms: dict[str, list[Config]], metrics: dict, frozen: dict) -> dict:
    dedup_arms = [name for name, arm_cfgs in arms.items() if arm_cfgs[0].train.shards.dedup]
    dedup_note = (f" ({', '.join(dedup_arms)}: on the shards of the pairs dedup keeps, "
                  f"{_dedup_text(train_dedup_config(arms[dedup_arms[0]][0]))})" if dedup_arms else "")
    batches = cfg.train.schedule
    out = {"description": (f"{len(next(iter(arms.values())))} seed(s) per arm, every arm {batches.steps or 'full-epoch'} "
                           f"steps x {batches.global_batch_size} pairs on the same shards (k={cfg.cluster.k})"
                           f"{dedup_note}, evaluated on the same held-out set; std is the sample standard deviation "
                           f"over seeds."),
           "k": cfg.cluster.k, "steps": batches.steps, "global_batch_size": batches.global_batch_size,
           "frozen": frozen, "arms": {}}
    for sampler, arm_cfgs in arms.items():
        names = [a.train_name() for a in arm_cfgs]
        per_seed = [metrics[sampler][n] for n in names]
        records = [read_metrics(run, n) for n in names]
        arm = {"seeds": [a.train.schedule.seed for a in arm_cfgs], "runs": names,
               "metrics": {key: spread([m[key] for m in per_seed]) for key in per_seed[0]},
               "final_loss_mean": float(np.mean([np.mean([r["loss"] for r in recs[-10:]]) for recs in records if recs]))
               if any(records) else None,
               **_per_step_means(records),
               "train_worker_s": float(sum(run.done_stats(train_dir(n)).get("worker_s", 0) for n in names)),
               "train_keys": _differing_train_keys(cfg, arm_cfgs[0])}
        out["arms"][sampler] = arm
    costs = run.read_json("report/costs.json") if run.exists("report/costs.json") else {}
    add_costs(out, arms, costs)
    out["preprocess_worker_s"] = {stage: costs[stage].get("worker_s", costs[stage].get("wall_s"))
                                  for stage in (*PREPROCESS, "mine") if stage in costs}
    out["per_k_stages"] = list(PER_K_STAGES)
    for baseline in (b for b in PAIRED_BASELINES if b in arms):
        for sampler, arm_cfgs in arms.items():
            if sampler in PAIRED_BASELINES[:PAIRED_BASELINES.index(baseline) + 1]:
                continue
            out.setdefault("paired", {})[f"{sampler} - {baseline}"] = {
                key: paired_difference(_seed_differences(metrics, sampler, arm_cfgs, baseline, arms[baseline], key))
                for key in ("ndcg_at_10", "mrr_at_10")}
    for name, arm in out["arms"].items():
        arm["gain_per_preprocess_hour"] = gain_per_hour(out.get("paired", {}).get(f"{name} - random"),
                                                        arm["preprocess"]["extra"]["worker_s"])
    if "random" in arms:  # kept for readers of earlier compare.json files
        out["paired_vs_random"] = {name.split(" - ")[0]: d["ndcg_at_10"] for name, d in out.get("paired", {}).items()
                                   if name.endswith(" - random")}
    return out


def compare_mteb(cfg: Config, run: RunDir, arms: dict[str, list[Config]], specs: list[str]) -> dict:
    """Every arm's seeds and the frozen encoder on the MTEB tasks: per task the frozen score, each arm's spread over
    seeds, and each arm's seed-paired difference to the baselines (as for held-out NDCG), on every kept score."""
    from clusterscale.stages.mteb_eval import mteb_models

    names = ["frozen"] + [a.train_name() for arm_cfgs in arms.values() for a in arm_cfgs]
    scores = {n: r["tasks"] for n, r in mteb_models(cfg, run, names, specs).items()}
    tasks = list(scores["frozen"])
    keys = {t: [k for k, v in scores["frozen"][t].items() if isinstance(v, float)] for t in tasks}
    out = {"tasks": tasks, "frozen": scores["frozen"], "arms": {}, "paired": {}}
    for arm, arm_cfgs in arms.items():
        out["arms"][arm] = {t: {k: spread([scores[a.train_name()][t][k] for a in arm_cfgs]) for k in keys[t]}
                            for t in tasks}
    for baseline in (b for b in PAIRED_BASELINES if b in arms):
        base = {a.train.schedule.seed: scores[a.train_name()] for a in arms[baseline]}
        for arm, arm_cfgs in arms.items():
            if arm in PAIRED_BASELINES[:PAIRED_BASELINES.index(baseline) + 1]:
                continue
            out["paired"][f"{arm} - {baseline}"] = {
                t: {k: paired_difference([scores[a.train_name()][t][k] - base[a.train.schedule.seed][t][k]
                                          for a in arm_cfgs]) for k in keys[t]} for t in tasks}
    return out


def add_costs(out: dict, arms: dict[str, list[Config]], costs: dict) -> None:
    """Per arm: the preprocessing it needs (arm_costs.arm_stages; `extra`: beyond random's) and its training's wall
    and worker-seconds per seed; the preprocessing of the whole compare, each stage counted once."""
    per_arm, out["preprocess_total"] = arm_preprocess(arms, costs)
    for name, arm_cfgs in arms.items():
        records = [costs.get(f"train:{a.train_name()}", {}) for a in arm_cfgs]
        out["arms"][name]["preprocess"] = per_arm[name]
        out["arms"][name]["train"] = {
            "wall_s_per_seed": float(np.mean([r.get("wall_s", 0.0) for r in records])),
            "worker_s_per_seed": float(np.mean([r.get("worker_s", 0.0) for r in records])),
            "device": records[0].get("device", "cpu")}


def _per_step_means(records: list[list[dict]]) -> dict:
    """In-batch negative hardness (mean and max cosine to a negative) and masked false negatives (in-batch
    duplicates of a query's passage or query), each averaged over every step of every seed."""
    steps = [r for recs in records for r in recs]
    return {key: float(np.mean([r[key] for r in steps])) if steps else None
            for key in ("neg_cos_mean", "neg_cos_max", "masked_false_negatives")}


def _dedup_text(cfg: Config) -> str:
    dc = cfg.dedup
    return f"dedup.exact={dc.exact}, key={dc.key}, semantic_threshold={dc.semantic_threshold}, keep={dc.keep}"


def _seed_differences(metrics: dict, arm: str, arm_cfgs: list[Config], baseline: str, baseline_cfgs: list[Config],
                      key: str) -> list[float]:
    base = {a.train.schedule.seed: metrics[baseline][a.train_name()][key] for a in baseline_cfgs}
    return [metrics[arm][a.train_name()][key] - base[a.train.schedule.seed] for a in arm_cfgs]


def _differing_train_keys(base: Config, arm: Config) -> dict:
    ignore = {"seed", "name"}
    base_train = base.train.to_dict()
    return {k: v for k, v in arm.train.to_dict().items() if k not in ignore and base_train[k] != v}


# --- sweep --------------------------------------------------------------------------------------------
def sweep_line(sweep: dict, run: RunDir) -> str:
    """The line the CLI and the sweep job print at the end of a sweep."""
    return f"sweep: {len(sweep['points'])} points; table in {redact_uri(run.path('report/report.md'))}"


def sweep_point(run: RunDir, costs: dict, k: int, rows: int) -> dict:
    """One row of the sweep table from the shard manifest and the recorded stage costs of this k."""
    manifest = read_manifest(run, manifest_path(k))
    sizes = np.array([c.rows for c in manifest.clusters], dtype=float)
    intra = [(c.mean_intra_cosine, c.rows) for c in manifest.clusters if c.mean_intra_cosine is not None]
    fit = run.read_json(fit_stats_path(k))
    return {"rows": rows, "k": k, "shards": len(sizes), "min_rows": int(sizes.min()), "max_rows": int(sizes.max()),
            "size_cv": float(sizes.std() / sizes.mean()), "imbalance_factor": fit.get("imbalance_factor"),
            "mean_intra_cosine": float(sum(c * n for c, n in intra) / sum(n for _, n in intra)) if intra else None,
            "min_intra_cosine": min(c for c, _ in intra) if intra else None,
            "max_intra_cosine": max(c for c, _ in intra) if intra else None,
            "overall_mean_cosine": manifest.stats["overall_mean_cosine"],
            **{f"{stage}_s": costs.get(f"{stage}:k={k}", {}).get("wall_s", 0.0) for stage in PER_K_STAGES},
            "embed_s": costs.get("embed", {}).get("wall_s", 0.0)}


def run_sweep(cfg: Config, run_dir: str, ks: list[int], limits: list[int] | None, preprocess_only: bool,
              stage_options: dict | None = None) -> dict:
    """Embed once per data size, then fit/assign/[dedup/]shard (and optionally train + evaluate) at every k (dedup
    runs at every k, also on a rerun: dedup/ holds one clustering at a time).

    stage_options: keyword arguments of every run_stages call (replace, command), as for compare."""
    stage_options = stage_options or {}
    if any(k < 1 for k in ks) or any(n < 1 for n in limits or []):
        raise ConfigError(f"--k and --limit values must be positive, got k={ks} limit={limits}.")
    report_k = cfg.cluster.k if cfg.cluster.k in ks else ks[0]
    batches = cfg.train.schedule  # every data size's base config has the same
    check_arm_names(cfg, [arm_name("sweep", f"{batches.sampler}-k{k}", batches.seed) for k in ks])
    sizes = [(n, RunDir(join_uri(run_dir, f"limit={n}"))) for n in limits] if limits \
        else [(cfg.data.limit, RunDir(run_dir))]
    points, cost_points = [], []
    trained: dict[str, Config] = {}  # per run: the config of report_k's training (the run's own when the same)
    for limit, run in sizes:
        base = variant(cfg, data={"limit": limit})
        # Writes config.yaml of a new run; an existing run's stays.
        run_stages(base, run, pipeline(base, last="embed"), **stage_options)
        rows = run.done_stats("embeddings")["rows"]
        rows_in = run.done_stats("pairs").get("rows_in", 0)
        if limits and rows_in < limit:  # a size that is the whole data (larger limits repeat it)
            print(f"[sweep] --limit {limit}: the data holds {rows_in} pairs, fewer than the limit: this size is the "
                  f"whole data ({rows} training pairs)", flush=True)
        trained_points: list[tuple[dict, Config]] = []  # evaluated once every k of this size has trained
        for k in ks:
            kcfg = variant(base, cluster={"k": k}, train={"name": arm_name("sweep", f"{batches.sampler}-k{k}",
                                                                          batches.seed)})
            print(f"== sweep: N={rows} k={k} ==", flush=True)
            per_k = tuple(s for s in PER_K_STAGES if s in pipeline(kcfg))  # dedup (this k's, into dedup/) when on
            try:
                run_stages(kcfg, run, per_k, write_config=False, **stage_options,
                           cost_keys={s: f"{s}:k={k}" for s in PER_K_STAGES})
            except (ClusteringError, ValueError) as exc:  # e.g. k larger than the data: a row, not a crash
                points.append({"rows": rows, "k": k, "error": str(exc)})
                continue
            costs = run.read_json("report/costs.json")
            point = sweep_point(run, costs, k, rows)
            if not preprocess_only:
                # At the run's own k, with its train config, that is the run's own training: reused, as compare does.
                kcfg = _the_runs_own_when_same(base, run, kcfg, stage_options)
                if k == report_k:
                    trained[run.uri] = kcfg
                _train(kcfg, run, stage_options)
                trained_points.append((point, kcfg))
            points.append(point)
        with evaluate_together():  # every k's model of this data size, by one encoder process
            for point, kcfg in trained_points:
                results = _evaluate(kcfg, run, stage_options)
                point["ndcg_at_10"] = results[kcfg.train_name()]["metrics"]["ndcg_at_10"]
                point["frozen_ndcg_at_10"] = results["frozen"]["metrics"]["ndcg_at_10"]
                point["train_worker_s"] = run.done_stats(train_dir(kcfg.train_name())).get("worker_s")
                point["run"] = kcfg.train_name()
        report_cfg = trained.get(run.uri) or variant(base, cluster={"k": report_k}, train={
            "name": arm_name("sweep", f"{batches.sampler}-k{report_k}", batches.seed)})
        costs = run.read_json("report/costs.json")
        cost_points.append(summarize(report_cfg, run, costs, train_names=None if preprocess_only
                                     else [report_cfg.train_name()]) | {"limit": limit, "run": run.uri})
    sweep = {"description": (f"k in {ks}, data sizes {[p['rows'] for p in cost_points]} pairs "
                             f"({'preprocessing only' if preprocess_only else f'trained {batches.steps} steps per k'}); "
                             f"one embedding pass per data size. Stage seconds are wall-clock."),
             "ks": ks, "limits": [n for n, _ in sizes], "preprocess_only": preprocess_only,
             "points": points, "cost_points": cost_points}
    top = RunDir(run_dir)
    top.write_json("report/sweep.json", sweep)
    for limit, run in sizes:
        # Each run's report extrapolates from its own costs plus the other sizes' measured points.
        run.write_json("report/cost_points.json", [p for p in cost_points if p["run"] != run.uri])
        if run.uri != top.uri:
            run.write_json("report/sweep.json", sweep)
        run_stage("report", trained.get(run.uri) or variant(cfg, data={"limit": limit}, cluster={"k": report_k}, train={
            "name": arm_name("sweep", f"{cfg.train.schedule.sampler}-k{report_k}", cfg.train.schedule.seed)}), run)
    if limits:  # the table of every size, where the last line points (one --limit too)
        run_stage("report", variant(cfg, cluster={"k": report_k}), top)
    return sweep

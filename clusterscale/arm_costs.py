"""What each compare arm costs besides its training: the preprocessing stages it needs, from the run's own cost
records (report/costs.json), and its gain over random per extra preprocessing hour.

An arm needs the stages its method needs, not those this run happened to go through (every shard set here is
written from the clustered shards, but a user's random baseline only shuffles); its sampler declares them
(train/samplers/: needs_clustering, sets). The built-ins:
  random           ingest, the global shuffle (shard:random)
  random_clusters  ingest, embed, fit, assign, shard, its set (shard:random_clusters)
  source           ingest, its set (shard:source)
  clustered        ingest, embed, fit, assign, shard (dedup and its set with train.dedup)
  curriculum       the clustered arm's stages and the random shuffle
  ... + mined      and embed, fit, assign, shard (mining searches each query's nearest clusters), mine (whose
                   record includes the re-embedding when mine.encoder is not the frozen one)
A stage several arms need ran once for all of them: each arm's figures count it, the compare total counts it once.
"""
from __future__ import annotations

from clusterscale import pipeline
from clusterscale.config import Config, variant
from clusterscale.stages.dedup import dedup_applied
from clusterscale.train.samplers import CLUSTERED, sampler as get_sampler
from clusterscale.train.schedule_config import SAMPLERS

CLUSTERING = ("embed", "fit", "assign", "shard")
HOUR_S = 3600.0


def stage_order() -> tuple[str, ...]:
    """Every preprocessing cost key in pipeline order (pipeline.STAGES' preprocessing stages, a registered one
    included), the shard sets of every registered sampler after shard, then mining's."""
    sets = [f"shard:{name}" for name in SAMPLERS if get_sampler(name).writes_set()]
    shared = [name for name, stage in pipeline.STAGES.items() if stage.shared and name != "embed_heldout"]
    at = shared.index("shard") + 1 if "shard" in shared else len(shared)
    return (*shared[:at], "shard:dedup", *sets, *shared[at:], "mine")


def pairs_stages() -> set[str]:
    """The registered stages that stand in for pairs/ (Stage.replaces="pairs", e.g. a filter after ingest): every
    arm trains on their output, so every arm needs them."""
    return {name for name, stage in pipeline.STAGES.items() if stage.replaces == "pairs"}


def arm_stages(cfg: Config) -> list[str]:
    """The cost keys (report/costs.json) of the preprocessing an arm's config needs, in pipeline order: its
    sampler's (train/samplers: the clustering when it needs_clustering, each set it reads besides the clustered
    shards), then dedup's and mining's."""
    tc, sampler = cfg.train, get_sampler(cfg.train.schedule.sampler)
    needs = {"ingest", *pairs_stages()} | {f"shard:{name}" for name in sampler.sets if name != CLUSTERED}
    if sampler.needs_clustering:
        needs |= set(CLUSTERING)
    if tc.shards.dedup:
        needs |= {"dedup", "shard:dedup"}
    if tc.objective.negatives_per_query:
        needs |= set(CLUSTERING) | {"mine"}
    if "shard" in needs and dedup_applied(cfg):  # dedup.apply_to_shards: the clustered shards come after it
        needs.add("dedup")
    return [s for s in stage_order() if s in needs]


def stage_costs(keys: list[str], costs: dict) -> dict:
    """Wall seconds and CPU / GPU worker-seconds of these stages (each once), and the stages with no record."""
    out = {"stages": keys, "wall_s": 0.0, "cpu_s": 0.0, "gpu_s": 0.0, "unrecorded": []}
    for key in keys:
        record = _record(key, costs)
        if record is None:
            out["unrecorded"].append(key)
            continue
        out["wall_s"] += float(record.get("wall_s", 0.0))
        device = "gpu_s" if record.get("device") == "gpu" else "cpu_s"
        out[device] += float(record.get("worker_s", record.get("wall_s", 0.0)))
    out["worker_s"] = out["cpu_s"] + out["gpu_s"]
    return out


def _record(key: str, costs: dict) -> dict | None:
    if key in costs:
        return costs[key]
    if key == "shard:dedup":  # the dedup arm's set is written by the dedup_shards stage
        return costs.get("dedup_shards")
    return None


def arm_preprocess(arms: dict[str, list[Config]], costs: dict) -> tuple[dict[str, dict], dict]:
    """({arm: its stages' costs, plus `extra`: those of the stages random does not need}, every stage any arm
    needs, counted once)."""
    needed = {name: arm_stages(cfgs[0]) for name, cfgs in arms.items()}
    baseline = set(arm_stages(_random_of(next(iter(arms.values()))[0])))
    per_arm = {name: stage_costs(keys, costs) | {"extra": stage_costs([k for k in keys if k not in baseline], costs)}
               for name, keys in needed.items()}
    union = [s for s in stage_order() if any(s in keys for keys in needed.values())]
    return per_arm, stage_costs(union, costs)


def _random_of(cfg: Config) -> Config:
    return variant(cfg, train={"sampler": "random", "negatives_per_query": 0, "dedup": False, "loss": "infonce",
                               "recluster_every": 0})


def gain_per_hour(paired: dict | None, extra_worker_s: float) -> dict | None:
    """The seed-paired mean gain over random (NDCG@10, MRR@10) per extra preprocessing worker-hour; None when the
    arm needs no extra preprocessing (or was not paired)."""
    if not paired or extra_worker_s <= 0:
        return None
    return {key: d["mean"] / (extra_worker_s / HOUR_S) for key, d in paired.items()}

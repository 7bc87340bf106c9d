"""The dedup policy: which folder the shards read (dedup/kept/ when dedup is applied to them), the config a
train.dedup=true run deduplicates with, and the refusal to run with dedup off."""
from __future__ import annotations

from clusterscale.config import Config, variant
from clusterscale.errors import UserError
from clusterscale.io.layout import DEDUP_KEPT, assign_dir

# What train.dedup=true deduplicates with when the run's dedup is off (compare's clustered_dedup arm): exact
# duplicates of the pair text, and pairs whose vectors have cosine >= 0.95 within a cluster.
TRAIN_DEDUP_DEFAULTS = {"exact": True, "key": "pair", "semantic_threshold": 0.95}


def shard_input(cfg: Config) -> str:
    """The folder the shard stage reads (its done marker counts its rows): dedup/kept/ when dedup is on and
    applied to the shards, else assign/k=<k>/."""
    return DEDUP_KEPT if dedup_applied(cfg) else assign_dir(cfg.cluster.k)


def dedup_applied(cfg: Config) -> bool:
    """Whether the run's shards are built from the kept rows (dedup on and dedup.apply_to_shards)."""
    return cfg.dedup.enabled and cfg.dedup.apply_to_shards


def train_dedup_config(cfg: Config) -> Config:
    """The config whose dedup stage a train.dedup=true run trains after: the run's own dedup.* when on, else
    TRAIN_DEDUP_DEFAULTS. Refused when the run's shards are deduplicated already (the set would equal them)."""
    if dedup_applied(cfg):
        raise UserError("train.dedup=true trains on a deduplicated shard set beside the run's shards, but dedup is on "
                        "and applied to the run's shards (dedup.apply_to_shards=true), so they hold only the kept "
                        "pairs already. To compare with and without dedup in one run (compare's clustered_dedup "
                        "arm), set dedup.apply_to_shards=false: the run's shards then hold every assigned pair; or "
                        "set train.dedup=false.")
    return cfg if cfg.dedup.enabled else variant(cfg, dedup=TRAIN_DEDUP_DEFAULTS)


def check_config(cfg: Config) -> None:
    """Refuse to run with dedup off (nothing to do)."""
    if not cfg.dedup.enabled:
        raise UserError("Dedup is off: set dedup.exact=true and/or dedup.semantic_threshold (a cosine in (0, 1]), "
                        "e.g. `clusterscale dedup --run-dir R --set dedup.exact=true`.")

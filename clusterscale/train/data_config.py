"""Which shards training reads, in the train section: re-clustered segments or the deduplicated set (config only,
torch-free; the reader is train/data.py, re-clustering train/recluster.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clusterscale.knobs import Section, knob, zero_means


@dataclass
class ShardSourceConfig(Section):
    """The shards training reads: re-clustering with the model being trained, or dedup's kept pairs."""
    section: ClassVar[str] = "train"

    recluster_every: int = knob(0, "Re-cluster every N steps: export the current model, re-embed every training "
                                   "pair with it, re-fit k-means, re-shard, and continue on the new shards "
                                   "(train.sampler=clustered only). 0 = never (the paper's method).",
                                bounds=zero_means("off"))

    dedup: bool = knob(False, "Train the clustered sampler on the pairs the dedup stage keeps: a shard set "
                              "(shards/k=<k>/dedup/) written from dedup/kept/, both made on demand, with the "
                              "run's dedup.* when dedup is on (then dedup.apply_to_shards must be false), else with "
                              "exact=true, key=pair, semantic_threshold=0.95. compare's clustered_dedup arm.")

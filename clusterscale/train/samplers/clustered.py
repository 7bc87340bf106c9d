"""clustered: every global batch from one cluster shard (the method). The default batches of samplers/__init__."""
from __future__ import annotations

from clusterscale.train.samplers import CLUSTERED, Sampler
from clusterscale.train.schedule_config import SAMPLERS


@SAMPLERS.register
class Clustered(Sampler):
    name = CLUSTERED
    doc = "every global batch from one cluster shard (the method)"
    sets = (CLUSTERED,)

"""The train section: its keys stay flat under `train:` in YAML, and each belongs to the component that uses it
(the key -> component map is ComposedSection.knobs). Each component's config lives next to its code."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from clusterscale.knobs import ComposedSection, ConfigError
from clusterscale.modeling.moe_config import MoeConfig
from clusterscale.modeling.student_config import StudentConfig
from clusterscale.train.checkpoint_config import CheckpointConfig
from clusterscale.train.data_config import ShardSourceConfig
from clusterscale.train.loss_config import LossConfig
from clusterscale.train.metrics_config import LoggingConfig
from clusterscale.train.optim_config import OptimizerConfig
from clusterscale.train.schedule_config import ScheduleConfig
from clusterscale.train.trainer_config import ComputeConfig


@dataclass
class TrainConfig(ComposedSection):
    """The train section, composed of its components; the order of the fields is the order of the keys in
    `clusterscale config` and RUN/config.yaml."""
    section: ClassVar[str] = "train"

    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    objective: LossConfig = field(default_factory=LossConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    shards: ShardSourceConfig = field(default_factory=ShardSourceConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def check_rules(self) -> None:
        """Each component's own rules, then those between components."""
        super().check_rules()
        for check in (self._check_recluster, self._check_dedup, self._check_workers):
            check()

    def _check_recluster(self) -> None:
        every, sampler = self.shards.recluster_every, self.schedule.sampler
        if every and sampler != "clustered":
            raise ConfigError(f"{self.key('recluster_every')} needs {self.key('sampler')}=clustered (got "
                              f"{sampler!r}): the other samplers do not use the clusters.")

    def _check_dedup(self) -> None:
        if not self.shards.dedup:
            return
        for key, owner, wrong in (("sampler", self.schedule, self.schedule.sampler != "clustered"),
                                  ("negatives_per_query", self.objective, self.objective.negatives_per_query),
                                  ("recluster_every", self.shards, self.shards.recluster_every)):
            if wrong:
                raise ConfigError(f"{self.key('dedup')}=true trains the clustered sampler on one deduplicated shard "
                                  f"set, without mined negatives or re-clustering (they align to the run's own "
                                  f"shards); got {self.key(key)}={getattr(owner, key)!r}.")

    def _check_workers(self) -> None:
        batch, workers = self.schedule.global_batch_size, self.compute.num_workers
        if batch % workers:
            raise ConfigError(f"{self.key('global_batch_size')} ({batch}) must be divisible by "
                              f"{self.key('num_workers')} ({workers}): every rank takes an equal slice.")

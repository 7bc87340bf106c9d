"""The batch schedule's keys of the train section: the run's name, the sampler, the batch size and the run's length
(config only, torch-free; the schedule is train/schedule.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clusterscale.errors import bounded_repr
from clusterscale.knobs import POSITIVE, ConfigError, Section, knob


@dataclass
class ScheduleConfig(Section):
    """The run's name and its batches: the sampler, their size and the length of the run."""
    section: ClassVar[str] = "train"

    name: str = knob("", "Run name under train/<name>/; '' = '<sampler>-seed<seed>'.")
    sampler: str = knob("clustered", "Batch sampler: 'clustered' draws every global batch from one "
                                     "cluster; 'random' is the global-shuffle baseline; 'random_clusters' is "
                                     "the control (a fixed random partition with the clusters' sizes); "
                                     "'source' draws every global batch from one value of the `source` column.",
                        ("clustered", "random", "random_clusters", "source"))
    cluster_weighting: str = knob("proportional", "How often each cluster is drawn: 'proportional' = every "
                                                  "full batch once per epoch; 'uniform' = clusters drawn equally "
                                                  "often (small ones repeat, large ones are subsampled).",
                                  ("proportional", "uniform"))
    global_batch_size: int = knob(64, "Pairs per optimizer step across all workers (paper: 4096).", bounds=POSITIVE)
    steps: int | None = knob(None, "Stop after this many steps; null = run `epochs` full epochs.", bounds=POSITIVE)
    epochs: int = knob(1, "Epochs over the shards (paper: 3).", bounds=POSITIVE)
    seed: int = knob(0, "Seed of the batch schedule and of from-scratch weights.")

    def check_rules(self) -> None:
        if self.name and ("/" in self.name or self.name.startswith(".")):
            raise ConfigError(f"{self.key('name')} must be a plain folder name, got {bounded_repr(self.name)}.")

"""The batch schedule's keys of the train section: the run's name, the sampler, the batch size and the run's length
(config only, torch-free; the schedule is train/schedule.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clusterscale.errors import bounded_repr
from clusterscale.knobs import NON_NEGATIVE, POSITIVE, Bounds, ConfigError, Registry, Section, knob, zero_means

# train.sampler's choices: the classes that clusterscale/train/samplers/'s modules register (a new one is a module there).
SAMPLERS = Registry("train.sampler", "clusterscale.train.samplers",
                    first=("clustered", "random", "random_clusters", "source", "curriculum"))
MAX_GLOBAL_BATCH = 1 << 20  # 1,048,576 pairs: far past any contrastive recipe (CLIP: 32k), and plan's loops stay short


FROZEN = "frozen"  # the frozen encoder's name in eval/ and the report (no training may take it)


@dataclass
class ScheduleConfig(Section):
    """The run's name and its batches: the sampler, their size and the length of the run."""
    section: ClassVar[str] = "train"

    name: str = knob("", "Run name under train/<name>/; '' = '<sampler>-seed<seed>'.")
    sampler: str = knob("clustered", "Batch sampler: how each global batch is drawn ('clustered': every global batch "
                                     "from one cluster, the method; 'random': the global-shuffle baseline; the "
                                     "others below). A new sampler is a module in clusterscale/train/samplers/ "
                                     "(docs/extending.md).", SAMPLERS)
    cluster_weighting: str = knob("proportional", "How often each cluster is drawn: 'proportional' = every "
                                                  "full batch once per epoch; 'uniform' = clusters drawn equally "
                                                  "often (small ones repeat, large ones are subsampled).",
                                  ("proportional", "uniform"))
    global_batch_size: int = knob(64, "Pairs per optimizer step across all workers (paper: 4096).",
                                  bounds=Bounds(low=1, high=MAX_GLOBAL_BATCH + 1, note="at most 2^20 pairs"))
    steps: int | None = knob(None, "Stop after this many steps; null = run `epochs` full epochs.", bounds=POSITIVE)
    epochs: int = knob(1, "Epochs over the shards (paper: 3).", bounds=POSITIVE)
    seed: int = knob(0, "Seed of the batch schedule and of from-scratch weights.", bounds=NON_NEGATIVE)
    curriculum_start: float = knob(0.0, "train.sampler=curriculum: the probability that the first global batch "
                                        "comes from one cluster (else from the random shuffle), in [0, 1].",
                                   added=True)
    curriculum_end: float = knob(0.5, "train.sampler=curriculum: the probability at the end of the ramp and after "
                                      "it, in [0, 1]; 0.5 = the 50/50 mix of easy and hard batches of the easy-first "
                                      "recipe.", added=True)
    curriculum_steps: int = knob(0, "train.sampler=curriculum: steps over which the probability rises linearly from "
                                    "curriculum_start to curriculum_end; 0 = the whole run.",
                                 bounds=zero_means("the whole run"), added=True)

    def check_rules(self) -> None:
        if self.name and ("/" in self.name or self.name.startswith(".")):
            raise ConfigError(f"{self.key('name')} must be a plain folder name, got {bounded_repr(self.name)}.")
        if self.name == FROZEN:  # eval/frozen.json is the frozen encoder's: a model of that name overwrote it
            raise ConfigError(f"{self.key('name')}={FROZEN} is the name of the frozen encoder's evaluation "
                              f"(eval/{FROZEN}.json): choose another name.")
        for name in ("curriculum_start", "curriculum_end"):  # probabilities: both ends allowed
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{self.key(name)} is the probability of a batch from one cluster: it must be in "
                                  f"[0, 1], got {getattr(self, name)}.")

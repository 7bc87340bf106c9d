"""Batch samplers (`train.sampler`): from which shard sets each global batch is drawn, and how.

A sampler is a class registered in SAMPLERS (train/schedule_config.py) by a module of this package: looking a
sampler up imports every module here, so a new sampler is one module (its class and `@SAMPLERS.register`) and its
test; the config's choices, the CLI's compare arms, the train stage, the cost report and `plan` follow from it.
docs/extending.md works one through. A sampler declares:

  name, doc          the train.sampler value and what it does
  sets               the shard sets it reads, their strata stacked in this order (a GlobalBatch's `shard` indexes
                     them): CLUSTERED = the clustered shards (shards/k=<k>/), or the name of a sampler that writes
                     its own set (shards/k=<k>/<name>/, from the clustered shards by its set_strata, once per
                     clustering, reused by every training of that clustering)
  set_strata         a sampler whose own name is in `sets`: which stratum and sub-group each row goes to
  batches            the global batches, a pure function of the seed, the step and the sets' strata sizes: every
                     rank computes the same ones, and a resumed run continues them (the default: one stratum per
                     batch, every full batch of every stratum once per epoch in a seeded order, train/schedule.py)
  cursor_keys        the train.* keys that decide which batches come: a resume refuses a checkpoint made with others
  needs_clustering   whether training with it needs embed, fit, assign and shard (arm_costs: the arm's cost)
  global_shuffle     its set is one stratum of every row taken in a shuffled order (random): batches are labelled
                     `random`, cluster weighting does not apply, and `plan` counts one stratum
The last set's strata count an epoch (the curriculum's: the random shuffle's), and its sampler's rules count the pairs
an epoch leaves out (epoch_sampler).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Sequence

import numpy as np

from clusterscale.io.layout import DEDUP_SET
from clusterscale.io.records import ShardManifest
from clusterscale.train import schedule
from clusterscale.train.schedule import GlobalBatch
from clusterscale.train.schedule_config import SAMPLERS, ScheduleConfig

CLUSTERED = "clustered"  # the clustered shards, shards/k=<k>/: every set is written from them


@dataclass(frozen=True)
class SetShapes:
    """What a sampler draws from: each of its sets' rows per stratum and Parquet row-group size (a global batch is
    whole row groups), in the order of `sets`."""
    sizes: tuple[tuple[int, ...], ...]
    block_rows: tuple[int, ...]

    @classmethod
    def of(cls, manifests: Sequence[ShardManifest]) -> SetShapes:
        return cls(tuple(tuple(m.strata_sizes) for m in manifests), tuple(int(m.row_group_rows) for m in manifests))


@dataclass(frozen=True)
class SetStrata:
    """A sampler's own set: `keys(table, positions)` gives each row's (stratum, sub-group) (positions: the rows'
    places in the clustered shards, concatenated in manifest order); it runs in Ray tasks, so it must pickle.
    sizes: rows per stratum; names: each stratum's name; group_rows: rows per sub-group (a stratum is written as
    ceil(size / group_rows) groups of files, as the clustered shards split a large cluster)."""
    keys: Callable[[Any, np.ndarray], tuple[np.ndarray, np.ndarray]]
    sizes: np.ndarray
    names: list[str]
    group_rows: int


class Sampler:
    """A batch sampler (see the module's docstring); subclass it, set the class attributes, override what differs."""
    name: ClassVar[str] = ""
    doc: ClassVar[str] = ""
    sets: ClassVar[tuple[str, ...]] = (CLUSTERED,)
    cursor_keys: ClassVar[tuple[str, ...]] = ()
    needs_clustering: ClassVar[bool] = True
    global_shuffle: ClassVar[bool] = False

    def set_strata(self, cfg, run, base: ShardManifest, row_group_rows: int) -> SetStrata:
        """The strata of this sampler's own set, from the clustered shards' manifest `base` (cfg: the run's config;
        run: its RunDir, for a pass over the rows in Ray tasks when the strata depend on their values)."""
        raise ValueError(f"train.sampler={self.name} reads {', '.join(self.sets)}: it writes no shard set of its own.")

    def batches(self, sc: ScheduleConfig, shapes: SetShapes, seed: int, start: int, stop: int,
                num_steps: int) -> Iterator[GlobalBatch]:
        """The global batches of steps [start, stop) of a schedule of num_steps steps (for ramps), with `seed`. The
        default: one stratum of the (single) set per batch, train/schedule.py's order."""
        return schedule.iterate(shapes.sizes[0], sc.global_batch_size, self, seed, stop, start,
                                sc.cluster_weighting, shapes.block_rows[0])

    def epoch_sampler(self) -> Sampler:
        """The sampler whose set counts an epoch (and the pairs it leaves out): the last set's."""
        last = self.sets[-1]
        return self if last in (self.name, CLUSTERED) else sampler(last)

    def writes_set(self) -> bool:
        return self.name in self.sets and self.name != CLUSTERED


def sampler(name: str) -> Sampler:
    """The registered sampler `name` (an instance); an unknown name is a ConfigError naming every registered one."""
    found = SAMPLERS.get(name)
    return found() if isinstance(found, type) else found


def training_sets(which: str | Sampler, dedup: bool) -> tuple[str, ...]:
    """The shard sets (names for io.layout.shard_set_dir) a training run reads: the deduplicated clustered shards
    with train.dedup, else its sampler's (`which`: the sampler or its name)."""
    if dedup:
        return (DEDUP_SET,)
    return (sampler(which) if isinstance(which, str) else which).sets


def unused_pairs(sampler_name: str, sc: ScheduleConfig, epoch_sizes: Sequence[int]) -> int:
    """Pairs one epoch leaves out: by the rules of the sampler whose set counts the epoch."""
    counter = sampler(sampler_name).epoch_sampler()
    return schedule.unused_pairs(epoch_sizes, sc.global_batch_size, counter, sc.seed, 0, sc.cluster_weighting)

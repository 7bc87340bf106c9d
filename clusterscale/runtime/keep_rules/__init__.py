"""dedup.keep rules: which member of a duplicate group stays.

A rule is a class registered in KEEP_RULES (config/sections.py) by a module of this package (looking a rule up imports
every module here, so a new rule is one module and its test). It gives every row of a batch of assign/'s rows (every
column of assign/: pair_id, query, passage, cluster, cos, emb, ...) a float rank: lower is kept first, ties by
pair_id. The rank is a function of the row alone (and dedup.seed), so any number of workers agrees on the keep order
(runtime/dedup_core.keep_order) and exact and semantic dedup decide the same groups whatever the partitioning.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import pyarrow as pa

from clusterscale.config.sections import KEEP_RULES


class KeepRule:
    """A dedup.keep rule (see the module's docstring): set name, doc, the columns it reads; implement rank."""
    name: ClassVar[str] = ""
    doc: ClassVar[str] = ""
    columns: ClassVar[tuple[str, ...]] = ("pair_id",)

    def rank(self, rows: pa.Table, seed: int) -> np.ndarray:
        """(rows,) float64 keep ranks: lower is kept first (ties by pair_id)."""
        raise NotImplementedError


def keep_rule(name: str) -> KeepRule:
    """The registered rule `name` (an instance); an unknown name is a ConfigError naming every registered one."""
    found = KEEP_RULES.get(name)
    return found() if isinstance(found, type) else found

"""The built-in keep rules: by the row's cosine to its centroid (hard, easy) or a seeded hash (random)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from clusterscale.config.sections import KEEP_RULES
from clusterscale.runtime.hashing import hash_unit
from clusterscale.runtime.keep_rules import KeepRule


class ByCentroid(KeepRule):
    """By the row's cosine to its centroid (assign/'s `cos`), lowest first times `sign`."""
    columns = ("pair_id", "cos")
    sign = 1.0

    def rank(self, rows: pa.Table, seed: int) -> np.ndarray:
        return self.sign * np.asarray(rows.column("cos").to_numpy(), np.float64)


@KEEP_RULES.register
class Hard(ByCentroid):
    name = "hard"
    doc = "the row farthest from its centroid (lowest cos) stays"


@KEEP_RULES.register
class Easy(ByCentroid):
    name = "easy"
    doc = "the row nearest its centroid (highest cos) stays"
    sign = -1.0


@KEEP_RULES.register
class Random(KeepRule):
    name = "random"
    doc = "a seeded hash of pair_id decides (dedup.seed)"

    def rank(self, rows: pa.Table, seed: int) -> np.ndarray:
        return hash_unit(rows.column("pair_id").to_numpy(), salt=seed)

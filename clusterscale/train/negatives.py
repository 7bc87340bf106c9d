"""Mined negatives at training time: M negatives per query from negatives/, with the texts of their pairs;
and the fingerprint of negatives/ that the mine stage writes and training checks.

The choice of M among a query's kept candidates is a pure function of (seed, step, pair_id), so a
resumed run draws the same negatives. Queries with fewer than M candidates are topped up with
random training passages (counted as `negatives_padded`), because every rank must embed the same
number of negatives for the cross-rank gather.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from clusterscale.config import Config
from clusterscale.io.layout import NEGATIVES, train_dir
from clusterscale.io.rundir import RunDir


MINE_SECTIONS = ("data", "embed", "cluster", "mine")  # the config sections negatives/ depends on (mining is
# sharded by the clusters of cluster.k)


def mine_extra(cfg: Config, run: RunDir) -> dict | None:
    """The fingerprint of the training run whose model mines (mine.encoder=train:<name>); None otherwise."""
    if not cfg.mine.encoder.startswith("train:"):
        return None
    done = f"{train_dir(cfg.mine.encoder.split(':', 1)[1])}/_DONE.json"
    return {"encoder_run": run.read_json(done)["fingerprint"] if run.exists(done) else None}


def mine_fingerprint(cfg: Config, run: RunDir) -> str:
    """The fingerprint of negatives/: MINE_SECTIONS, and the training run when mining with its model."""
    return cfg.fingerprint(MINE_SECTIONS, extra=mine_extra(cfg, run))


def load_negatives(run: RunDir) -> tuple[np.ndarray, list[np.ndarray]]:
    """(sorted pair_ids, their negative pair_id arrays, best first) from negatives/."""
    run.require(NEGATIVES, "mine", "Mined negatives")
    table = pa.concat_tables([pq.read_table(run.fs.open_input_file(path), columns=["pair_id", "neg_pair_ids"])
                              for path in run.files(NEGATIVES)])
    order = np.argsort(table.column("pair_id").to_numpy(), kind="stable")
    table = table.take(pa.array(order))
    lists = table.column("neg_pair_ids").combine_chunks()
    offsets, values = np.asarray(lists.offsets), np.asarray(lists.values)
    return table.column("pair_id").to_numpy(), [values[offsets[i]:offsets[i + 1]] for i in range(len(table))]


class MinedNegatives:
    def __init__(self, run: RunDir, manifest: dict, shards_run: RunDir, per_query: int, seed: int):
        self.per_query, self.seed = per_query, seed
        self.ids, self.candidates = load_negatives(run)
        files = [f for c in manifest["clusters"] for f in c["files"]]
        table = pa.concat_tables([pq.read_table(shards_run.fs.open_input_file(shards_run.path(f)),
                                                columns=["pair_id", "query", "passage"]) for f in files])
        table = table.take(pa.array(np.argsort(table.column("pair_id").to_numpy(), kind="stable")))
        self.text_ids = table.column("pair_id").to_numpy()
        self.queries, self.passages = table.column("query"), table.column("passage")

    def _rows_of(self, pair_ids: np.ndarray) -> np.ndarray:
        rows = np.searchsorted(self.text_ids, pair_ids)
        rows = np.minimum(rows, len(self.text_ids) - 1)
        missing = self.text_ids[rows] != pair_ids
        if missing.any():
            raise ValueError(f"{int(missing.sum())} mined negatives (e.g. pair_id {int(pair_ids[missing][0])}) are not "
                             f"in the training shards: negatives/ was mined on other data; rerun `clusterscale mine`.")
        return rows

    def for_rows(self, pair_ids: np.ndarray, step: int) -> tuple[list[str], list[str], int]:
        """(negative passages, their pairs' queries), M per query grouped by query; and how many were padded."""
        chosen, padded = [], 0
        for pid in pair_ids.tolist():
            rng = np.random.default_rng([self.seed, step, pid >> 32, pid & 0xFFFF_FFFF])
            at = int(np.searchsorted(self.ids, pid))
            pool = self.candidates[at] if at < len(self.ids) and self.ids[at] == pid else np.zeros(0, np.int64)
            take = rng.choice(len(pool), size=min(self.per_query, len(pool)), replace=False) if len(pool) else []
            picks = [int(pool[i]) for i in sorted(take)]  # keep best-first order among the chosen
            while len(picks) < self.per_query:  # a random training passage; masking handles any collision
                other = int(self.text_ids[rng.integers(len(self.text_ids))])
                if other != pid:
                    picks.append(other)
                    padded += 1
            chosen += picks
        rows = pa.array(self._rows_of(np.asarray(chosen, dtype=np.int64)))
        return self.passages.take(rows).to_pylist(), self.queries.take(rows).to_pylist(), padded

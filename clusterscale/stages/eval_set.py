"""The evaluation set, chosen inside Ray tasks: held-out queries by a hash threshold, the distractor pool by a
running pick; the driver holds O(eval.max_queries + eval.num_distractors) rows whatever N and
data.heldout_fraction are (5% of 100M pairs is 5M held-out pairs: never in one process).

evaluate's build_eval_set calls `heldout_queries` and `distractor_passages`. Without a Ray session (library use,
unit tests) the same per-unit functions run in this process, one after another.
"""
from __future__ import annotations

import hashlib
import itertools
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from clusterscale.io.rundir import RunDir, StageMissingError
from clusterscale.runtime.hashing import hash_unit
from clusterscale.stages.ingest import heldout_key

EVAL_SALT = 0xE7A1
HELDOUT_COLUMNS = ["pair_id", "query", "passage", "source"]
SAFETY = 3.0
"""The threshold is set so that ~SAFETY x max_queries query groups fall under it when every query has one
held-out pair; a run with fewer groups than expected (queries with many passages) retries with a higher one."""

Unit = tuple[int, str, int, int]  # (file index, path, row group, the row group's first row in the file)


def units(run: RunDir, folder: str) -> tuple[list[Unit], int]:
    """(file index, path, row group, first row) of every row group of `folder`, in file order, and the rows in
    all (one footer read per file, FOOTER_THREADS at a time)."""
    paths = run.files(folder)
    out, total = [], 0
    for f, (path, meta) in enumerate(zip(paths, run.footers(paths))):
        first = 0
        for g in range(meta.num_row_groups):
            out.append((f, path, g, first))
            first += meta.row_group(g).num_rows
        total += first
    return out, total


def _map_units(function: Callable, run: RunDir, work: list[Unit], *args) -> Iterator:
    """function(run.uri, unit, *args) for every unit: Ray tasks (results as they finish) or, without a session,
    here in unit order. Large shared arguments travel once (ray.put)."""
    if work and ray.is_initialized():
        task = ray.remote(num_cpus=1, max_retries=2)(function)
        shared = [ray.put(a) for a in args]
        window = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))  # the driver holds O(CPUs) refs, not O(units)
        queued, pending = iter(work), []
        while True:
            pending += [task.remote(run.uri, u, *shared) for u in itertools.islice(queued, window - len(pending))]
            if not pending:
                return
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
    else:
        for u in work:
            yield function(run.uri, u, *args)


# --- held-out queries: the max_queries query groups whose first pair has the smallest hash_unit(pair_id) ------
def group_ids(queries: list[str]) -> list[bytes]:
    """A 16-byte id per query of the group the held-out split keeps together (its heldout_key)."""
    return [hashlib.blake2b(heldout_key(q).encode(), digest_size=16, person=b"evalgroup").digest() for q in queries]


def unit_groups(run_uri: str, unit: Unit, threshold: float) -> list[bytes]:
    """The query groups whose first row IN this row group has a key <= threshold.

    A group's first row in the whole split is its first row in some row group, so every group whose key (the
    hash of its first pair's id) is <= threshold is among the candidates of one unit or another."""
    run = RunDir(run_uri)
    _, path, group, _ = unit
    with run.fs.open_input_file(path) as handle:
        table = pq.ParquetFile(handle).read_row_group(group, columns=["pair_id", "query"])
    gids = group_ids(table.column("query").to_pylist())
    keys = hash_unit(table.column("pair_id").to_numpy(), salt=EVAL_SALT)
    first: dict[bytes, float] = {}
    for gid, key in zip(gids, keys):
        first.setdefault(gid, float(key))
    return [gid for gid, key in first.items() if key <= threshold]


def unit_members(run_uri: str, unit: Unit, wanted: frozenset[bytes] | None) -> pa.Table:
    """The rows of the row group whose query group is wanted (all rows for None), with group id and position."""
    run = RunDir(run_uri)
    file_index, path, group, first_row = unit
    with run.fs.open_input_file(path) as handle:
        table = pq.ParquetFile(handle).read_row_group(group, columns=HELDOUT_COLUMNS)
    gids = group_ids(table.column("query").to_pylist())
    keep = np.arange(table.num_rows) if wanted is None else \
        np.array([i for i, g in enumerate(gids) if g in wanted], dtype=np.int64)
    picked = table.take(pa.array(keep, pa.int64()))
    return picked.append_column("gid", pa.array([gids[i] for i in keep], pa.binary(16))) \
        .append_column("file", pa.array(np.full(len(keep), file_index, np.int64))) \
        .append_column("row", pa.array(keep + first_row, pa.int64()))


def _members(run: RunDir, work: list[Unit], wanted: frozenset[bytes] | None) -> pa.Table:
    parts = list(_map_units(unit_members, run, work, wanted))
    return pa.concat_tables(parts).sort_by([("file", "ascending"), ("row", "ascending")])


def _choose(members: pa.Table, max_queries: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Per query group of `members` (rows in split order): its first row and that row's key; and the rows of the
    max_queries groups of smallest key, groups in the order of their first row."""
    gids = members.column("gid").to_pylist()
    first_of: dict[bytes, int] = {}
    for row, gid in enumerate(gids):
        first_of.setdefault(gid, row)
    firsts = np.fromiter(first_of.values(), np.int64, len(first_of))
    keys = hash_unit(members.column("pair_id").to_numpy()[firsts], salt=EVAL_SALT)
    chosen = np.sort(firsts[np.argsort(keys, kind="stable")[:max_queries]])
    return [gids[r] for r in chosen], firsts, keys


def heldout_queries(run: RunDir, max_queries: int) -> tuple[pa.Table, list[list[int]]]:
    """The chosen groups' rows (split order) and, per group in the order of its first row, its row indices.

    Equal to grouping all of heldout/ on one process and taking the max_queries groups whose first pair has the
    smallest key; the driver holds only the candidates' rows: a threshold T on the key, from the row count,
    keeps ~SAFETY x max_queries groups; a second pass reads the rows of exactly those groups (so each one's true
    first pair is known), and T is raised until max_queries candidates have a key <= T (or T covers all)."""
    work, total = units(run, "heldout")
    if total == 0:
        fraction = _heldout_fraction(run)
        why = ("ingest with data.heldout_fraction > 0" if fraction in (0, "?") else "the fraction held out no query "
               "of this data (chosen by a hash of the query: too few distinct queries); ingest with a higher "
               "data.heldout_fraction, or more distinct queries,")
        raise StageMissingError(f"No held-out pairs in {run.path('heldout')} (data.heldout_fraction={fraction}): "
                                f"nothing to evaluate on. To evaluate, {why} in a new --run-dir.")
    threshold = min(1.0, SAFETY * max_queries / total)
    while True:
        wanted = None if threshold >= 1.0 else frozenset(
            gid for found in _map_units(unit_groups, run, work, threshold) for gid in found)
        members = _members(run, work, wanted)
        gids, firsts, keys = _choose(members, max_queries)
        under = int((keys <= threshold).sum())
        if threshold >= 1.0 or under >= max_queries:
            break
        threshold = min(1.0, threshold * max(4.0, SAFETY * max_queries / max(under, 1)))
    chosen = set(gids)
    keep = np.array([i for i, g in enumerate(members.column("gid").to_pylist()) if g in chosen], np.int64)
    picked = members.take(pa.array(keep, pa.int64()))
    order = {gid: i for i, gid in enumerate(gids)}
    groups: list[list[int]] = [[] for _ in gids]
    for row, gid in enumerate(picked.column("gid").to_pylist()):
        groups[order[gid]].append(row)
    return picked, groups


# --- the distractor pool: the num_distractors pairs/ rows of smallest hash_unit(pair_id, EVAL_SALT) -----------
def unit_candidates(run_uri: str, unit: Unit, num_distractors: int) -> pa.Table:
    """The at most num_distractors rows of one row group with the smallest keys: key, pair_id, position and
    passage. Keys come from pair_id alone; the passages of the kept rows are the only texts that leave the task
    (the row group's passage column is read once: O(a row group), like any work unit)."""
    run = RunDir(run_uri)
    file_index, path, group, first_row = unit
    with run.fs.open_input_file(path) as handle:
        parquet = pq.ParquetFile(handle)
        ids = parquet.read_row_group(group, columns=["pair_id"]).column("pair_id").to_numpy()
        keys = hash_unit(ids, salt=EVAL_SALT)
        keep = _smallest(keys, ids, num_distractors)
        passages = parquet.read_row_group(group, columns=["passage"]).column("passage").take(pa.array(keep)) \
            if len(keep) else pa.array([], pa.string())
    return pa.table({"key": keys[keep], "pair_id": ids[keep], "file": np.full(len(keep), file_index, np.int64),
                     "row": keep.astype(np.int64) + first_row, "passage": passages})


def _smallest(keys: np.ndarray, ids: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n smallest (key, pair_id): a partial sort, so a unit costs O(rows), not O(rows log rows)."""
    if len(keys) > n:
        bound = np.partition(keys, n - 1)[n - 1]
        candidates = np.flatnonzero(keys <= bound)
    else:
        candidates = np.arange(len(keys))
    return candidates[np.lexsort((ids[candidates], keys[candidates]))][:n]


def merge_candidates(best: pa.Table | None, more: pa.Table, n: int) -> pa.Table:
    """The n smallest (key, pair_id) of two candidate tables: the driver's bounded running pick."""
    both = more if best is None else pa.concat_tables([best, more])
    order = _smallest(both.column("key").to_numpy(), both.column("pair_id").to_numpy(), n)
    return both.take(pa.array(order))


def distractor_passages(run: RunDir, num_distractors: int) -> list[str]:
    """Passages of the num_distractors pairs/ rows of smallest hash key, in pairs/ order (file, row).

    One Ray task per row group returns its own smallest num_distractors; the driver keeps a running
    pick of num_distractors, so it holds O(num_distractors), whatever N and however pairs/ is split.
    Without a Ray session (library use, unit tests) the same units run here, one after another."""
    work = units(run, "pairs")[0]
    best = None
    for found in (_map_units(unit_candidates, run, work, num_distractors) if num_distractors else ()):
        best = merge_candidates(best, found, num_distractors)
    if best is None:
        return []
    position = np.lexsort((best.column("row").to_numpy(), best.column("file").to_numpy()))
    return best.column("passage").take(pa.array(position)).to_pylist()


def _heldout_fraction(run: RunDir):
    """data.heldout_fraction as heldout/'s marker records it ('?' where it does not)."""
    return ((run.done_marker("heldout").covers or {}).get("data") or {}).get("heldout_fraction", "?")

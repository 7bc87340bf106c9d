"""Mined negatives to the rows: the sidecar pieces of a draw aligned to the shard files, and the padding pool (the
last step of `clusterscale mine` when the config trains with mined negatives; training writes those of its shard
sets and draw when missing, and a re-clustering segment those of its new shards).

Ray Data, with no process holding every text or every candidate list:
  1. read the shard files piece by piece (one task per piece of SIDECAR_PIECE_ROWS rows): pair_id, query,
     passage and the piece's index;
  2. draw from negatives/part-*.parquet the (anchor, draw, slot, cand) rows training uses (draw_candidates: M
     per row and epoch's draw, not every candidate); join them to the anchor's piece (hash join on the anchor's
     pair_id), then to the candidate's texts (hash join on its pair_id);
  3. group by piece: each group reads its piece's pair_ids from the shard file and writes the sidecar piece
     in that order with the shard file's row groups (io/negatives.sidecar_table).
Every shuffle has about JOIN_ROWS_PER_PARTITION rows per partition (candidate_partitions), so a reduce task
does not grow with N, and runs inside bounded_shuffle_maps, from `mine` and from training alike. Which pieces
exist comes from one listing (layout.missing_files), never a request per piece.
A candidate that is not a training row of these shards (removed by dedup) drops out in the join. The padding
pool is a hash-ordered sample of the same text rows: each read task keeps the rows whose hash falls below a
threshold (about 2 x PADDING_POOL_ROWS rows in all), and the driver keeps the PADDING_POOL_ROWS smallest.
"""
from __future__ import annotations

import dataclasses
import math
import posixpath

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from clusterscale.config import Config
from clusterscale.io.layout import missing_files
from clusterscale.io.records import ShardManifest
from clusterscale.io.rundir import RunDir, StageMissingError
from clusterscale.runtime.bounded_data import bounded_shuffle_maps, read_row_groups, shuffle_for
from clusterscale.runtime.hashing import hash_unit, splitmix64
from clusterscale.io.negatives import (PADDING_PATH, PADDING_POOL_ROWS, Draw, candidate_files, groups_per_piece,
                                       shard_files, sidecar_marker, sidecar_path, sidecar_table, training_manifest)
from clusterscale.train.negatives import training_draw
from clusterscale.runtime.progress import ProgressLine

PADDING_SALT = 0x6E6567  # the padding pool's hash salt ("neg")
DRAW_SALT = 0x64726177  # the draw's hash salt ("draw")
JOIN_ROWS_PER_PARTITION = 250_000  # (anchor, candidate) rows per hash partition of the joins and the grouping
READ_ROWS_PER_TASK = 65_536  # shard rows one read task reads (whole pieces; at least one piece)


def piece_units(manifest: ShardManifest) -> list[dict]:
    """One unit per sidecar piece: the shard file, the piece index and its first and last row group."""
    per_piece = groups_per_piece(manifest)
    piece_rows = per_piece * int(manifest.row_group_rows)
    return [{"file": rel, "piece": p, "groups": [p * per_piece, (p + 1) * per_piece]}
            for rel, rows in shard_files(manifest) for p in range(max(1, math.ceil(rows / piece_rows)))]


def _piece_rows(run: RunDir, unit: dict, columns: list[str]) -> tuple[pa.Table, list[int]]:
    """(`columns` of a piece's rows of its shard file, the sizes of its row groups)."""
    with run.fs.open_input_file(run.path(unit["file"])) as handle:
        parquet = pq.ParquetFile(handle)
        groups = list(range(unit["groups"][0], min(unit["groups"][1], parquet.metadata.num_row_groups)))
        table = parquet.read_row_groups(groups, columns=columns, use_threads=False)
        return table, [parquet.metadata.row_group(g).num_rows for g in groups]


def read_pieces(batch: dict, run_uri: str, units: list[dict], pool_fraction: float) -> pa.Table:
    """Ray Data fn over unit indices: the texts of those pieces, with `unit` and `in_pool` per row."""
    run, tables = RunDir(run_uri), []
    for index in batch["unit"].tolist():
        table, _ = _piece_rows(run, units[index], ["pair_id", "query", "passage"])
        in_pool = hash_unit(table.column("pair_id").to_numpy(), PADDING_SALT) < pool_fraction
        tables.append(table.append_column("unit", pa.array(np.full(table.num_rows, index, dtype=np.int64)))
                      .append_column("in_pool", pa.array(in_pool)))
    return pa.concat_tables(tables)


def draw_candidates(batch: pa.Table, draw: Draw) -> pa.Table:
    """(pair_id, neg_pair_ids) -> one (anchor, draw, slot, cand) row per candidate each draw d < draw.draws uses:
    the min(M, count) candidates of smallest hash of (seed, d, anchor, candidate), a uniform choice without
    replacement that depends on nothing else (not on the batch, the file or the rows beside it); slot 0 the
    best."""
    lists = batch.column("neg_pair_ids").combine_chunks()
    offsets = np.asarray(lists.offsets).astype(np.int64)
    offsets -= offsets[0]
    lengths = np.diff(offsets)
    anchors = np.repeat(batch.column("pair_id").to_numpy(), lengths)
    starts = np.repeat(offsets[:-1], lengths)
    slots = np.arange(int(offsets[-1])) - starts
    cands = np.asarray(lists.flatten(), dtype=np.int64)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    mixed = (splitmix64(anchors ^ np.int64(draw.seed)) ^ cands.astype(np.uint64)).view(np.int64)
    tables = []
    for d in range(draw.draws):
        order = np.lexsort((hash_unit(mixed, DRAW_SALT + d), rows))  # by row, then by key
        chosen = np.sort(order[slots < draw.per_query])  # the M smallest keys of each row, back in slot order
        tables.append(pa.table({"anchor": anchors[chosen], "draw": np.full(len(chosen), d, np.int32),
                                "slot": slots[chosen].astype(np.int32), "cand": cands[chosen]}))
    return pa.concat_tables(tables)


def write_piece(group: pa.Table, run_uri: str, units: list[dict], draw: Draw) -> pa.Table:
    """Ray Data map_groups fn: write one sidecar piece from its (anchor, draw, slot, cand, texts) rows; its
    counts."""
    unit = units[int(group.column("unit")[0].as_py())]
    return _write(RunDir(run_uri), unit, group, draw)


def _write(run: RunDir, unit: dict, found: pa.Table, draw: Draw) -> pa.Table:
    ids, group_rows = _piece_rows(run, unit, ["pair_id"])
    table = sidecar_table(ids.column("pair_id").to_numpy(), found, draw.draws)
    sink = pa.BufferOutputStream()
    # The shard file's row groups, one for one; zstd (22% less than snappy on synth text).
    with pq.ParquetWriter(sink, table.schema, compression="zstd") as writer:
        start = 0
        for n_rows in group_rows:
            writer.write_table(table.slice(start, n_rows), row_group_size=max(1, n_rows))
            start += n_rows
    run.write_bytes(sidecar_path(unit["file"], unit["piece"], draw), sink.getvalue().to_pybytes())
    return pa.table({"rows": [table.num_rows], "negatives": [len(found)]})


def write_empty_pieces(batch: dict, run_uri: str, units: list[dict], draw: Draw) -> pa.Table:
    """Ray Data fn: the pieces none of whose rows has a candidate (no group reached them)."""
    empty = pa.table({"anchor": pa.array([], pa.int64()), "draw": pa.array([], pa.int32()),
                      "slot": pa.array([], pa.int32()), "cand": pa.array([], pa.int64()),
                      "neg_passage": pa.array([], pa.string()), "neg_query": pa.array([], pa.string())})
    return pa.concat_tables([_write(RunDir(run_uri), units[i], empty, draw) for i in batch["unit"].tolist()])


def _rows_of_units(batch: pa.Table, units: list[int]) -> pa.Table:
    return batch.filter(pc.is_in(batch.column("unit"), pa.array(units, pa.int64())))


def _pool_rows(batch: pa.Table) -> pa.Table:
    return batch.filter(batch.column("in_pool")).select(["pair_id", "query", "passage"])


def candidate_partitions(n_rows: int, candidates_per_row: int, pieces: int | None = None) -> int:
    """Hash partitions of a shuffle of (anchor, candidate) rows: about JOIN_ROWS_PER_PARTITION rows each, so a
    reduce task's rows do not grow with N (Ray's default of 200 would); for a grouping by piece, no more than
    the pieces grouped (a partition holds whole pieces)."""
    partitions = max(1, math.ceil(n_rows * candidates_per_row / JOIN_ROWS_PER_PARTITION))
    return partitions if pieces is None else max(1, min(partitions, pieces))


def _missing(run: RunDir, units: list[dict], draw: Draw) -> list[int]:
    """The units whose sidecar piece is not written yet: one recursive listing, not a request per piece."""
    paths = [sidecar_path(u["file"], u["piece"], draw) for u in units]
    missing = set(missing_files(run, paths))
    return [i for i, path in enumerate(paths) if path in missing]


def sidecars_for_training(cfg: Config, neg_run: RunDir, shards_run: RunDir) -> dict:
    """The sidecars of the shard set cfg trains from (in shards_run) for its draw (train.negatives_per_query,
    train.seed, the epochs), from neg_run's negatives/: written where missing or made for other shards, else left
    as they are (one marker read); their counts. Without train.negatives_per_query only the padding pool: the
    draw is written by the training that needs it."""
    found = training_manifest(cfg, shards_run)
    if found is None:
        raise StageMissingError(f"Mined negatives travel with the shard rows: run `clusterscale shard` "
                                f"(cluster.k={cfg.cluster.k}) before `clusterscale mine`.")
    set_dir, manifest = found
    draw = training_draw(cfg, manifest) if cfg.train.objective.negatives_per_query else None
    # The joins' rows: a row's text with each candidate it draws.
    per_row = draw.per_query * draw.draws if draw else 1
    shuffle = shuffle_for(cfg.ray, shards_run, [shards_run.path(f) for f in manifest.files[:1]],
                          sum(manifest.strata_sizes) * per_row)
    with bounded_shuffle_maps(shuffle):  # also when training writes them (outside the mine stage)
        return write_sidecars(neg_run, shards_run, set_dir, manifest, draw)


def write_sidecars(neg_run: RunDir, shards_run: RunDir, set_dir: str, manifest: ShardManifest,
                   draw: Draw | None) -> dict:
    """Write the sidecar pieces of `draw` for every shard file of the set under set_dir (in shards_run) from the
    candidates in neg_run's negatives/, and neg_run's padding pool when missing; their counts. Pieces written for
    another manifest of the set (the shards were rewritten) are removed first. draw None: the padding pool only."""
    units = piece_units(manifest)
    if draw is None:
        if not neg_run.exists(PADDING_PATH):
            write_padding_pool(neg_run, _texts(shards_run, units, manifest))
        return {"sidecar_pieces": 0, "sidecar_pieces_written": 0}
    marker = sidecar_marker(set_dir, draw)
    recorded = shards_run.read_json(marker)["shards"] if shards_run.exists(marker) else None
    if recorded is not None and recorded != manifest.fingerprint:
        shards_run.remove(posixpath.dirname(marker))
        recorded = None
    todo = [] if recorded is not None else _missing(shards_run, units, draw)  # an interrupted attempt: the rest
    pool_missing = not neg_run.exists(PADDING_PATH)
    if recorded is not None and not pool_missing:
        return {"sidecar_pieces": len(units), "sidecar_pieces_written": 0}
    n_rows = sum(rows for _, rows in shard_files(manifest))
    texts = _texts(shards_run, units, manifest)
    if pool_missing:
        write_padding_pool(neg_run, texts)
    counts = {"rows": 0, "negatives": 0}
    if todo:
        partitions = candidate_partitions(n_rows, draw.per_query * draw.draws)
        where = texts.select_columns(["pair_id", "unit"]).rename_columns({"pair_id": "anchor"})
        if len(todo) < len(units):  # a rerun after an interruption: only the pieces not yet written
            where = where.map_batches(_rows_of_units, fn_kwargs={"units": todo}, batch_format="pyarrow")
        candidates = read_row_groups(neg_run, candidate_files(neg_run), ["pair_id", "neg_pair_ids"]) \
            .map_batches(draw_candidates, fn_kwargs={"draw": draw}, batch_format="pyarrow")
        cand_texts = texts.select_columns(["pair_id", "query", "passage"]).rename_columns(
            {"pair_id": "cand", "query": "neg_query", "passage": "neg_passage"})
        found = candidates.join(where, "inner", partitions, on=("anchor",)) \
            .join(cand_texts, "inner", partitions, on=("cand",))
        by_piece = candidate_partitions(n_rows, draw.per_query * draw.draws, len(todo))
        written = found.groupby("unit", num_partitions=by_piece).map_groups(
            write_piece, fn_kwargs={"run_uri": shards_run.uri, "units": units, "draw": draw}, batch_format="pyarrow")
        progress = ProgressLine("mine", len(todo), unit="sidecar pieces",
                                before_first="the drawn candidates are joined to their texts first")
        for row in written.iter_rows():  # one row per piece with rows
            counts = {k: counts[k] + row[k] for k in counts}
            progress.advance(1)
        still = _missing(shards_run, units, draw)
        if still:
            for row in ray.data.from_items([{"unit": i} for i in still]).map_batches(
                    write_empty_pieces, fn_kwargs={"run_uri": shards_run.uri, "units": units, "draw": draw},
                    batch_format="numpy").iter_rows():
                counts["rows"] += row["rows"]
    shards_run.write_json(marker, {"shards": manifest.fingerprint, "draw": dataclasses.asdict(draw)})
    return {"sidecar_pieces": len(units), "sidecar_pieces_written": len(todo), "sidecar_draw": draw.key,
            "sidecar_rows_written": counts["rows"], "sidecar_negatives_written": counts["negatives"]}


def _texts(run: RunDir, units: list[dict], manifest: ShardManifest) -> ray.data.Dataset:
    """The shard rows' pair_id, query, passage, unit and in_pool (the padding pool's hash sample), read a few pieces
    per task: ~READ_ROWS_PER_TASK rows (shard files of one global batch are small, 64 rows at the default batch,
    and one task per piece spent its time in Ray's per-task overhead: 201 s for 9.4k pieces)."""
    n_rows = sum(rows for _, rows in shard_files(manifest))
    read_args = {"run_uri": run.uri, "units": units,
                 "pool_fraction": min(1.0, 2 * PADDING_POOL_ROWS / max(1, n_rows))}
    per_task = max(1, READ_ROWS_PER_TASK * len(units) // max(1, n_rows))  # pieces of the mean piece size
    return ray.data.from_items([{"unit": i} for i in range(len(units))],
                               override_num_blocks=max(1, math.ceil(len(units) / per_task))
                               ).map_batches(read_pieces, fn_kwargs=read_args, batch_size=None, batch_format="numpy")


def write_padding_pool(run: RunDir, texts: ray.data.Dataset) -> None:
    """negatives/padding.parquet: the PADDING_POOL_ROWS training rows of smallest hash (sampled in the tasks)."""
    tables = list(texts.map_batches(_pool_rows, batch_format="pyarrow").iter_batches(batch_format="pyarrow"))
    if not tables:
        raise RuntimeError("The shards hold no rows to sample the padding pool from: rerun `clusterscale shard`.")
    table = pa.concat_tables(tables)
    order = np.argsort(hash_unit(table.column("pair_id").to_numpy(), PADDING_SALT), kind="stable")
    run.write_parquet(PADDING_PATH, table.take(pa.array(order[:PADDING_POOL_ROWS])))

"""Test helper: a run directory holding only shards + manifest (no Ray, no embedding), for training tests."""
from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from clusterscale.io.rundir import RunDir
from clusterscale.io.layout import shards_dir
from tests.conftest import TOPICS, make_pairs


def make_sharded_run(root: Path, k: int = 4, rows_per_topic: int = 40, global_batch_size: int = 16,
                     with_source: bool = True, row_group_rows: int | None = None,
                     groups_per_file: int = 3) -> RunDir:
    """k shards (one per topic of make_pairs, so clusters are real topics) and a manifest. Without
    row_group_rows: 2 files each, one row group per file (the layout before the shard stage sized row
    groups); with it: the shard stage's layout, files of groups_per_file row groups of row_group_rows rows."""
    run = RunDir(str(root))
    table = make_pairs(rows_per_topic * len(TOPICS))
    topics = sorted(TOPICS)
    clusters = []
    for c in range(k):
        rows = [i for i, s in enumerate(table.column("src").to_pylist()) if topics.index(s) % k == c]
        part = table.take(pa.array(rows))
        shard = pa.table({"pair_id": pa.array(rows, pa.int64()), "query": part.column("q"),
                          "passage": part.column("p")})  # the shard stage's columns (stages/shards.SHARD_COLUMNS)
        if with_source:
            shard = shard.append_column("source", part.column("src"))
        files = []
        half = len(rows) // 2
        pieces = [shard.slice(0, half), shard.slice(half)]
        if row_group_rows:
            file_rows = groups_per_file * row_group_rows
            pieces = [shard.slice(start, file_rows) for start in range(0, len(rows), file_rows)]
        for i, piece in enumerate(pieces):
            rel = f"{shards_dir(k)}/cluster={c}/part-{i:05d}.parquet"
            sink = io.BytesIO()
            pq.write_table(piece, sink, row_group_size=row_group_rows, write_statistics=row_group_rows is None,
                           use_dictionary=row_group_rows is None)  # with row groups: the shard stage's options
            run.write_bytes(rel, sink.getvalue())
            files.append(rel)
        clusters.append({"cluster": c, "name": str(c), "rows": len(rows), "files": files,
                         "file_rows": [piece.num_rows for piece in pieces], "members": [c],
                         "mean_intra_cosine": None, "samples": []})
    manifest = {"k": k, "fingerprint": "test", "global_batch_size": global_batch_size, "clusters": clusters,
                "stats": {"rows": table.num_rows}}
    if row_group_rows:
        manifest.update(row_group_rows=row_group_rows, rows_per_file=groups_per_file * row_group_rows)
    run.write_json(f"{shards_dir(k)}/manifest.json", manifest)
    run.mark_done(shards_dir(k), "test", {})
    return run


def train_overrides(model: str, k: int = 4, global_batch_size: int = 16, steps: int = 6) -> list[str]:
    return [f"cluster.k={k}", f"train.init={model}", f"train.global_batch_size={global_batch_size}",
            f"train.steps={steps}", "train.query_max_length=16", "train.passage_max_length=32",
            "train.log_batches=true", "train.warmup_steps=2", "train.lr=1e-3", "train.final_lr=1e-4",
            "train.log_every_steps=2"]

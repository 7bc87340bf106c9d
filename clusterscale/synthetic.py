"""Structured synthetic unit vectors and a ready embeddings/ stage built from them (tests, benchmarks).

`write_embeddings_stage` produces exactly what `clusterscale embed` leaves in a run directory, so fit,
assign and shard can be exercised and timed at any N, d and k without running an encoder.
"""
from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from clusterscale.vectors import emb_array
from clusterscale.rundir import RunDir


def clustered_unit_vectors(n: int, d: int, n_topics: int, seed: int = 0, spread: float = 0.6,
                           ) -> tuple[np.ndarray, np.ndarray]:
    """(x, topic): n fp16-representable unit vectors around n_topics random directions."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((n_topics, d))
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    # Zipf-like topic sizes: real corpora have a few big topics and a long tail.
    weights = 1.0 / np.arange(1, n_topics + 1) ** 0.7
    topic = rng.choice(n_topics, size=n, p=weights / weights.sum())
    x = centers[topic] + spread * rng.standard_normal((n, d)) / np.sqrt(d)  # noise of norm ~spread
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    # Stored embeddings are fp16: round here so in-memory references see the same numbers as the fit.
    return x.astype(np.float16).astype(np.float32), topic


def write_embeddings_stage(run: RunDir, x: np.ndarray, rows_per_file: int = 50_000, first_id: int = 0,
                           texts: bool = True) -> None:
    """RUN/embeddings/part-*.parquet (pair columns + emb fp16) and its done marker, like `embed` writes."""
    n = len(x)
    run.begin("embeddings")
    for part, start in enumerate(range(0, n, rows_per_file)):
        stop = min(n, start + rows_per_file)
        ids = np.arange(first_id + start, first_id + stop, dtype=np.int64)
        columns = {"pair_id": pa.array(ids)}
        if texts:
            columns |= {"query": pa.array([f"query {i}" for i in ids]),
                        "passage": pa.array([f"passage {i}" for i in ids]),
                        "source": pa.array(["synthetic"] * (stop - start))}
        table = pa.table(columns).append_column("emb", emb_array(x[start:stop]))
        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=max(1, rows_per_file // 2))
        run.write_bytes(f"embeddings/part-{part:05d}.parquet", sink.getvalue())
    run.mark_done("embeddings", "synthetic", {"rows": n, "truncated": 0})

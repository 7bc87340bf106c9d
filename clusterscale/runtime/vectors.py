"""The embeddings column <-> numpy, without torch or transformers: imported by every k-means, shard and mine
worker process, where importing the encoder stack would add seconds of start-up per actor."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

# Rows per Parquet row group of embeddings/ (embed, synth): the k-means fit samples whole row groups, so
# smaller groups spread its sample wider for the same bytes read (8,192 x 768 fp16 = 12.6 MB per group).
EMBEDDINGS_ROW_GROUP_ROWS = 8_192


def emb_array(vectors: np.ndarray) -> pa.FixedSizeListArray:
    """(n, d) float -> fixed_size_list<float16>[d]."""
    flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float16).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])


SIDE_COLUMNS = {"passage": ("emb",), "query": ("emb_query",), "mean": ("emb", "emb_query")}
"""The columns of embeddings/ (and assign/) each cluster.side reads."""


def clustered_matrix(table: pa.Table, side: str = "passage") -> np.ndarray:
    """(n, d) float32 vectors that cluster.side clusters: the passage's `emb`, the query's `emb_query`, or their
    normalised sum ('mean')."""
    if side == "passage":
        return emb_matrix(table.column("emb"))
    if side == "query":
        return emb_matrix(table.column("emb_query"))
    x = emb_matrix(table.column("emb")) + emb_matrix(table.column("emb_query"))
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1)


def emb_matrix(column: pa.ChunkedArray | pa.Array, dtype=np.float32) -> np.ndarray:
    """fixed_size_list<float>[d] column -> (n, d) array without a Python loop."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    d = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(-1, d)

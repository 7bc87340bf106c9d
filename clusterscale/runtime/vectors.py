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


def clustered_matrix(table: pa.Table, side: str = "passage", dims: int = 0) -> np.ndarray:
    """(n, d) float32 vectors that cluster.side clusters: the passage's `emb`, the query's `emb_query`, or their
    normalised sum ('mean'); with cluster.dims, each on its first `dims` dimensions (truncated)."""
    if side == "passage":
        return truncated(emb_matrix(table.column("emb")), dims)
    if side == "query":
        return truncated(emb_matrix(table.column("emb_query")), dims)
    x = truncated(emb_matrix(table.column("emb")), dims) + truncated(emb_matrix(table.column("emb_query")), dims)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1)


def truncated(x: np.ndarray, dims: int) -> np.ndarray:
    """cluster.dims: the first `dims` dimensions of every row, re-normalised (a Matryoshka encoder's smaller
    embedding); dims = 0 or the full width: x itself."""
    if not dims or dims == x.shape[1]:
        return x
    if dims > x.shape[1]:
        raise ValueError(f"cluster.dims={dims} is more than the embeddings' {x.shape[1]} dimensions: set it to at most "
                         f"{x.shape[1]} (0 = all).")
    head = x[:, :dims]
    norms = np.linalg.norm(head.astype(np.float32), axis=1, keepdims=True)
    return (head / np.where(norms > 0, norms, 1)).astype(x.dtype, copy=False)


VECTOR_COLUMNS = ("emb", "emb_query")


def truncated_columns(table: pa.Table, dims: int) -> pa.Table:
    """table with its vector columns (emb, emb_query) on their first `dims` dimensions (truncated): what dedup
    compares and moves with cluster.dims. dims = 0: table itself."""
    for name in VECTOR_COLUMNS:
        if dims and name in table.column_names and table.schema.field(name).type.list_size != dims:
            at = table.schema.get_field_index(name)
            table = table.set_column(at, name, emb_array(truncated(emb_matrix(table.column(name)), dims)))
    return table


def truncated_schema(schema: pa.Schema, dims: int) -> pa.Schema:
    """schema with its vector columns' width `dims` (as truncated_columns writes them); dims = 0: schema itself."""
    for name in VECTOR_COLUMNS:
        if dims and name in schema.names:
            at = schema.get_field_index(name)
            schema = schema.set(at, pa.field(name, pa.list_(pa.float16(), dims)))
    return schema


def emb_matrix(column: pa.ChunkedArray | pa.Array, dtype=np.float32) -> np.ndarray:
    """fixed_size_list<float>[d] column -> (n, d) array without a Python loop."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    d = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(-1, d)

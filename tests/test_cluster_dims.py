"""cluster.dims: fit, assign, dedup and mine on the first d dimensions of the frozen vectors, re-normalised (a
Matryoshka encoder's smaller embedding). tests/test_kmeans.py fits and assigns with it through Ray; here the
truncation itself, dedup's semantic pass and mine's routing, without Ray."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from clusterscale.config import DedupConfig
from clusterscale.runtime.vectors import (clustered_matrix, emb_array, emb_matrix, truncated, truncated_columns,
                                          truncated_schema)
from clusterscale.stages.dedup import heldout_keys, mark_rows, resolve_exact, route_heldout, semantic_pass
from clusterscale.stages.mine_search import route_rows


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_truncation_keeps_the_first_dimensions_renormalised():
    x = _unit(np.random.default_rng(0).normal(size=(5, 8))).astype(np.float32)
    y = truncated(x, 3)
    np.testing.assert_allclose(y, _unit(x[:, :3]), rtol=1e-6)
    assert truncated(x, 0) is x and truncated(x, 8) is x
    with pytest.raises(ValueError, match="cluster.dims=9 is more than the embeddings' 8 dimensions"):
        truncated(x, 9)
    table = pa.table({"pair_id": np.arange(5), "emb": emb_array(x), "emb_query": emb_array(x[::-1])})
    cut = truncated_columns(table, 3)
    assert cut.schema == truncated_schema(table.schema, 3)
    np.testing.assert_allclose(emb_matrix(cut.column("emb_query")), _unit(emb_matrix(table.column("emb_query"))[:, :3]),
                               atol=2e-3)  # stored as float16
    mean = _unit(truncated(emb_matrix(table.column("emb")), 3) + truncated(emb_matrix(table.column("emb_query")), 3))
    np.testing.assert_allclose(clustered_matrix(table, "mean", 3), mean, rtol=1e-6)


def _pairs(x: np.ndarray) -> pa.Table:
    n = len(x)
    return pa.table({"pair_id": pa.array(np.arange(n), pa.int64()), "query": [f"q{i}" for i in range(n)],
                     "passage": [f"p{i}" for i in range(n)], "emb": emb_array(x),
                     "cluster": pa.array(np.zeros(n, np.int32)), "cos": pa.array(np.linspace(0, 1, n, dtype=np.float32))})


NO_HELDOUT = heldout_keys(pa.table({"pair_id": pa.array([], pa.int64()), "query": pa.array([], pa.string()),
                                    "passage": pa.array([], pa.string())}))


@pytest.mark.parametrize("dims, removed", [(0, 0), (4, 1)])
def test_dedup_compares_the_truncated_vectors(dims, removed):
    """Two rows equal on their first 4 dimensions and far apart on the rest: one duplicate at cluster.dims=4, none
    on the full vectors; the rows dedup moves (and keeps) carry the vectors it compared."""
    head = np.array([1.0, 0.5, 0.2, 0.1])
    x = _unit(np.stack([np.r_[head, 3, 0, 0, 0], np.r_[head, 0, 0, 0, -3], np.r_[0, 0, 1.0, 0, 0, 1, 0, 0]]))
    dc = DedupConfig(semantic_threshold=0.95)
    marked = mark_rows(_pairs(x), dc, NO_HELDOUT, np.zeros(1, np.int64), np.zeros(2, np.int64), dims)
    assert marked.schema.field("emb").type.list_size == (dims or 8)
    out = semantic_pass(resolve_exact(marked).sort_by("pair_id"), dc)
    assert sum(r != 0 for r in out.column("reason").to_pylist()) == removed
    held = route_heldout(pa.table({"pair_id": pa.array([9], pa.int64()), "emb": emb_array(x[:1])}),
                         truncated(np.eye(8, dtype=np.float32)[:2], dims or 8), 1, marked.schema, np.zeros(2, np.int64))
    assert held.schema == marked.schema  # the held-out vectors routed on the same width


def test_mine_routes_and_searches_the_frozen_vectors_on_the_centroids_width():
    """Frozen vectors (by_query) are probed and routed on the centroids' dimensions; a re-embedding's (another space)
    are routed whole."""
    rng = np.random.default_rng(1)
    x, q = (_unit(rng.normal(size=(6, 8))).astype(np.float32) for _ in range(2))
    batch = _pairs(x).append_column("emb_query", emb_array(q))
    centroids = truncated(_unit(rng.normal(size=(2, 8))).astype(np.float32), 4)
    routed = route_rows(batch, centroids, 2, by_query=True)
    assert routed.schema.field("vec").type.list_size == 4
    passages = routed.filter(pc.equal(routed.column("kind"), 0))
    first = passages.column("pair_id").to_numpy()
    np.testing.assert_allclose(emb_matrix(passages.column("vec")), truncated(emb_matrix(batch.column("emb")), 4)[first],
                               atol=2e-3)
    whole = route_rows(batch, _unit(rng.normal(size=(2, 5))).astype(np.float32), 2, by_query=False)
    assert whole.schema.field("vec").type.list_size == 8

"""ray.vector_backend: the torch path (on this CPU) gives what faiss gives for assign, fit, mine and evaluate: the
same rows, the same scores, ties broken the same way (runtime/vector_search.top_k rescores in float64). No Ray, no
model: the stages' own functions on small arrays."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest

from clusterscale import config
from clusterscale.runtime.kmeans_core import fit_spherical_kmeans, nearest_centroid
from clusterscale.runtime.vector_search import TorchIPIndex, build_index, resolve, top_k, wants_gpus


def unit_rows(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_top_k_is_the_same_on_both_backends_with_ties_to_the_lower_row():
    base, queries = unit_rows(3000, 48, 0), unit_rows(700, 48, 1)
    base[11] = base[5]  # an exact duplicate: a tie whatever the rounding
    queries[0] = base[5]
    faiss_scores, faiss_rows = top_k(build_index(base, "faiss"), base, queries, 12)
    torch_scores, torch_rows = top_k(build_index(base, "torch"), base, queries, 12)
    np.testing.assert_array_equal(torch_rows, faiss_rows)
    np.testing.assert_array_equal(torch_scores, faiss_scores)
    assert faiss_rows[0, :2].tolist() == [5, 11]
    exact = queries.astype(np.float64) @ base.astype(np.float64).T  # the float64 truth, its order
    np.testing.assert_allclose(faiss_scores, np.take_along_axis(exact, faiss_rows, 1), rtol=0, atol=1e-7)
    assert (np.diff(faiss_scores, axis=1) <= 0).all()
    # fewer rows than k: the rest -1 / -inf; an index that finds fewer (IVF with one list probed) the same
    small_scores, small_rows = top_k(build_index(base[:3], "torch"), base[:3], queries[:2], 5)
    assert (small_rows[:, 3:] == -1).all() and np.isinf(small_scores[:, 3:]).all()
    assert sorted(small_rows[0, :3].tolist()) == [0, 1, 2]


def test_torch_index_searches_in_blocks_like_one_product(monkeypatch):
    from clusterscale.runtime import vector_search

    base, queries = unit_rows(500, 16, 2), unit_rows(301, 16, 3)
    whole = TorchIPIndex(base).search(queries, 7)
    monkeypatch.setattr(vector_search, "CPU_BLOCK_VALUES", (500 + 16) * 13)  # blocks of 13 queries
    blocks = TorchIPIndex(base).search(queries, 7)
    np.testing.assert_array_equal(blocks[1], whole[1])
    # float32 products agree to rounding: BLAS may sum a 2-row block in another order than a 301-row product (one
    # ulp on some CPUs); top_k rescores its candidates in float64, so what a stage keeps does not depend on it
    np.testing.assert_allclose(blocks[0], whole[0], rtol=0, atol=1e-6)


def test_backend_choice_follows_the_tasks_gpu_and_the_key():
    assert resolve("torch", gpu=False) == ("torch", "cpu")
    assert resolve("faiss", gpu=False) == ("faiss", "cpu")
    assert resolve("auto", gpu=False) == ("faiss", "cpu")  # no GPU in this task: today's CPU path
    assert not wants_gpus("auto", 0) and wants_gpus("auto", 8) and wants_gpus("torch", 8)
    with pytest.raises(config.ConfigError, match="one of auto, faiss, torch"):
        config.load(None, ["ray.vector_backend=cuda"])
    assert config.load(None, []).ray.vector_backend == "auto"


def test_assign_and_fit_are_the_same_on_torch():
    """fit's Lloyd steps and assign's nearest centroid: the same labels, cosines, centroids and objective."""
    from clusterscale.stages.kmeans import AssignBatches, build_assign_index

    x = unit_rows(4000, 32, 4)
    faiss_c, faiss_stats = fit_spherical_kmeans(x, 12, 6, 0, backend="faiss")
    torch_c, torch_stats = fit_spherical_kmeans(x, 12, 6, 0, backend="torch")
    np.testing.assert_array_equal(torch_c, faiss_c)
    assert abs(torch_stats["objective"] - faiss_stats["objective"]) <= 1e-4 * abs(faiss_stats["objective"])
    batch = pa.table({"emb": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 32)})
    out = {b: AssignBatches(build_assign_index(faiss_c, "flat", 1, b))(batch) for b in ("faiss", "torch")}
    for column in ("cluster", "cos"):
        np.testing.assert_array_equal(out["torch"].column(column).to_numpy(), out["faiss"].column(column).to_numpy())
    sims, labels = nearest_centroid(x, faiss_c, backend="torch")
    np.testing.assert_array_equal(labels, out["faiss"].column("cluster").to_numpy())


def test_mine_search_is_the_same_on_torch():
    """A search group's candidates (ids, scores, flags) for its routed queries."""
    from clusterscale.stages.mine_search import route_rows, search_cluster

    n, d = 1200, 24
    rng = np.random.default_rng(5)
    centroids = unit_rows(4, d, 6)
    cluster = rng.integers(0, 4, n)
    emb = centroids[cluster] + 0.3 * unit_rows(n, d, 7)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    emb_query = emb + 0.2 * unit_rows(n, d, 8)
    emb_query /= np.linalg.norm(emb_query, axis=1, keepdims=True)
    batch = pa.table({"pair_id": np.arange(n, dtype=np.int64) * 7, "query": [f"q{i}" for i in range(n)],
                      "passage": [f"p{i % 1100}" for i in range(n)],  # some duplicate passages
                      "emb": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), d),
                      "emb_query": pa.FixedSizeListArray.from_arrays(pa.array(emb_query.reshape(-1)), d),
                      "cluster": cluster.astype(np.int32)})
    routed = route_rows(batch, centroids, 2, True)
    mc = config.load(None, ["mine.range_max=20"]).mine
    for g in range(4):
        group = routed.filter(pa.compute.equal(routed.column("group"), g))
        found = {b: search_cluster(group, mc, 4, backend=b) for b in ("faiss", "torch")}
        assert found["torch"].equals(found["faiss"]), g
        assert found["faiss"].num_rows > 0


def test_evaluate_search_is_the_same_on_torch():
    from clusterscale.stages.evaluate import search

    pool, queries = unit_rows(900, 32, 9), unit_rows(150, 32, 10)
    pool[7] = pool[3]
    assert search(queries, pool, 10, "torch") == search(queries, pool, 10, "faiss")


@pytest.mark.parametrize("rule", ["easy", "hard", "random"])
def test_dedup_is_the_same_on_torch(rule):
    """dedup's semantic pass whole and in chunks (the split clusters' chain), and its held-out matches: the torch
    products (float32 on torch, near-threshold entries in float64) keep and remove the same rows and name the same
    duplicate with the same similarity (to an ulp of float64), whatever the keep rule's order."""
    from clusterscale.runtime import dedup_core as core

    rng = np.random.default_rng({"easy": 11, "hard": 12, "random": 13}[rule])
    base = unit_rows(120, 32, 14)
    x = base[rng.integers(0, 120, 900)] + 0.04 * unit_rows(900, 32, 15)  # many near duplicates
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    cos = rng.random(900)
    x = x[core.keep_order(np.arange(900), core.keep_rank(np.arange(900), cos, rule, 0))].astype(np.float32)
    threshold, torch_products = 0.97, core.Products(0.97, "cpu")
    numpy_out = core.semantic_greedy(x, threshold, 64)
    torch_out = core.semantic_greedy(x, threshold, 64, products=torch_products)
    assert 50 < (~numpy_out[0]).sum() < 850
    np.testing.assert_array_equal(torch_out[0], numpy_out[0])
    np.testing.assert_array_equal(torch_out[1], numpy_out[1])
    removed = ~numpy_out[0]
    # the removed rows' similarity: float64 on both, summed in another order (einsum, BLAS): equal to an ulp
    np.testing.assert_allclose(torch_out[2][removed], numpy_out[2][removed], rtol=1e-12, atol=0)
    # the chunked chain (raise_best + semantic_greedy with a prior), as blocks.decide_chunk runs it
    kept_before, chunked = [], np.zeros(900, bool)
    for start in range(0, 900, 200):
        rows = np.arange(start, min(900, start + 200))
        prior = np.full(len(rows), -np.inf), np.full(len(rows), -1, np.int64)
        for earlier in kept_before:
            core.raise_best(x[rows], x[earlier], earlier, threshold, 64, *prior,
                            products=core.Products(threshold, "cpu"))
        chunked[rows] = core.semantic_greedy(x[rows], threshold, 64, keys=rows, prior=prior,
                                             products=torch_products)[0]
        kept_before.append(rows[chunked[rows]])
    np.testing.assert_array_equal(chunked, numpy_out[0])
    held = x[rng.integers(0, 900, 40)] + 0.01 * unit_rows(40, 32, 16)
    held /= np.linalg.norm(held, axis=1, keepdims=True)
    on_numpy = core.heldout_matches(x, held, 64, core.Products(threshold, "numpy32"))
    on_torch = core.heldout_matches(x, held, 64, torch_products)
    hit = on_numpy[1] >= threshold
    assert hit.sum() > 10
    np.testing.assert_array_equal(on_torch[1] >= threshold, hit)
    np.testing.assert_array_equal(on_torch[0][hit], on_numpy[0][hit])
    np.testing.assert_allclose(on_torch[1][hit], on_numpy[1][hit], rtol=1e-12, atol=0)
    assert core.products_for("torch", False, threshold).device == "cpu"
    assert core.products_for("auto", False, threshold).device is None  # no GPU in this task: float64 numpy


WITHOUT_FAISS = r"""
import sys
sys.modules["faiss"] = None  # `import faiss` raises ImportError: a GPU node with torch and no faiss
import os

import numpy as np
from clusterscale.errors import UserError
from clusterscale.runtime.kmeans_core import fit_spherical_kmeans, nearest_centroid
from clusterscale.runtime.vector_search import resolve
from clusterscale.stages import dedup, evaluate, kmeans, mine, mine_search  # every stage that searches imports
x = np.load(sys.argv[1])
assert resolve("auto", gpu=False) == ("torch", "cpu"), resolve("auto", gpu=False)
centroids, _ = fit_spherical_kmeans(x, 5, 4, 0, backend="auto")
np.save(sys.argv[2], np.stack([nearest_centroid(x, centroids, backend="auto")[1], np.zeros(len(x), np.int64)]))
np.save(sys.argv[3], centroids)
try:
    resolve("faiss", gpu=False)
except UserError as e:
    print("REFUSED", e)
"""


@pytest.mark.integration
def test_without_faiss_auto_runs_on_torch_and_faiss_is_refused_by_name(tmp_path):
    """benchmarks/gpu_pipeline.sh's node has torch but no faiss: every stage imports, ray.vector_backend=auto searches
    on torch with faiss's results, and a forced faiss says what to install or set."""
    import subprocess
    import sys

    x = unit_rows(1500, 24, 9)
    np.save(tmp_path / "x.npy", x)
    done = subprocess.run([sys.executable, "-c", WITHOUT_FAISS, *(str(tmp_path / f) for f in
                                                                    ("x.npy", "labels.npy", "centroids.npy"))],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED" in done.stdout and "pip install faiss-cpu" in done.stdout and "vector_backend=torch" in done.stdout
    centroids, _ = fit_spherical_kmeans(x, 5, 4, 0, backend="faiss")
    np.testing.assert_array_equal(np.load(tmp_path / "centroids.npy"), centroids)
    np.testing.assert_array_equal(np.load(tmp_path / "labels.npy")[0], nearest_centroid(x, centroids)[1])


@pytest.mark.integration
def test_faiss_openblas_runs_the_kernels_this_cpu_has(tmp_path):
    """faiss-cpu's bundled OpenBLAS (0.3.15) takes an Ice Lake Xeon for a generic SSE3 CPU ("Prescott", ~5x slower
    searches): faiss_index tells it the kernels the CPU's flags support, during faiss's import only, and leaves a
    user's OPENBLAS_CORETYPE alone."""
    import subprocess
    import sys

    from clusterscale.runtime.faiss_index import openblas_coretype

    cpuinfo = tmp_path / "cpuinfo"
    for flags, expected in [("fpu sse2 avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl", "SkylakeX"),
                            ("fpu sse2 avx avx2 fma avx512f", "Haswell"), ("fpu sse2 avx", "Sandybridge"),
                            ("fpu sse2", None)]:
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
        assert openblas_coretype(str(cpuinfo)) == expected
    assert openblas_coretype(str(tmp_path / "absent")) is None
    pytest.importorskip("threadpoolctl")
    probe = ("import os; from clusterscale.runtime import faiss_index; from threadpoolctl import threadpool_info; "
             "print([i.get('architecture') for i in threadpool_info() if i.get('prefix') == 'libopenblas'], "
             "os.environ.get('OPENBLAS_CORETYPE'))")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    ours = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    expected = openblas_coretype()
    if expected:  # an x86 Linux CPU: its kernels, and nothing left in the environment for child processes
        assert ours.split() == [f"['{expected}']", "None"], ours
    users = subprocess.run([sys.executable, "-c", probe], env={**env, "OPENBLAS_CORETYPE": "Sandybridge"},
                           capture_output=True, text=True, check=True).stdout
    assert users.split() == ["['Sandybridge']", "Sandybridge"], users

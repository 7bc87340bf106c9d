"""The float64 rescoring of top_k on the index's own device (TorchIPIndex.top_k, and DeviceRescoredIndex for a
faiss-gpu index: a GPU node's mine, evaluate and assign then copy back only the k rows), against vector_search.top_k's
rescoring on the CPU, here with torch on the CPU. No Ray; faiss for the faiss-gpu wrapper's test only:
benchmarks/gpu_session.sh runs the GPU test on a lent GPU node, which has no faiss."""
from __future__ import annotations

import numpy as np
import pytest

from clusterscale.runtime import vector_search
from clusterscale.runtime.vector_search import DeviceRescoredIndex, TorchIPIndex, top_k


def unit_rows(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def cases() -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(base, queries, k): exact duplicates (a tie whatever the rounding), a base smaller than k, d of a real
    encoder."""
    base, queries = unit_rows(3000, 48, 0), unit_rows(700, 48, 1)
    base[11] = base[5]
    queries[0] = base[5]
    return [(base, queries, 12), (base[:3], queries[:9], 5), (base[:40], queries, 40),
            (unit_rows(2500, 384, 2), unit_rows(300, 384, 3), 30)]


def test_device_rescoring_gives_the_cpu_rescorings_rows_and_scores(monkeypatch):
    for base, queries, k in cases():
        expected = top_k(TorchIPIndex(base), base, queries, k)  # on a CPU: float32 search, numpy's float64 rescoring
        got = TorchIPIndex(base).top_k(queries, k)
        np.testing.assert_array_equal(got[1], expected[1])
        np.testing.assert_array_equal(got[0], expected[0])
    base, queries, k = cases()[0]
    assert got[1].dtype == np.int64 and got[0].dtype == np.float32
    assert TorchIPIndex(base).top_k(queries, k)[1][0, :2].tolist() == [5, 11]  # the tie: the lower row first
    small = TorchIPIndex(base[:3]).top_k(queries[:2], 5)
    assert (small[1][:, 3:] == -1).all() and np.isinf(small[0][:, 3:]).all()
    monkeypatch.setattr(vector_search, "CPU_BLOCK_VALUES", 1)  # one query per block: the same
    np.testing.assert_array_equal(TorchIPIndex(base).top_k(queries[:50], k)[1], top_k(TorchIPIndex(base), base,
                                                                                      queries[:50], k)[1])


def test_a_faiss_gpu_index_rescored_on_the_device_is_top_k(monkeypatch):
    """DeviceRescoredIndex around a faiss index (here a CPU one, torch on the CPU): flat, and IVF probing one list
    (fewer hits than k: -1 rows, -inf scores, last); the faiss index's own attributes and search pass through."""
    pytest.importorskip("faiss")
    from clusterscale.runtime.faiss_index import build_ip_index

    short = False
    for base, queries, k in cases():
        for kind in ("flat", "ivf"):
            index = build_ip_index(base, kind, nlist=min(8, len(base)), nprobe=1)
            expected = top_k(index, base, queries, k)
            wrapped = DeviceRescoredIndex(index, base, "cpu")
            got = top_k(wrapped, base, queries, k)
            np.testing.assert_array_equal(got[1], expected[1])
            np.testing.assert_array_equal(got[0], expected[0])
            short |= bool((got[1] == -1).any())
    assert short and wrapped.nprobe == 1 and wrapped.ntotal == len(base)
    np.testing.assert_array_equal(wrapped.search(queries, 3)[1], index.search(queries, 3)[1])
    monkeypatch.setattr(vector_search, "CPU_BLOCK_VALUES", 1)  # one query per block: the same
    np.testing.assert_array_equal(top_k(wrapped, base, queries[:40], k)[1], expected[1][:40])
    with pytest.raises(ValueError, match="pass the index's vectors"):  # the device path reads its own copy
        top_k(wrapped, base[:10], queries, k)


@pytest.mark.gpu
def test_gpu_top_k_is_the_cpu_top_k(monkeypatch):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    calls = []
    on_device = TorchIPIndex.top_k
    monkeypatch.setattr(TorchIPIndex, "top_k", lambda self, *a: calls.append(self.device.type) or on_device(self, *a))
    for base, queries, k in cases():
        expected = top_k(TorchIPIndex(base), base, queries, k)
        got = top_k(TorchIPIndex(base, "cuda"), base, queries, k)  # top_k hands a CUDA index its own top_k
        np.testing.assert_array_equal(got[1], expected[1])
        np.testing.assert_allclose(got[0], expected[0], rtol=0, atol=1e-7)  # float64 sums in the GPU's order
    assert calls == ["cuda"] * len(cases())  # the rescoring ran on the GPU, not on the CPU

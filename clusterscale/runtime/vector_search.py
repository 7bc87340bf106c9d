"""The vector math's backends (ray.vector_backend) and the exact top-k every stage's search goes through.

fit, assign, mine and evaluate search inner products: faiss (its CPU index, or its GPU one where faiss-gpu is
installed and the task has a GPU), or torch (a matmul and a top-k in blocks sized from the device's free memory, on
the task's GPU, else on its CPU: every GPU node has torch, few images have faiss-gpu). `auto` picks faiss-gpu, else
torch on a GPU, else faiss on the CPU; `faiss` and `torch` force one on whatever device the task has.

Two backends (or two BLAS libraries, or two CPU kinds) round float32 products differently in the last bits, so a
float32 search alone would flip near ties between them. `top_k` therefore searches k + RESCORE_MARGIN in float32 and
rescores those candidates in float64, ordering by (score descending, row ascending): every backend then returns the
same rows, scores and order, unless two candidates' float64 products differ by less than float32 rounding can move a
row across the margin (never seen; the suite compares the backends on every change). On a GPU both steps run there
(TorchIPIndex.top_k; a faiss-gpu index through DeviceRescoredIndex): the rescoring takes ~0.1 s per 4,096 queries of
34 candidates at d = 384 on one CPU core, many times a GPU's search of a mine group (benchmarks/gpu_check.py measures
both on a GPU node). The GPU sums the float64 products in another order than numpy: the same rows and order, and a
score one float32 step apart only where its float64 sum falls within ~1e-16 of a float32 rounding boundary (a few in a
billion). On a CPU the rescoring goes RESCORE_BLOCK_VALUES at a time: gathered rows that stay in cache.
"""
from __future__ import annotations

import functools

import numpy as np

from clusterscale.errors import UserError

BACKENDS = ("auto", "faiss", "torch")
RESCORE_MARGIN = 4  # candidates searched beyond k in float32 and ordered again in float64
GPU_MEMORY_FRACTION = 0.5  # of a GPU's free memory one search block's products may take
CPU_BLOCK_VALUES = 1 << 24  # one block's products on a CPU: 64 MiB of float32
RESCORE_BLOCK_VALUES = 1 << 20  # values of the candidates' rows gathered at once (4 MiB of float32: in cache)
GPU_RESCORE_BLOCK_VALUES = 1 << 27  # on a GPU beside a faiss index (512 MiB of float32: torch's cache keeps a block)


@functools.lru_cache(maxsize=1)
def torch_cuda() -> bool:
    """Whether torch is importable here and sees a CUDA GPU."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve(backend: str, gpu: bool) -> tuple[str, str]:
    """(library, device) for `backend` in a task that has a GPU (gpu: Ray gave it one) or not: ("faiss", "gpu"/"cpu")
    or ("torch", "cuda"/"cpu")."""
    from clusterscale.runtime.faiss_index import gpu_available, installed, require_faiss

    if backend not in BACKENDS:
        raise UserError(f"ray.vector_backend={backend!r} is not one of {', '.join(BACKENDS)}.")
    if backend == "torch":
        return "torch", "cuda" if gpu and torch_cuda() else "cpu"
    if gpu and gpu_available():
        return "faiss", "gpu"
    if backend == "auto" and gpu and torch_cuda():
        return "torch", "cuda"
    if backend == "auto" and not installed():  # a node with torch and no faiss (benchmarks/gpu_pipeline.sh's)
        return "torch", "cpu"
    require_faiss()
    return "faiss", "cpu"


def wants_gpus(backend: str, cluster_gpus: int) -> bool:
    """Whether a stage's vector tasks should ask Ray for GPUs: the cluster has some and the backend can use them
    (faiss only where this process's faiss has GPU support: the images install faiss-cpu; auto and torch always,
    every GPU node having torch). Decided from the cluster's resources, not the driver's devices."""
    from clusterscale.runtime.faiss_index import gpu_available

    if cluster_gpus <= 0:
        return False
    return backend != "faiss" or gpu_available()


class TorchIPIndex:
    """An exact inner-product index on torch with faiss's search API: search(x, k) -> (scores, rows), float32,
    rows -1 past the index's size. The vectors stay on the device; queries go in blocks whose vectors and (block x n)
    products fit GPU_MEMORY_FRACTION of the free GPU memory (CPU_BLOCK_VALUES on a CPU)."""

    def __init__(self, vectors: np.ndarray, device: str = "cpu"):
        import torch

        self.device = torch.device(device)
        self.x = torch.from_numpy(np.array(vectors, dtype=np.float32)).to(self.device)  # a copy: Arrow's are read-only
        self.ntotal, self.d = self.x.shape

    def _block_rows(self, extra: int = 0) -> int:
        """Queries per block: a query row takes its products, its own vector and `extra` float32 values."""
        return block_rows(self.device, self.ntotal + self.d + extra)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import torch

        q = np.ascontiguousarray(queries, dtype=np.float32)
        n, found = len(q), min(k, self.ntotal)
        scores = np.full((n, k), -np.inf, np.float32)
        rows = np.full((n, k), -1, np.int64)
        if not found:
            return scores, rows
        step = self._block_rows()
        with torch.no_grad():
            for start in range(0, n, step):
                block = torch.from_numpy(np.array(q[start:start + step])).to(self.device)
                top = torch.topk(block @ self.x.T, found, dim=1)
                scores[start:start + len(block), :found] = top.values.cpu().numpy()
                rows[start:start + len(block), :found] = top.indices.cpu().numpy()
        return scores, rows


    def top_k(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """vector_search.top_k on the device: k + RESCORE_MARGIN rows by float32 product, rescored there
        (rescore_on_device)."""
        import torch

        q = np.ascontiguousarray(queries, dtype=np.float32)
        wide = min(k + RESCORE_MARGIN, self.ntotal)
        step = self._block_rows(extra=3 * wide * self.d)  # the gathered candidates: float32, then float64
        return _blockwise(q, k, wide, step, lambda _, block: torch.topk(block @ self.x.T, wide, dim=1).indices,
                          self.x)


class DeviceRescoredIndex:
    """A faiss GPU index (faiss-gpu's flat or IVF) whose top_k rescores on the same GPU through torch, with a torch
    copy of its vectors: on the CPU the rescoring takes many times the GPU's search (module docstring). Every other
    attribute is read from the faiss index."""

    def __init__(self, index, vectors: np.ndarray, device: str = "cuda"):
        import torch

        self.index = index
        self.x = torch.from_numpy(np.array(vectors, dtype=np.float32)).to(torch.device(device))
        self.ntotal, self.d = self.x.shape

    def __getattr__(self, name: str):
        if name == "index":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.index, name)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.search(queries, k)

    def top_k(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """vector_search.top_k: k + RESCORE_MARGIN rows from faiss (-1 where an IVF index found fewer), rescored on
        the device (rescore_on_device), at most GPU_RESCORE_BLOCK_VALUES gathered values at a time."""
        import torch

        q = np.ascontiguousarray(queries, dtype=np.float32)
        wide = min(k + RESCORE_MARGIN, self.ntotal)
        step = min(block_rows(self.x.device, self.d + 3 * wide * self.d),  # a query, its candidates: float32, float64
                   max(1, GPU_RESCORE_BLOCK_VALUES // max(1, wide * self.d)))
        return _blockwise(q, k, wide, step, lambda queries, _: torch.from_numpy(
            self.index.search(queries, wide)[1]).to(self.x.device), self.x)


def block_rows(device, values_per_query: int) -> int:
    """Queries per block on a torch device: GPU_MEMORY_FRACTION of a GPU's free memory, CPU_BLOCK_VALUES on a CPU, in
    float32 values."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        values = int(free * GPU_MEMORY_FRACTION) // 4
    else:
        values = CPU_BLOCK_VALUES
    return max(1, values // max(1, values_per_query))


def _blockwise(q: np.ndarray, k: int, wide: int, step: int, candidates_of, x) -> tuple[np.ndarray, np.ndarray]:
    """top_k's (scores, rows) for queries q, `step` queries at a time: candidates_of(the block, the block on x's
    device) gives each query's `wide` candidate rows of x (-1: none), rescored by rescore_on_device."""
    import torch

    n, found = len(q), min(k, wide)
    scores = np.full((n, k), -np.inf, np.float32)
    rows = np.full((n, k), -1, np.int64)
    if not found:
        return scores, rows
    with torch.no_grad():
        for start in range(0, n, step):
            queries = np.array(q[start:start + step])
            block = torch.from_numpy(queries).to(x.device)
            best, best_rows = rescore_on_device(x, block, candidates_of(queries, block), found)
            scores[start:start + len(block), :found] = best.cpu().numpy()
            rows[start:start + len(block), :found] = best_rows.cpu().numpy()
    return scores, rows


def rescore_on_device(x, block, candidates, k: int):
    """_rescore with torch on the tensors' device: the k best of each query's `candidates` (rows of x, -1: none) by
    float64 product, ties to the lower row, -1 rows last; the same rows and scores as _rescore (products summed in
    another order may differ in float64's last bit: never across a float32 rounding in the suite)."""
    import torch

    valid = candidates >= 0
    exact = torch.bmm(x[torch.where(valid, candidates, 0)].double(), block.double().unsqueeze(2)).squeeze(2)
    exact = torch.where(valid, exact, -torch.inf)
    by_row = torch.argsort(torch.where(valid, candidates, torch.iinfo(torch.int64).max), dim=1, stable=True)
    order = by_row.gather(1, torch.argsort(-exact.gather(1, by_row), dim=1, stable=True))[:, :k]
    return exact.gather(1, order).float(), torch.where(valid, candidates, -1).gather(1, order)


def build_index(vectors: np.ndarray, backend: str = "faiss", gpu: bool = False, kind: str = "flat", nlist: int = 1,
                nprobe: int = 1):
    """An inner-product index over `vectors` on `backend` in a task with or without a GPU (resolve): faiss's (flat or
    IVF; build_ip_index; a GPU one in a DeviceRescoredIndex where torch sees the GPU), or torch's, which searches
    exactly whatever `kind` (IVF is faiss's way to be fast on a CPU)."""
    from clusterscale.runtime.faiss_index import build_ip_index

    library, device = resolve(backend, gpu)
    if library == "torch":
        return TorchIPIndex(vectors, device)
    index = build_ip_index(vectors, kind, nlist=nlist, nprobe=nprobe, use_gpu=device == "gpu")
    return DeviceRescoredIndex(index, vectors) if device == "gpu" and torch_cuda() else index


def top_k(index, base: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows) of each query's k best rows of `base` (which `index` holds, in order): k + RESCORE_MARGIN
    from the index in float32, rescored in float64 and ordered by (score descending, row ascending); scores are the
    float64 products rounded to float32. Rows -1 (score -inf) where the index returned fewer (IVF, a small base)."""
    if isinstance(index, DeviceRescoredIndex) or (isinstance(index, TorchIPIndex) and index.device.type == "cuda"):
        if len(base) != index.ntotal:
            raise ValueError(f"top_k: base has {len(base)} rows, the index {index.ntotal}: pass the index's vectors")
        return index.top_k(queries, k)  # base is the index's own vectors, on its GPU
    q = np.ascontiguousarray(queries, dtype=np.float32)
    wide = min(k + RESCORE_MARGIN, max(1, len(base)))
    _, rows = index.search(q, wide)
    scores, found = rescore(q, base, rows, k)
    if found.shape[1] < k:  # a base smaller than k
        pad = k - found.shape[1]
        scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
        found = np.pad(found, ((0, 0), (0, pad)), constant_values=-1)
    return scores, found


def rescore(q: np.ndarray, base: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """top_k's rescoring on the CPU: _rescore over blocks of RESCORE_BLOCK_VALUES gathered values; (n, min(k, wide))."""
    wide = rows.shape[1]
    scores, found = np.empty((len(q), min(k, wide)), np.float32), np.empty((len(q), min(k, wide)), np.int64)
    step = max(1, RESCORE_BLOCK_VALUES // max(1, wide * q.shape[1]))  # the gathered rows of a block
    for start in range(0, len(q), step):
        sl = slice(start, start + step)
        scores[sl], found[sl] = _rescore(q[sl], base, rows[sl], k)
    return scores, found


def _rescore(q: np.ndarray, base: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of `rows` (per query) by float64 product with q, ties to the lower row; -1 rows last."""
    valid = rows >= 0
    # float64 products of the float32 rows as gathered: einsum casts in its buffers, the same sums as a float64 copy
    # of the gathered rows, made first, gave (0.35 against 0.77 s per 24k queries of 34 rows at d = 384, one core)
    exact = np.einsum("nd,nmd->nm", q, base[np.where(valid, rows, 0)], dtype=np.float64)
    exact = np.where(valid, exact, -np.inf)
    order = np.lexsort((np.where(valid, rows, np.iinfo(np.int64).max), -exact), axis=1)[:, :k]
    return (np.take_along_axis(exact, order, axis=1).astype(np.float32),
            np.take_along_axis(np.where(valid, rows, -1), order, axis=1))

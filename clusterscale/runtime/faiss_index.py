"""The one faiss inner-product index builder (exact or IVF, on a GPU where faiss has GPU support).

Used by the k-means fit (nearest centroid per Lloyd step), assign (nearest centroid per row), mine
(nearest passages per query) and evaluate (retrieval over the pool).
"""
from __future__ import annotations

import functools

import numpy as np

from clusterscale.errors import UserError

try:
    import faiss
except ImportError:  # a GPU node with torch but no faiss: ray.vector_backend=auto (or torch) searches on torch there
    faiss = None

IVF_SEED = 1234  # the coarse quantizer's k-means: fixed, so an IVF index (and what it finds) is reproducible


def installed() -> bool:
    """Whether faiss is importable in this process."""
    return faiss is not None


def require_faiss():
    """The faiss module, or a UserError naming the two ways out."""
    if faiss is None:
        raise UserError("ray.vector_backend=faiss, but faiss is not installed in this Python: `pip install "
                        "faiss-cpu` (or faiss-gpu-cu12 on GPU nodes), or set ray.vector_backend=torch (or auto).")
    return faiss


def set_threads(threads: int) -> None:
    """faiss's OpenMP threads in this process (nothing to set where faiss is not installed)."""
    if faiss is not None:
        faiss.omp_set_num_threads(threads)


def gpu_available() -> bool:
    """True when this faiss was built with GPU support and sees a GPU."""
    return faiss is not None and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


@functools.lru_cache(maxsize=1)
def _gpu_resources():
    """One faiss GPU context per process (making one per search would allocate scratch memory each time)."""
    return faiss.StandardGpuResources()


def to_gpu(index: faiss.Index) -> faiss.Index:
    """`index` on GPU 0; a UserError with the install hint when this faiss has no GPU support."""
    if not gpu_available():
        raise UserError("A GPU index was requested but this faiss has no GPU support: "
                        "`pip install faiss-gpu-cu12` (or run on CPU).")
    return faiss.index_cpu_to_gpu(_gpu_resources(), 0, index)


def build_ip_index(vectors: np.ndarray, kind: str = "flat", nlist: int = 1, nprobe: int = 1,
                   use_gpu: bool = False) -> faiss.Index:
    """An inner-product index holding `vectors` (rows in order): exact ('flat') or 'ivf' with `nlist`
    lists searched `nprobe` at a time (faster, approximate)."""
    faiss = require_faiss()
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    d = x.shape[1]
    if kind == "flat" or (kind == "ivf" and nlist <= 1):  # one list searched whole is exact search (and
        index = faiss.IndexFlatIP(d)                      # training it only makes faiss warn about few points)
    elif kind == "ivf":
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = IVF_SEED
        index.train(x)
        index.nprobe = min(nprobe, nlist)
    else:
        raise ValueError(f"index kind must be 'flat' or 'ivf', got {kind!r}")
    if use_gpu:
        index = to_gpu(index)
    index.add(x)
    return index

"""The one faiss inner-product index builder (exact or IVF, on a GPU where faiss has GPU support).

Used by the k-means fit (nearest centroid per Lloyd step), assign (nearest centroid per row), mine
(nearest passages per query) and evaluate (retrieval over the pool).
"""
from __future__ import annotations

import functools
import os

import numpy as np  # before faiss's OpenBLAS is set up below: numpy's own BLAS then keeps its own choice

from clusterscale.errors import UserError

# The OpenBLAS kernels a CPU with these flags runs, most capable first. faiss-cpu's wheels bundle an OpenBLAS (0.3.15
# in faiss-cpu 1.15) that does not know newer CPUs (Ice Lake and Sapphire Rapids servers, Zen 4) and falls back to
# its generic SSE3 kernels ("Prescott"): every faiss search and k-means step then runs ~5x slower (a flat search of
# 20k x 6k vectors, d = 384, on one core: 7.0 s as Prescott, 1.4 s as SkylakeX on an Ice Lake Xeon).
OPENBLAS_KERNELS = (("SkylakeX", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
                    ("Haswell", {"avx2", "fma"}), ("Sandybridge", {"avx"}))


def openblas_coretype(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The OpenBLAS kernel set this (x86 Linux) CPU's flags support (OPENBLAS_KERNELS), None elsewhere."""
    try:
        with open(cpuinfo) as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return None
    return next((name for name, needs in OPENBLAS_KERNELS if needs <= flags), None)


def _import_faiss():
    """faiss, its bundled OpenBLAS told which kernels this CPU runs (OPENBLAS_CORETYPE, read once when that library
    loads; only during the import, so numpy's BLAS and child processes keep their own detection). A user's
    OPENBLAS_CORETYPE is left as it is."""
    coretype = None if "OPENBLAS_CORETYPE" in os.environ else openblas_coretype()
    if coretype:
        os.environ["OPENBLAS_CORETYPE"] = coretype
    try:
        import faiss as module
    except ImportError:  # a GPU node with torch but no faiss: ray.vector_backend=auto (or torch) searches on torch
        return None
    finally:
        if coretype:
            del os.environ["OPENBLAS_CORETYPE"]
    return module


faiss = _import_faiss()

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

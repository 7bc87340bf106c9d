"""The benchmarks call the library's internals: a refactor that breaks them must fail here, not months later."""
from __future__ import annotations

import importlib.util
import os

import numpy as np

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_kmeans_ray_fit_runs_and_equals_the_core(ray_local):
    """bench_kmeans's Ray arm on 2 actors gives the in-process core's centroids bit for bit."""
    bench = load("bench_kmeans")
    x, _ = bench.clustered_unit_vectors(600, 16, 8, seed=0)
    centroids, seconds = bench.ray_fit(x, 8, 3, 0, 2, 2)
    core, _ = bench.fit_spherical_kmeans(x, 8, 3, 0)
    assert seconds > 0 and np.array_equal(centroids, core)

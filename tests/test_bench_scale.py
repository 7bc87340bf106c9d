"""benchmarks/bench_scale.py's sampler: it sees the command's whole process tree and each process's own memory."""
from __future__ import annotations

import pytest

import importlib.util
import os
import subprocess
import sys
import time

SPEC = importlib.util.spec_from_file_location(
    "bench_scale", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                "bench_scale.py"))
bench_scale = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench_scale)

# A parent that starts a child holding 200 MB of private memory, then both wait a little.
CHILD = "import time; x = bytearray(200 * 1024 * 1024); time.sleep(1.5)"
PARENT = f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {CHILD!r}]); p.wait()"


@pytest.mark.integration
def test_sampler_sees_the_child_and_counts_its_private_memory():
    proc = subprocess.Popen([sys.executable, "-c", PARENT])
    with bench_scale.TreeSampler(proc.pid, interval=0.05) as sampler:
        proc.wait()
        time.sleep(0.1)
    summary = sampler.summary()
    assert summary["samples"] > 5
    assert 190 <= summary["ray_other_peak_uss_mb"] < 260  # the child, not a Ray process: kind ray_other
    assert summary["driver_peak_uss_mb"] < 100            # the parent holds none of it
    assert summary["peak_uss_mb"] == summary["ray_other_peak_uss_mb"]
    assert summary["tree_peak_uss_mb"] >= summary["ray_other_peak_uss_mb"] + summary["driver_peak_uss_mb"] - 1


@pytest.mark.integration
def test_sampler_counts_the_bytes_the_tree_writes_and_reads(tmp_path):
    """bytes_moved_per_row's numerator: the child writes then reads back 40 MB; the tree's rchar + wchar hold both."""
    path = str(tmp_path / "blob")
    child = (f"import time; open({path!r}, 'wb').write(bytes(40 * 1024 * 1024)); "
             f"open({path!r}, 'rb').read(); time.sleep(1.0)")
    parent = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}]).wait()"
    proc = subprocess.Popen([sys.executable, "-c", parent])
    with bench_scale.TreeSampler(proc.pid, interval=0.05) as sampler:
        proc.wait()
    summary = sampler.summary()
    assert 80 * 1024 * 1024 <= summary["tree_io_chars"] < 200 * 1024 * 1024
    entry = bench_scale.stage_entry([10, 40], [{**summary, "stage_wall_s": 1.0, "peak_anon_mb": 1,
                                                "driver_peak_uss_mb": 1, "worker_peak_uss_mb": 1}] * 2)
    assert entry["bytes_moved_per_row"][0] == round(summary["tree_io_chars"] / 10, 1) and entry["bytes_growth"] == 0.25

"""`clusterscale plan` on hostile input (issue 55): numbers out of range and malformed cluster files are user faults
(exit 2, one `error:` line naming the flag or the file's key path, no traceback), and a plan's memory does not grow
with N or k (cluster sizes are a bounded multiset, plan/sizes.py). No Ray."""
from __future__ import annotations

import dataclasses
import json
import re
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale import cli, config
from clusterscale.io.layout import row_group_rows_for
from clusterscale.plan import sizes
from clusterscale.plan.shape import RunShape, group_sizes, shard_files, shard_sizes, train_shape
from clusterscale.train import schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_fault(code: int, err: str) -> None:
    """Exit 2 with one `error:` paragraph and no traceback."""
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv, said", [
    (["--rows", "1000", "--k", "99999999999"], "--k 99,999,999,999 is more clusters than the 1,000 pairs planned"),
    (["--rows", "1000", "--set", "cluster.k=5000"], "cluster.k 5,000 is more clusters than the 1,000 pairs"),
    (["--rows", "1000000000000000000"], "--rows must be a number of pairs from 1 to 1,000,000,000,000,000; got "
                                        "1,000,000,000,000,000,000."),
    (["--rows", "-5"], "--rows must be a number of pairs from 1 to"),
    (["--rows", "1000", "--k", "0"], "--k must be a number of clusters from 1 to"),
    (["--rows", "1000", "--k", ",".join(str(k) for k in range(1, 70))], "--k lists 69 cluster counts; a plan takes "
                                                                        "at most 64"),
    (["--rows", "1000", "--gpus", "-4", "--gpu-type", "H100"], "--gpus must be a whole number of GPUs from 1 to "
                                                               "1,000,000; got -4."),
    (["--rows", "1000", "--gpus", "0", "--gpu-type", "H100"], "--gpus must be a whole number of GPUs from 1"),
    (["--rows", "1000", "--nodes", "0"], "--nodes must be a whole number of nodes from 1 to 100,000; got 0."),
    (["--rows", "1000", "--imbalance", "nan"], "--imbalance must be an imbalance factor from 1 to 1,000; got nan."),
    (["--rows", "1000", "--imbalance", "0.5"], "--imbalance must be an imbalance factor from 1 to 1,000; got 0.5."),
    (["--rows", "1000", "--price-per-gpu-hour", "-1"], "--price-per-gpu-hour must be from 0 to 1,000,000; got -1."),
    (["--rows", "1000", "--price-per-gpu-hour", "inf"], "--price-per-gpu-hour must be from 0 to 1,000,000; got inf."),
])
def test_numbers_out_of_range_are_user_faults(argv, said, capsys):
    code, out, err = _plan(capsys, *argv)
    _user_fault(code, err)
    assert said in err and not out


def test_rows_in_exponent_form_and_gpus_left_idle_by_train_use_gpu(capsys):
    """--rows takes 1e9 (the whole number it means, not argparse's refusal); a cluster with GPUs planned with
    train.use_gpu=false says that training is planned on its CPUs, and how to plan it on the GPUs."""
    code, out, err = _plan(capsys, "--rows", "1e9", "--k", "1000", "--gpus", "8", "--gpu-type", "H100")
    assert code == 0, err
    assert "Plan: 1,000,000,000 pairs" in out
    assert "train.use_gpu is false: training is planned on the cluster's CPUs, not its 8 GPUs" in out
    code, out, err = _plan(capsys, "--rows", "1e9", "--k", "1000", "--gpus", "8", "--gpu-type", "H100",
                           "--set", "train.use_gpu=true")
    assert code == 0 and "train.use_gpu is false" not in out, err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", "--rows", "1.5"])
    assert exit_.value.code == 2 and "'1.5' is not a whole number of rows" in capsys.readouterr().err


def test_calibrate_rows_out_of_range_is_a_user_fault_before_any_timing(capsys):
    code, _, err = _plan(capsys, "--calibrate", "--calibrate-rows", "25000,0")
    _user_fault(code, err)
    assert "--calibrate-rows must be a number of pairs from 1,000 to 10,000,000; got 0." in err


LAUNCHER = """\
available_node_types:
  head:
    resources: {"CPU": 0}
    node_config: {InstanceType: m6i.4xlarge}
  gpu_worker:
    max_workers: 4
    node_config:
      InstanceType: p5.48xlarge
      BlockDeviceMappings:
        - {DeviceName: /dev/sda1, Ebs: {VolumeSize: 500}}
head_node_type: head
"""
KUBERAY = """\
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: runs}
---
apiVersion: ray.io/v1
kind: RayCluster
spec:
  workerGroupSpecs:
    - groupName: gpu
      maxReplicas: 4
      template:
        spec:
          containers:
            - name: ray-worker
              resources:
                requests: {cpu: "64", memory: 512Gi, nvidia.com/gpu: 8}
"""


@pytest.mark.parametrize("content, said", [
    # the file: a list where the launcher has a mapping of node types
    ("available_node_types:\n  - name: head\n  - name: worker\nhead_node_type: head\n",
     ": available_node_types is [{'name': 'head'}, {'name': 'worker'}], expected a mapping"),
    (LAUNCHER.replace("    node_config:\n      InstanceType: p5.48xlarge\n",
                      "    node_config: p5.48xlarge\n    other:\n"),
     ": available_node_types.gpu_worker.node_config is 'p5.48xlarge', expected a mapping"),
    (LAUNCHER.replace("max_workers: 4", "max_workers: four"),
     ": available_node_types.gpu_worker.max_workers is 'four', expected a whole number from 0 to 100,000"),
    (LAUNCHER.replace("max_workers: 4", "max_workers: -1"), "gpu_worker.max_workers is -1, expected a whole number"),
    (LAUNCHER.replace("max_workers: 4", "max_workers: 0"), "its worker node type has max_workers 0"),
    (LAUNCHER.replace("VolumeSize: 500", "VolumeSize: big"),
     ": available_node_types.gpu_worker.node_config.BlockDeviceMappings[0].Ebs.VolumeSize is 'big', expected a number"),
    (LAUNCHER.replace("        - {DeviceName: /dev/sda1, Ebs: {VolumeSize: 500}}", "          DeviceName: sda1"),
     "gpu_worker.node_config.BlockDeviceMappings is {'DeviceName': 'sda1'}, expected a list"),
    (LAUNCHER.replace('resources: {"CPU": 0}', 'resources: {"CPU": zero}'),
     "available_node_types.head.resources.CPU is 'zero', expected a number"),
    (LAUNCHER.replace("InstanceType: p5.48xlarge", "InstanceType: [p5]"),
     "gpu_worker.node_config.InstanceType is ['p5'], expected an instance type name"),
    (LAUNCHER.replace("gpu_worker:\n", "gpu_worker: 3\n  unused:\n"), "available_node_types.gpu_worker is 3, "
                                                                       "expected a mapping"),
    (KUBERAY.replace("512Gi", "lots"), ": spec.workerGroupSpecs[0].template.spec.containers[0].resources.requests."
                                       "memory is 'lots', expected a Kubernetes quantity"),
    (KUBERAY.replace('cpu: "64"', 'cpu: "nan"'), "resources.requests.cpu is 'nan', expected a Kubernetes quantity"),
    (KUBERAY.replace('cpu: "64"', 'cpu: "1e400"'), "resources.requests.cpu is '1e400', expected"),
    (KUBERAY.replace("maxReplicas: 4", "maxReplicas: 1.5"), ": spec.workerGroupSpecs[0].maxReplicas is 1.5, expected "
                                                            "a whole number"),
    (KUBERAY.replace("  workerGroupSpecs:\n", "  workerGroupSpecs: {groupName: gpu}\n  other:\n"),
     ": spec.workerGroupSpecs is {'groupName': 'gpu'}, expected a list"),
    (KUBERAY.replace("kind: RayCluster\nspec:\n", "kind: RayJob\nspec:\n  rayClusterSpec: [1, 2]\n"),
     ": spec.rayClusterSpec is [1, 2], expected a mapping"),
    ("", "is empty"),
    ("# only a comment\n---\n", "is empty"),
    ("available_node_types: [\n", "is not valid YAML"),
    (KUBERAY.replace("maxReplicas: 4", "maxReplicas: [4"), "(its YAML document 2, from line 5) is not valid YAML"),
    ("just some text\n", "is neither a Ray launcher config"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n"
                                                      for p, n in zip("abcdefg", "bcdefgh")),
     "stand for more than 10,000 values"),  # nested aliases (a billion laughs) are refused, not expanded
    ("available_node_types: {}\navailable_node_types: {}\n", "duplicate key"),
    ("---\n" * 70, "holds more than 64 YAML documents"),
])
def test_malformed_cluster_files_are_user_faults(tmp_path, capsys, content, said):
    path = tmp_path / "cluster.yaml"
    path.write_text(content)
    code, _, err = _plan(capsys, "--rows", "1000", "--cluster", str(path), "--gpu-type", "H100")
    _user_fault(code, err)
    assert said in err and str(path) in err


def test_unreadable_cluster_files_are_user_faults(tmp_path, capsys):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"available_node_types: {}\n\xff\xfe\x00")
    huge = tmp_path / "huge.yaml"
    huge.write_text("#" * (1 << 20) + "\n")
    for path, said in ((tmp_path / "missing.yaml", "does not exist"), (tmp_path, "is not a file"),
                       (binary, "is not UTF-8 text (byte 25"), (huge, "is larger than 1,048,576 bytes")):
        code, _, err = _plan(capsys, "--rows", "1000", "--cluster", str(path))
        _user_fault(code, err)
        assert said in err and str(path) in err


def test_wellformed_cluster_files_still_plan(tmp_path):
    """The test files above, unbroken, and the shipped ones, give the clusters they describe."""
    from clusterscale.plan.cluster import load_cluster

    (tmp_path / "launcher.yaml").write_text(LAUNCHER)
    (tmp_path / "kuberay.yaml").write_text(KUBERAY)
    launcher = load_cluster(str(tmp_path / "launcher.yaml"), None, None, None)
    assert (launcher.nodes, launcher.gpus, launcher.gpu_type, launcher.node_disk_bytes) == (4, 32, "H100", 500e9)
    kuberay = load_cluster(str(tmp_path / "kuberay.yaml"), None, "A100", None)
    assert (kuberay.nodes, kuberay.cpus_per_node, kuberay.gpus, kuberay.node_memory_bytes) == (4, 64, 32, 512 * 2**30)
    shared = KUBERAY.replace("requests: {", "requests: &worker {") + "                limits: *worker\n"
    (tmp_path / "shared.yaml").write_text(shared)  # kubectl's habit: limits that alias the requests
    assert dataclasses.replace(load_cluster(str(tmp_path / "shared.yaml"), None, "A100", None), source="") == \
        dataclasses.replace(kuberay, source="")
    for name in ("aws-gpu-cluster.yaml", "kuberay-raycluster.yaml", "kuberay-rayjob.yaml"):
        assert load_cluster(os.path.join(REPO, "cluster_configs", name), None, "H100", None).gpus >= 8


MEMORY_CHILD = textwrap.dedent("""
    import resource, sys
    from clusterscale import cli

    assert cli.main(["plan", "--rows", "1000", "--k", "8"]) == 0  # imports and the model's files: the footprint
    vm = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, vm + 2**30))
    sys.exit(cli.main(["plan", "--rows", str(10**15), "--k", "99999999999", "--set",
                       "train.cluster_weighting=uniform", "dedup.exact=true", "dedup.semantic_threshold=0.9",
                       "train.negatives_per_query=1"]))
""")


@pytest.mark.integration
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmSize from /proc")
def test_a_plan_at_k_1e11_and_1e15_rows_fits_in_1_gib_more_than_a_small_one(tmp_path):
    """k = 99,999,999,999 clusters over 10^15 pairs (every stage on, uniform cluster weighting) plans with at most
    1 GiB of address space beyond a plan of 1,000 pairs: one float per cluster alone would be 800 GB."""
    done = subprocess.run([sys.executable, "-c", MEMORY_CHILD], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Plan: 1,000,000,000,000,000 pairs (--rows) at k = 99,999,999,999" in done.stdout
    assert "in quantile bins beyond 65,536 clusters" in done.stdout and "Traceback" not in done.stderr


def _forced_exact(monkeypatch, rows: int, k: int, imbalance: float) -> sizes.SizeCounts:
    monkeypatch.setattr(sizes, "EXACT_ITEMS", 10 ** 7)
    exact = sizes.lognormal_sizes(rows, k, imbalance)
    monkeypatch.undo()
    return exact


@pytest.mark.parametrize("rows, k, imbalance", [(10 ** 9, 100_000, 1.5), (10 ** 8, 70_000, 3.0)])
def test_quantile_bins_give_the_plan_of_one_size_per_cluster(monkeypatch, rows, k, imbalance):
    """Beyond EXACT_ITEMS clusters the sizes are bins: the count, the total and the extremes are exact, and steps,
    leftover pairs and files within 0.5% of the plan made of one size per cluster."""
    binned, exact = sizes.lognormal_sizes(rows, k, imbalance), _forced_exact(monkeypatch, rows, k, imbalance)
    assert len(binned.sizes) < 20_000 < len(exact.sizes) or len(exact.sizes) < 20_000
    assert (binned.items, binned.total, binned.largest, binned.smallest) == (k, rows, exact.largest, exact.smallest)
    assert binned.imbalance_factor() == pytest.approx(exact.imbalance_factor(), rel=1e-3)
    for keys in (["train.global_batch_size=1024"], ["train.global_batch_size=4096", "shard.small_cluster_policy=pool"]):
        cfg = config.load(None, keys)
        plans = []
        for cluster_sizes in (binned, exact):
            shards = shard_sizes(cfg, RunShape(rows, rows, 0, k, 8, cluster_sizes, "test"))
            t = train_shape(cfg, shards)
            plans.append([t.steps_per_epoch, t.unused_pairs_per_epoch, shard_files(cfg, shards),
                          group_sizes(cfg, shards).groups, shards.items])
        assert plans[0] == pytest.approx(plans[1], rel=5e-3)


def test_uniform_weighting_leftovers_are_the_schedules_mean():
    """Beyond EXACT_SCHEDULE_STEPS the leftover pairs of uniform cluster weighting are a closed form: the mean of
    the train schedule's own seeded draws (over 30 seeds here)."""
    for rows, k, batch in ((60_000, 300, 64), (100_000, 50, 1024)):
        strata = sizes.lognormal_sizes(rows, k, 1.5)
        draws = [schedule.unused_pairs(strata.tolist(), batch, "clustered", seed, 0, "uniform",
                                       row_group_rows_for(batch)) for seed in range(30)]
        expected = sizes.expected_uniform_unused(strata, batch, row_group_rows_for(batch))
        assert expected == pytest.approx(np.mean(draws), rel=0.03)


def test_size_counts_median_and_extremes_are_numpys():
    values = [5, 1, 9, 9, 3, 0, 7, 7, 7, 2]
    counts = sizes.SizeCounts.of(values)
    assert (counts.items, counts.total, counts.smallest, counts.largest) == (10, 50, 0, 9)
    assert counts.median() == np.median(values) and sizes.SizeCounts.of(values[:-1]).median() == np.median(values[:-1])
    assert counts.largest_grown(4).tolist() == sorted([5, 1, 9, 13, 3, 0, 7, 7, 7, 2])
    assert sizes.equal_split(np.array([10, 7]), np.array([3, 7])).tolist() == [1] * 7 + [3, 3, 4]
    # a run's sizes scaled to N: each floor(n x N / total), the rest to its largest cluster (as before the multiset)
    base = np.array(values, dtype=np.float64)
    scaled = np.floor(base * 1003 / base.sum()).astype(np.int64)
    scaled[np.argmax(base)] += 1003 - scaled.sum()
    assert sizes.scaled_sizes(counts, 1003).tolist() == sorted(scaled.tolist())


def test_evaluate_is_planned_from_the_eval_set_not_the_held_out_split(tmp_path, capsys):
    """evaluate picks its queries in tasks (stages/eval_set.py): its encoder's work and memory, and the driver's, are
    the eval set's whatever data.heldout_fraction is (the plan once counted every held-out pair: a 44 GB encoder at 30% of 100M pairs)."""
    found = []
    for fraction in ("0.05", "0.5"):
        path = tmp_path / f"plan-{fraction}.json"
        code, _, err = _plan(capsys, "--rows", str(10**8), "--k", "1000", "--json", str(path),
                             "--set", f"data.heldout_fraction={fraction}")
        assert code == 0, err
        stage = json.loads(path.read_text())["stages"]["evaluate"]
        found.append((stage["wall_s"], stage["peak_task_mb"], stage["peak_driver_mb"]))
    assert found[0] == found[1] and found[0][1] < 100


def test_dedup_is_planned_no_faster_than_its_largest_cluster_on_one_cpu(tmp_path, capsys):
    """A cluster is decided by one chain of tasks (stages/dedup/blocks.py, in keep order): 64 times the CPUs cannot
    take the semantic pass below the largest cluster's own time (the plan once divided it by the CPUs)."""
    walls = []
    for nodes in (1, 64):
        path = tmp_path / f"plan-{nodes}.json"
        code, _, err = _plan(capsys, "--rows", str(10**8), "--k", "1000", "--gpus", str(8 * nodes), "--nodes",
                             str(nodes), "--gpu-type", "H100", "--json", str(path),
                             "--set", "dedup.semantic_threshold=0.9")
        assert code == 0, err
        walls.append(json.loads(path.read_text())["stages"]["dedup"]["wall_s"])
    assert walls[1] > 0.9 * walls[0]


def test_rows_of_compressed_and_arrow_inputs_are_counted_from_their_contents(tmp_path):
    """plan counted a .jsonl.gz's rows as the newlines of its compressed bytes (8,310 of 300,000 here, 1 of 37 for a
    small one), a Feather or Arrow stream's likewise: compressed text is counted decompressed, Arrow IPC files
    exactly (their batch headers), Arrow streams from their first batches."""
    import bz2
    import gzip
    import random

    import pyarrow as pa
    import pyarrow.feather as feather

    from clusterscale.plan.build import count_input_rows

    rng = random.Random(0)
    words = [f"w{i}" for i in range(3000)]
    rows = [{"q": " ".join(rng.choices(words, k=6)), "p": " ".join(rng.choices(words, k=rng.randint(10, 60)))}
            for _ in range(40_000)]
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(text))
    (tmp_path / "a.jsonl.bz2").write_bytes(bz2.compress(text))
    with pa.CompressedOutputStream(str(tmp_path / "a.jsonl.zst"), "zstd") as f:
        f.write(text)
    (tmp_path / "small.jsonl.gz").write_bytes(gzip.compress(text[:text.index(b"\n", 5000) + 1]))
    table = pa.Table.from_pylist(rows)
    feather.write_feather(table, str(tmp_path / "a.feather"), chunksize=4096)
    with pa.OSFile(str(tmp_path / "a.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as writer:
        writer.write_table(table, max_chunksize=1000)
    small_rows = text[:text.index(b"\n", 5000) + 1].count(b"\n")

    def counted(name: str) -> tuple[int, str]:
        return count_input_rows(config.load(None, [f"data.path={tmp_path / name}", "data.query_column=q",
                                                   "data.passage_column=p"]))
    assert counted("a.feather") == (40_000, "data.path (1 files, exact counts)")
    assert counted("small.jsonl.gz") == (small_rows, "data.path (1 files, exact counts)")
    # bz2 decodes whole blocks of 900 kB of text: a prefix's last, partial block counts no row (-10% here)
    for name, within in (("a.jsonl.gz", 0.05), ("a.jsonl.bz2", 0.15), ("a.jsonl.zst", 0.05), ("a.arrow", 0.05)):
        rows_counted, how = counted(name)
        assert abs(rows_counted - 40_000) < 40_000 * within and "a sample of each file" in how, (name, rows_counted)


def test_rows_of_a_text_file_whose_rows_grow_are_counted_along_it(tmp_path):
    """The first MiB alone made a file whose rows grow along it (sorted by length, or appended over time: passages
    of 20 words at its start, 60 at its end) look like 62,877 rows of 40,000: it is sampled at four places."""
    from clusterscale.plan.build import count_input_rows

    lines = [json.dumps({"q": f"query {i}", "p": "word " * (20 + i // 1000)}) + "\n" for i in range(40_000)]
    (tmp_path / "grow.jsonl").write_text("".join(lines))
    rows, how = count_input_rows(config.load(None, [f"data.path={tmp_path / 'grow.jsonl'}", "data.query_column=q",
                                                    "data.passage_column=p"]))
    assert abs(rows - 40_000) < 40_000 * 0.05 and "a sample of each file" in how, rows


def test_rows_of_a_pretty_printed_json_array_are_its_elements_not_its_lines(tmp_path):
    """A JSON array written with indent=2 spans 4 lines per element of {"q", "p"}: plan counted 159,985 rows of
    40,000. An array is counted by its elements' query keys; JSON lines still by their lines."""
    from clusterscale.plan.build import count_input_rows

    rows = [{"q": f"query {i}", "p": "word " * (10 + i % 50)} for i in range(40_000)]
    (tmp_path / "array.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "small.json").write_text(json.dumps(rows[:300], indent=2))
    for name, exact in (("array.json", False), ("small.json", True)):
        counted, how = count_input_rows(config.load(None, [f"data.path={tmp_path / name}", "data.query_column=q",
                                                           "data.passage_column=p"]))
        expected = 40_000 if name == "array.json" else 300
        assert abs(counted - expected) <= expected * 0.02, (name, counted)
        assert ("exact counts" if exact else "a sample of each file") in how, how


def test_plan_warns_when_ingest_would_stop_on_the_columns(tmp_path, capsys):
    """plan reads the first input file's first rows as ingest would: columns that are not the mapped ones are a
    warning that carries ingest's message and the --set that fits; rightly mapped columns are none."""
    path, out = tmp_path / "triplets.parquet", tmp_path / "plan.json"
    pq.write_table(pa.table({"anchor": [f"q {i}" for i in range(400)], "positive": [f"p {i}" for i in range(400)]}),
                   path)
    code, _, _ = _plan(capsys, "--set", f"data.path={path}", "--json", str(out))
    warnings = json.loads(out.read_text())["warnings"]
    assert code == 0 and warnings[0].startswith(f"ingest would stop: {path}: column(s) data.query_column='query'")
    assert "This file's names fit: --set data.query_column=anchor data.passage_column=positive." in warnings[0]
    code, _, _ = _plan(capsys, "--set", f"data.path={path}", "data.query_column=anchor",
                       "data.passage_column=positive", "--json", str(out))
    assert code == 0 and not any("ingest would stop" in w for w in json.loads(out.read_text())["warnings"])
    utf16 = tmp_path / "utf16.csv"  # a file ingest cannot read: stop, or skip it with data.bad_files=quarantine
    utf16.write_bytes(("query,passage\n" + "".join(f"q {i},p {i}\n" for i in range(400))).encode("utf-16"))
    for bad_files, action in (("error", "stop"), ("quarantine", "skip it (data.bad_files=quarantine)")):
        code, _, _ = _plan(capsys, "--set", f"data.path={utf16}", f"data.bad_files={bad_files}", "--json", str(out))
        assert code == 0 and json.loads(out.read_text())["warnings"][0].startswith(
            f"ingest would {action}: {utf16}: cannot be read as csv (this is not CSV text"), bad_files


def test_ingest_is_planned_no_faster_than_one_task_over_its_largest_file(tmp_path, capsys):
    """A JSON lines file no bigger than data.range_bytes is one task's: on a cluster of 768 CPUs, plan bounds ingest
    by that task and warns. The same rows as Parquet files are bound by a unit of data.rows_per_part rows (runs of row
    groups), and the file cut into byte ranges by a range's rows: neither is warned about."""
    rows = [{"query": f"what is thing {i}", "passage": f"thing {i} is an object"} for i in range(40_000)]
    (tmp_path / "one.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "parquet").mkdir()
    for part in range(8):
        pq.write_table(pa.Table.from_pylist(rows[part::8]), tmp_path / "parquet" / f"part-{part}.parquet",
                       row_group_size=1_000)
    shipped = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "plan_calibration.json")
    cluster = os.path.join(os.path.dirname(__file__), "..", "cluster_configs", "aws-gpu-cluster.yaml")
    out, plans = tmp_path / "plan.json", {}
    ranges = f"data.range_bytes={(tmp_path / 'one.jsonl').stat().st_size // 20 + 1}"  # 20 ranges of 2,000 rows
    for name, path, extra in (("one.jsonl", "one.jsonl", ()), ("parquet", "parquet", ()),
                              ("ranges", "one.jsonl", (ranges,)),
                              ("limited", "one.jsonl", (ranges, "data.limit=9000"))):
        code, _, _ = _plan(capsys, "--set", f"data.path={tmp_path / path}", "data.rows_per_part=2000", *extra,
                           "--calibration", shipped, "--cluster", cluster, "--json", str(out))
        assert code == 0
        plans[name] = json.loads(out.read_text())
    one, split, ranged = plans["one.jsonl"], plans["parquet"], plans["ranges"]
    unit = re.search(r"largest work unit \(([\d,]+) rows in one task", ranged["stages"]["ingest"]["time_from"])
    assert 1_900 <= int(unit.group(1).replace(",", "")) <= 2_100  # the file's rows counted in a sample
    assert not any(w.startswith("ingest: ") for w in ranged["warnings"])
    # under data.limit too, ingest reads the ranges the limit covers, in parallel
    assert unit.group(0) in plans["limited"]["stages"]["ingest"]["time_from"]
    assert "bound by its largest work unit (" in one["stages"]["ingest"]["time_from"]
    assert any(w.startswith("ingest: ") and "rows in one task" in w for w in one["warnings"])
    assert one["stages"]["ingest"]["wall_s"] > 2 * split["stages"]["ingest"]["wall_s"]
    assert "largest work unit (2,000 rows in one task" in split["stages"]["ingest"]["time_from"]  # 2 row groups
    assert not any(w.startswith("ingest: ") for w in split["warnings"])


def test_input_sizes_come_from_the_listing(tmp_path, monkeypatch):
    """count_input asks no store for the size of a file the listing already gave (one request per file saved on an
    object store)."""
    import pyarrow.fs as pafs

    from clusterscale.plan import build

    for i in range(3):
        (tmp_path / f"p{i}.jsonl").write_text("".join(json.dumps({"query": f"q {j}", "passage": f"p {j}"}) + "\n"
                                                      for j in range(50)))
    asked, local = [], pafs.LocalFileSystem()

    class Counting:
        def get_file_info(self, what):
            asked.append(what)
            return local.get_file_info(what)

        def __getattr__(self, name):
            return getattr(local, name)

    listing = build.find_input_files(config.load(None, [f"data.path={tmp_path}"]).data)
    monkeypatch.setattr(build, "find_input_files", lambda data: dataclasses.replace(listing, fs=Counting()))
    assert build.count_input(config.load(None, [f"data.path={tmp_path}", "data.range_bytes=500"]))[0] == 150
    assert not [what for what in asked if isinstance(what, str)], asked

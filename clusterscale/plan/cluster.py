"""The cluster a plan is made for: nodes, GPUs, CPUs, memory and disk, from a Ray launcher YAML, a KubeRay
manifest, `--gpus/--gpu-type/--nodes`, or this machine; and the GPU datasheet figures the plan falls back on."""
from __future__ import annotations

import math
import os
import re
import shutil
from dataclasses import dataclass, replace

from clusterscale.config import ConfigError, parse_yaml
from clusterscale.config.load import MAX_CONFIG_BYTES
from clusterscale.errors import bounded_repr
from clusterscale.train.metrics import GPU_PEAK_TFLOPS

GIB = 1024 ** 3
# What a cluster may hold (--gpus, --nodes and cluster files): far above any real cluster, low enough that every
# figure of a plan stays a plain number.
MAX_NODES = 100_000
MAX_GPUS = 1_000_000
MAX_GPUS_PER_NODE = 1024
MAX_CPUS_PER_NODE = 100_000
MAX_NODE_MEMORY_BYTES = 1024 ** 5  # 1 PiB
MAX_VOLUME_GB = 1_000_000

# Memory (GB) of the GPUs whose peak FLOP/s train/metrics.py knows (GPU_PEAK_TFLOPS, the one datasheet table).
GPU_MEMORY_GB = {"H200": 141, "H100": 80, "A100": 80, "L40S": 48, "L4": 24, "A10G": 24, "A10": 24, "V100": 32,
                 "T4": 16}
# What the cloud instance types of the shipped launcher configs hold (vCPUs, GiB memory, GPUs, GPU type).
INSTANCES = {
    "p5.48xlarge": (192, 2048, 8, "H100"), "p5e.48xlarge": (192, 2048, 8, "H200"),
    "p4d.24xlarge": (96, 1152, 8, "A100"), "p4de.24xlarge": (96, 1152, 8, "A100"),
    "g6.12xlarge": (48, 192, 4, "L4"), "m6i.4xlarge": (16, 64, 0, None),
}


def gpu_model(name: str | None) -> str | None:
    """The datasheet key of a GPU name (case-insensitive, e.g. h100 -> H100); an unknown name is an error."""
    if name is None:
        return None
    key = next((known for known in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True) if known in name.upper()), None)
    if key is None:
        raise ConfigError(f"--gpu-type {name!r} is not a GPU the planner knows: pass one of "
                          f"{', '.join(GPU_PEAK_TFLOPS)}.")
    return key


@dataclass(frozen=True)
class ClusterSpec:
    """Worker nodes of a cluster (the head's are left out when it runs no work, as the shipped configs do)."""

    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    gpu_type: str | None
    node_memory_bytes: float
    node_disk_bytes: float | None
    """Local disk of a node (None: unknown): the shuffle's spill files and a local run dir go there."""
    source: str

    @property
    def cpus(self) -> int:
        return self.nodes * self.cpus_per_node

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        gpu = f", {self.gpus_per_node} x {self.gpu_type}" if self.gpus_per_node else ""
        disk = f", {self.node_disk_bytes / 1e9:,.0f} GB disk" if self.node_disk_bytes else ""
        return (f"{self.nodes} node(s) of {self.cpus_per_node} CPUs{gpu}, {self.node_memory_bytes / GIB:,.0f} GiB"
                f"{disk} ({self.source})")


def this_machine() -> ClusterSpec:
    """The machine the command runs on, as one node with its CUDA GPUs (those of a model the planner knows)."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    gpus, gpu_type = local_gpus()
    return ClusterSpec(1, os.cpu_count() or 1, gpus, gpu_type, float(pages), float(shutil.disk_usage(".").free),
                       "this machine")


def local_gpus() -> tuple[int, str | None]:
    """(CUDA GPUs torch sees here, their datasheet key); (0, None) without torch, CUDA or a known model."""
    try:
        import torch
    except ImportError:
        return 0, None
    if not torch.cuda.is_available():
        return 0, None
    try:
        return torch.cuda.device_count(), gpu_model(torch.cuda.get_device_name(0))
    except ConfigError:  # a GPU without datasheet figures: planned as a CPU node
        return 0, None


class _Fields:
    """Typed reads of a cluster file's document: a wrong type or value anywhere is a ConfigError naming the file,
    the key path and what was expected."""

    def __init__(self, path: str):
        self.path = path

    def fault(self, where: str, value, expected: str) -> ConfigError:
        return ConfigError(f"--cluster {self.path}: {where} is {bounded_repr(value)}, expected {expected}. Fix the "
                           f"file, or pass --gpus G --gpu-type T --nodes M instead.")

    def mapping(self, parent: dict, key: str, where: str) -> dict:
        value = parent.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fault(f"{where}{key}", value, "a mapping (key: value lines)")
        return value

    def sequence(self, parent: dict, key: str, where: str) -> list:
        value = parent.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fault(f"{where}{key}", value, "a list (- item lines)")
        return value

    def entry(self, value, where: str) -> dict:
        if not isinstance(value, dict):
            raise self.fault(where, value, "a mapping (key: value lines)")
        return value

    def count(self, parent: dict, key: str, where: str, default: int, high: int) -> int:
        value = parent.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise self.fault(f"{where}{key}", value, f"a whole number from 0 to {high:,}")
        return value

    def number(self, parent: dict, key: str, where: str, default: float, high: float) -> float:
        value = parent.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
            raise self.fault(f"{where}{key}", value, f"a number from 0 to {high:,}")
        return float(value)

    def quantity(self, parent: dict, key: str, where: str, default, high: float) -> float:
        """A Kubernetes quantity: a number, or a string like 8, 500m, 32Gi, 1e3."""
        value = parent.get(key, default)
        number = _quantity(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
        if number is None or not 0 <= number <= high:
            raise self.fault(f"{where}{key}", value, f"a Kubernetes quantity from 0 to {high:,.0f} (e.g. 8, 500m, "
                                                     f"32Gi)")
        return number


def _key(name) -> str:
    return name if isinstance(name, str) and len(name) <= 60 else bounded_repr(name)


def _launcher(raw: dict, path: str) -> ClusterSpec:
    fields = _Fields(path)
    types = fields.mapping(raw, "available_node_types", "")
    head = raw.get("head_node_type")
    workers = []
    for name, spec in types.items():
        where = f"available_node_types.{_key(name)}."
        spec = fields.entry(spec, where[:-1])
        node_config = fields.mapping(spec, "node_config", where)
        instance = node_config.get("InstanceType")
        if instance is not None and not isinstance(instance, str):
            raise fields.fault(f"{where}node_config.InstanceType", instance, "an instance type name (text)")
        cpu = fields.number(fields.mapping(spec, "resources", where), "CPU", f"{where}resources.", 1, MAX_CPUS_PER_NODE)
        if name != head or cpu != 0:
            workers.append((name, spec, node_config, instance, where))
    if not workers:
        raise ConfigError(f"--cluster {path}: no worker node type under available_node_types.")
    name, spec, node_config, instance, where = max(workers, key=lambda w: INSTANCES.get(w[3], (0, 0, 0, None))[2])
    if instance not in INSTANCES:
        raise ConfigError(f"--cluster {path}: node type {_key(name)} is instance {bounded_repr(instance)}, which the "
                          f"planner does not know (known: {', '.join(INSTANCES)}): pass --gpus G --gpu-type T "
                          f"--nodes M instead.")
    cpus, mem_gib, gpus, gpu = INSTANCES[instance]
    nodes = fields.count(spec, "max_workers", where, fields.count(raw, "max_workers", "", 1, MAX_NODES), MAX_NODES)
    disk = 0.0
    for i, mapping in enumerate(fields.sequence(node_config, "BlockDeviceMappings", f"{where}node_config.")):
        at = f"{where}node_config.BlockDeviceMappings[{i}]"
        ebs = fields.mapping(fields.entry(mapping, at), "Ebs", f"{at}.")
        disk += fields.number(ebs, "VolumeSize", f"{at}.Ebs.", 0, MAX_VOLUME_GB) * 1e9
    return ClusterSpec(nodes, cpus, gpus, gpu, mem_gib * GIB, disk or None,
                       f"{os.path.basename(path)}: {nodes} x {instance}")


QUANTITY_UNITS = {"Ki": 1024, "Mi": 1024 ** 2, "Gi": GIB, "Ti": 1024 ** 4, "Pi": 1024 ** 5, "Ei": 1024 ** 6,
                  "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "m": 1e-3}


def _quantity(value) -> float | None:
    """A Kubernetes quantity's value (None: not one, or not finite)."""
    text, scale = str(value).strip(), 1.0
    for suffix, factor in QUANTITY_UNITS.items():  # the two-letter suffixes first
        if text.endswith(suffix) and len(text) > len(suffix):
            text, scale = text[:-len(suffix)], factor
            break
    try:
        number = float(text) * scale
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _kuberay(cluster: dict, path: str, gpu_type: str | None, where: str) -> ClusterSpec:
    """A RayCluster's spec (`where` names its key path: spec. or a RayJob's spec.rayClusterSpec.)."""
    fields = _Fields(path)
    groups = fields.sequence(cluster, "workerGroupSpecs", where)
    if not groups:
        raise ConfigError(f"--cluster {path}: a KubeRay manifest without {where}workerGroupSpecs.")
    at_group = f"{where}workerGroupSpecs[0]."
    group = fields.entry(groups[0], at_group[:-1])
    pod = fields.mapping(fields.mapping(group, "template", at_group), "spec", f"{at_group}template.")
    containers = fields.sequence(pod, "containers", f"{at_group}template.spec.") or [{}]
    at = f"{at_group}template.spec.containers[0]."
    container = fields.entry(containers[0], at[:-1])
    requests = fields.mapping(fields.mapping(container, "resources", at), "requests", f"{at}resources.")
    at = f"{at}resources.requests."
    gpus = int(fields.quantity(requests, "nvidia.com/gpu", at, 0, MAX_GPUS_PER_NODE))
    if gpus and not gpu_type:
        raise ConfigError(f"{path} asks for {gpus} GPUs per pod but does not say which: pass --gpu-type "
                          f"({', '.join(GPU_PEAK_TFLOPS)}).")
    nodes = (fields.count(group, "maxReplicas", at_group, 0, MAX_NODES)
             or fields.count(group, "replicas", at_group, 0, MAX_NODES) or 1)
    cpus = max(1, math.floor(fields.quantity(requests, "cpu", at, 1, MAX_CPUS_PER_NODE)))
    memory = fields.quantity(requests, "memory", at, 0, MAX_NODE_MEMORY_BYTES)
    return ClusterSpec(nodes, cpus, gpus, gpu_type if gpus else None, memory, None,
                       f"{os.path.basename(path)}: {nodes} pods")


# A line holding only `---` (or `...`) ends a YAML document: a KubeRay file may hold a Secret or a PVC first.
_DOCUMENT_END = re.compile(r"^(?:---|\.\.\.)[ \t\r]*(?:#.*)?(?:\n|\Z)", re.MULTILINE)
MAX_CLUSTER_DOCUMENTS = 64


def _cluster_document(path: str) -> dict:
    """The document of a cluster file that describes the cluster, read by the config's hardened YAML loader (with
    bounded aliases: manifests share resource maps)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"--cluster {path} cannot be read ({exc.strerror or exc}): pass a readable Ray launcher "
                          f"YAML or KubeRay manifest.") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"--cluster {path} is larger than {MAX_CONFIG_BYTES:,} bytes: a Ray launcher YAML or KubeRay "
                          f"manifest is a few KiB; check that it is the right file.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--cluster {path} is not UTF-8 text (byte {exc.start} is {data[exc.start:exc.start + 1]!r}): "
                          f"pass a Ray launcher YAML or KubeRay manifest.") from None
    ends = [m for _, m in zip(range(MAX_CLUSTER_DOCUMENTS), _DOCUMENT_END.finditer(text))]
    if len(ends) == MAX_CLUSTER_DOCUMENTS:
        raise ConfigError(f"--cluster {path} holds more than {MAX_CLUSTER_DOCUMENTS} YAML documents: a cluster file "
                          f"holds its RayCluster or RayJob and a few more; check that it is the right file.")
    documents, start = [], 0
    for number, end in enumerate([*ends, None], 1):
        source = f"--cluster {path}" if not ends else \
            f"--cluster {path} (its YAML document {number}, from line {text.count(chr(10), 0, start) + 1})"
        try:
            documents.append(parse_yaml(text[start:end.start() if end else len(text)], source, aliases=True))
        except ConfigError as exc:  # PyYAML's message spans lines (a snippet and a caret): one line of it
            raise ConfigError(" ".join(str(exc).split())) from None
        start = end.end() if end else start
    if all(d is None for d in documents):
        raise ConfigError(f"--cluster {path} is empty: pass a Ray launcher YAML (available_node_types) or a KubeRay "
                          f"manifest (kind: RayCluster/RayJob).")
    for document in documents:
        if isinstance(document, dict) and ("available_node_types" in document
                                           or str(document.get("kind", "")).startswith("Ray")):
            return document
    raise ConfigError(f"--cluster {path} is neither a Ray launcher config (available_node_types) nor a KubeRay "
                      f"manifest (kind: RayCluster/RayJob); a pipeline config such as scale-100m.yaml is the CONFIG "
                      f"argument, not --cluster.")


def load_cluster(path: str | None, gpus: int | None, gpu_type: str | None, nodes: int | None) -> ClusterSpec:
    """The cluster of --cluster (Ray launcher YAML or KubeRay RayCluster/RayJob), else of --gpus/--gpu-type/--nodes,
    else this machine; --gpu-type and --nodes also override what the file says."""
    gpu_type = gpu_model(gpu_type)
    if path:
        if not os.path.exists(path):
            raise ConfigError(f"--cluster {path} does not exist: pass a Ray launcher YAML or KubeRay manifest "
                              f"(see cluster_configs/).")
        if not os.path.isfile(path):
            raise ConfigError(f"--cluster {path} is not a file: pass a Ray launcher YAML or KubeRay manifest "
                              f"(see cluster_configs/).")
        raw = _cluster_document(path)
        if "available_node_types" in raw:
            spec = _launcher(raw, path)
        else:  # a RayJob nests its cluster under spec.rayClusterSpec
            top = _Fields(path).mapping(raw, "spec", "")
            nested = _Fields(path).mapping(top, "rayClusterSpec", "spec.")
            spec = _kuberay(nested or top, path, gpu_type, "spec.rayClusterSpec." if nested else "spec.")
        spec = replace(spec, gpu_type=gpu_type or spec.gpu_type, nodes=nodes or spec.nodes)
        if not spec.nodes:
            raise ConfigError(f"--cluster {path}: its worker node type has max_workers 0 (no worker nodes): set "
                              f"max_workers in the file, or pass --nodes M.")
        return spec
    if gpus is None and nodes is None:
        return this_machine()
    nodes = nodes or 1
    if gpus and not gpu_type:
        raise ConfigError("--gpus needs --gpu-type (" + ", ".join(GPU_PEAK_TFLOPS) + ").")
    if gpus and gpus % nodes:
        raise ConfigError(f"--gpus {gpus} is not a multiple of --nodes {nodes}: give the total over all nodes.")
    local = this_machine()
    per_node = (gpus or 0) // nodes
    # Without a file, a GPU node is taken as the shipped configs' p5-like node; a CPU node as this machine.
    cpus, mem = (INSTANCES["p5.48xlarge"][0], INSTANCES["p5.48xlarge"][1] * GIB) if per_node else (
        local.cpus_per_node, local.node_memory_bytes)
    return ClusterSpec(nodes, cpus, per_node, gpu_type if per_node else None, mem, None,
                       f"--gpus {gpus or 0} --nodes {nodes}" + (" (CPUs and memory of a p5.48xlarge node)"
                                                               if per_node else ""))

"""The cluster a plan is made for: nodes, GPUs, CPUs, memory and disk, from a Ray launcher YAML, a KubeRay
manifest, `--gpus/--gpu-type/--nodes`, or this machine; and the GPU datasheet figures the plan falls back on."""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, replace

import yaml

from clusterscale.config import ConfigError
from clusterscale.train.metrics import GPU_PEAK_TFLOPS

GIB = 1024 ** 3

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
    """The machine the command runs on, as one CPU node."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return ClusterSpec(1, os.cpu_count() or 1, 0, None, float(pages), float(shutil.disk_usage(".").free),
                       "this machine")


def _launcher(raw: dict, path: str) -> ClusterSpec:
    types = raw.get("available_node_types") or {}
    head = raw.get("head_node_type")
    workers = [(name, spec) for name, spec in types.items()
               if name != head or (spec.get("resources") or {}).get("CPU", 1) != 0]
    if not workers:
        raise ConfigError(f"{path}: no worker node type under available_node_types.")
    name, spec = max(workers, key=lambda w: INSTANCES.get((w[1].get("node_config") or {}).get("InstanceType"),
                                                          (0, 0, 0, None))[2])
    instance = (spec.get("node_config") or {}).get("InstanceType")
    if instance not in INSTANCES:
        raise ConfigError(f"{path}: node type {name} is instance {instance!r}, which the planner does not know "
                          f"(known: {', '.join(INSTANCES)}): pass --gpus G --gpu-type T --nodes M instead.")
    cpus, mem_gib, gpus, gpu = INSTANCES[instance]
    nodes = int(spec.get("max_workers", raw.get("max_workers", 1)))
    volumes = [(m.get("Ebs") or {}).get("VolumeSize") for m in (spec.get("node_config") or {}).get(
        "BlockDeviceMappings", [])]
    disk = sum(v for v in volumes if v) * 1e9 or None
    return ClusterSpec(nodes, cpus, gpus, gpu, mem_gib * GIB, disk, f"{os.path.basename(path)}: {nodes} x {instance}")


def _quantity(text, what: str, path: str) -> float:
    units = {"Ki": 1024, "Mi": 1024 ** 2, "Gi": GIB, "Ti": 1024 ** 4, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    text = str(text)
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * factor
    try:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise ConfigError(f"{path}: {what} {text!r} is not a Kubernetes quantity.") from None


def _kuberay(raw: dict, path: str, gpu_type: str | None) -> ClusterSpec:
    groups = (raw.get("spec") or {}).get("workerGroupSpecs") or []
    if not groups:
        raise ConfigError(f"{path}: a KubeRay manifest without spec.workerGroupSpecs.")
    group = groups[0]
    containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or [{}]
    requests = (containers[0].get("resources") or {}).get("requests") or {}
    gpus = int(_quantity(requests.get("nvidia.com/gpu", 0), "nvidia.com/gpu", path))
    if gpus and not gpu_type:
        raise ConfigError(f"{path} asks for {gpus} GPUs per pod but does not say which: pass --gpu-type "
                          f"({', '.join(GPU_PEAK_TFLOPS)}).")
    nodes = int(group.get("maxReplicas") or group.get("replicas") or 1)
    return ClusterSpec(nodes, max(1, math.floor(_quantity(requests.get("cpu", 1), "cpu", path))), gpus,
                       gpu_type if gpus else None, _quantity(requests.get("memory", 0), "memory", path), None,
                       f"{os.path.basename(path)}: {nodes} pods")


def _cluster_document(path: str) -> dict:
    """The document of a cluster file that describes the cluster (a KubeRay file may hold a Secret first)."""
    try:
        with open(path, "rb") as f:
            documents = [d for d in yaml.safe_load_all(f.read(1 << 20)) if isinstance(d, dict)]
    except yaml.YAMLError as exc:
        raise ConfigError(f"--cluster {path} is not valid YAML: {exc}") from None
    for document in documents:
        if "available_node_types" in document or str(document.get("kind", "")).startswith("Ray"):
            return document
    raise ConfigError(f"--cluster {path} is neither a Ray launcher config (available_node_types) nor a KubeRay "
                      f"manifest (kind: RayCluster/RayJob); a pipeline config such as scale-100m.yaml is the CONFIG "
                      f"argument, not --cluster.")


def load_cluster(path: str | None, gpus: int | None, gpu_type: str | None, nodes: int | None) -> ClusterSpec:
    """The cluster of --cluster (Ray launcher YAML or KubeRay RayCluster/RayJob), else of --gpus/--gpu-type/--nodes,
    else this machine; --gpu-type and --nodes also override what the file says."""
    gpu_type = gpu_model(gpu_type)
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"--cluster {path} does not exist: pass a Ray launcher YAML or KubeRay manifest "
                              f"(see cluster_configs/).")
        raw = _cluster_document(path)
        if "available_node_types" in raw:
            spec = _launcher(raw, path)
        else:  # a RayJob nests its cluster under spec.rayClusterSpec
            nested = (raw.get("spec") or {}).get("rayClusterSpec")
            spec = _kuberay({"spec": nested} if nested else raw, path, gpu_type)
        return replace(spec, gpu_type=gpu_type or spec.gpu_type, nodes=nodes or spec.nodes)
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

"""Actor sizing: a stage declares what each of its actors needs; this turns it into a pool size and Ray options.

The one place that reads `ray.cluster_resources()` (as NeMo Curator's stages declare Resources and its
backend sizes them). On a GPU cluster an actor takes `gpus` GPUs and one torch/faiss thread; on a CPU
cluster either a fixed number of CPUs each (`cpus`), or an equal share of the cluster's CPUs; never more than
one node holds (on 8 nodes of 32 CPUs an actor asks for at most 32, not 256).
"""
from __future__ import annotations

from dataclasses import dataclass

import ray


@dataclass(frozen=True)
class ClusterResources:
    """What the Ray cluster holds, read once per sizing decision."""

    cpus: int
    gpus: int
    nodes: int
    node_memory_bytes: float = 0.0
    """Ray's `memory` resource of the largest node (0: unknown)."""
    node_cpus: int = 0
    """CPUs of the node with the most (0: unknown, taken as `cpus`). One actor or rank never asks for more: Ray
    places an actor on one node, and a request no node can meet waits forever."""

    @classmethod
    def current(cls) -> ClusterResources:
        totals = ray.cluster_resources()
        alive = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        nodes = sum(1 for r in alive if r.get("CPU"))
        return cls(cpus=max(1, int(totals.get("CPU", 1))), gpus=int(totals.get("GPU", 0)), nodes=max(1, nodes),
                   node_memory_bytes=max((r.get("memory", 0.0) for r in alive), default=0.0),
                   node_cpus=max((int(r.get("CPU", 0)) for r in alive), default=0))

    @property
    def task_memory_bytes(self) -> float:
        """The memory of one single-CPU task when every CPU of the largest node runs one: its Ray `memory` / its
        CPUs (0: unknown)."""
        return self.node_memory_bytes / self.cpus_per_node

    @property
    def cpus_per_node(self) -> int:
        """The most CPUs one actor may ask for: the largest node's."""
        return max(1, min(self.node_cpus or self.cpus, self.cpus))


@dataclass(frozen=True)
class Resources:
    """What one actor of a stage needs, as the stage declares it."""

    cpus: float | None = None
    """CPUs per actor on a CPU-only cluster (its torch/faiss threads when >= 1); None: the cluster's CPUs
    shared equally by the actors (for actors that must all run at once, such as DDP ranks)."""
    gpus: float = 0.0
    """GPUs per actor where the cluster has GPUs; 0: the stage runs on CPUs only."""
    cpus_with_gpu: float | None = 1.0
    """CPUs reserved by each GPU actor; None: leave Ray's default."""
    memory_bytes: float | None = None
    """Heap memory each actor reserves (Ray's `memory`), capped at the largest node's; None: no request."""


@dataclass(frozen=True)
class ActorPlan:
    """How many actors a stage starts, the torch/faiss threads each uses, and their Ray options."""

    actors: int
    threads: int
    num_cpus: float | None
    num_gpus: float
    memory_bytes: float | None = None

    @property
    def on_gpu(self) -> bool:
        return self.num_gpus > 0

    @property
    def device(self) -> str:
        return "gpu" if self.on_gpu else "cpu"

    @property
    def options(self) -> dict:
        """Keyword options of `ray.remote(...).options` and of Ray Data's `map_batches`."""
        return ({"num_gpus": self.num_gpus} if self.on_gpu else {}) | (
            {"num_cpus": self.num_cpus} if self.num_cpus is not None else {}) | (
            {"memory": int(self.memory_bytes)} if self.memory_bytes else {})

    @property
    def resources_per_worker(self) -> dict:
        """The same request as Ray Train's `ScalingConfig(resources_per_worker=...)`."""
        return ({"GPU": self.num_gpus} if self.on_gpu else {}) | (
            {"CPU": self.num_cpus} if self.num_cpus is not None else {})


def plan_actors(need: Resources, max_actors: int = 0, work_units: int | None = None, cpu_actors: int = 0,
                use_gpu: bool | None = None, cluster: ClusterResources | None = None) -> ActorPlan:
    """Size a stage's actors from what each needs and what the cluster holds.

    max_actors: the stage's configured actor count (0 = automatic: one per `gpus` GPUs; on CPU one per
    `cpus` CPUs, or `cpu_actors` when given, or 1). work_units: never more actors than units of work.
    use_gpu: force the device (Ray Train's train.use_gpu; a GPU index only where faiss has GPU support);
    None = GPU actors when the stage takes GPUs and the cluster has some."""
    cluster = cluster or ClusterResources.current()
    if use_gpu is None:
        use_gpu = need.gpus > 0 and cluster.gpus > 0
    if use_gpu:
        actors = max_actors or max(1, int(cluster.gpus // (need.gpus or 1)))
        return ActorPlan(_clamp(actors, work_units), 1, need.cpus_with_gpu, need.gpus or 1)
    if need.cpus is not None:
        num_cpus = min(need.cpus, cluster.cpus_per_node)
        actors = max_actors or cpu_actors or max(1, int(cluster.cpus // num_cpus))
        memory = min(need.memory_bytes, cluster.node_memory_bytes or need.memory_bytes) if need.memory_bytes else None
        return ActorPlan(_clamp(actors, work_units), max(1, int(num_cpus)), num_cpus, 0, memory)
    actors = _clamp(max_actors or cpu_actors or 1, work_units)
    threads = max(1, min(cluster.cpus // actors, cluster.cpus_per_node))
    return ActorPlan(actors, threads, min(threads, cluster.cpus / actors), 0)


def _clamp(actors: int, work_units: int | None) -> int:
    return max(1, min(actors, work_units)) if work_units is not None else max(1, actors)

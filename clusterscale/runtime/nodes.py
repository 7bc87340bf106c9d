"""Which Ray nodes did a stage's work: each task or actor names its node with its results, the stage records the set.

A stage's done marker (RUN/<folder>/_DONE.json, stats `nodes`) and its cost record (report/costs.json, `num_nodes`)
say where the work ran, so a run on a multi-node cluster shows that its stages spread (tests/test_multinode.py).
Only the nodes of the attempt that finished are named: units reused from an earlier attempt name none.
"""
from __future__ import annotations

import itertools
import json
import os
import time
import warnings
from collections.abc import Iterable

import ray

NODE = "_node"  # the column (or result field) that carries the node id of the worker that made a row or unit


def this_node() -> str | None:
    """The Ray node id of the calling worker (hex); None outside Ray (a stage's core called directly)."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def node_stats(node_ids: Iterable[str | None]) -> dict:
    """The stats that record where a stage ran: `nodes` (sorted node ids; the done marker keeps the list) and
    `num_nodes` (a number, which the cost record keeps too)."""
    nodes = sorted({n for n in node_ids if n})
    return {"nodes": nodes, "num_nodes": len(nodes)}


def alive_nodes() -> dict[str, str]:
    """{node id: IP} of the nodes alive now ({} without a Ray connection)."""
    if not ray.is_initialized():
        return {}
    return {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes() if n.get("Alive")}


def lost_nodes(before: dict[str, str]) -> list[str]:
    """The nodes of `before` (alive_nodes() at a stage's start) that are gone now, as 'id (IP)'."""
    if not before or not ray.is_initialized():
        return []
    now = alive_nodes()
    return [f"{node} ({ip})" for node, ip in sorted(before.items()) if node not in now]


# How long a spread actor pool may take to start its first actors (model loads, runtime envs) before the stage fails
# with Ray Data's "Timed out while starting actors" (the cluster cannot place them).
POOL_START_TIMEOUT_S = 900


def nodes_with(resource: str) -> list[str]:
    """Ids of the alive nodes that offer `resource` ("CPU", "GPU"; sorted; [] without a Ray connection)."""
    if not ray.is_initialized():
        return []
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(resource))


def map_spread(method, fn, *, first_actors: int, on_gpu: bool = False, **kwargs) -> ray.data.Dataset:
    """`method(fn, **kwargs)` (a Dataset's map_batches or a grouped dataset's map_groups, with an actor pool of
    min_size `first_actors`) whose actors go one per CPU (on_gpu: GPU) node in turn, and whose units wait until the first
    `first_actors` are ready: every node then takes a share of the units from the first, and a node's loss costs only
    the units in flight there.

    Scheduling strategy SPREAD alone does not ensure it: it skips a node whose CPUs look busy at that moment (the
    leases of the stage before, the read or shuffle tasks that start with the pool), and Ray Data hands the units out
    as soon as ONE actor is ready, so a run of small units could all go to the actor that started first, on one node.
    Here each actor asks for its node (soft affinity: a node gone or unable to hold it ever sends it elsewhere), and
    once the first actors are ready together, each unit goes to the least busy one, so the first units go one to each.
    On one node the pool starts as before: nothing to spread, and the wait would serialise the pools' starts."""
    nodes = nodes_with("GPU" if on_gpu else "CPU")
    if first_actors < 2 or len(nodes) < 2:  # SPREAD, Ray Data's default (DataContext.scheduling_strategy): naming
        return method(fn, **kwargs)         # it would go through the deprecated ray_remote_args
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    turn = itertools.cycle(nodes)
    with warnings.catch_warnings():  # ray_remote_args_fn (an actor's own options) is marked deprecated since Ray 2.5x
        warnings.simplefilter("ignore", DeprecationWarning)
        ds = method(fn, ray_remote_args_fn=lambda: {"scheduling_strategy": NodeAffinitySchedulingStrategy(
            next(turn), soft=True)}, **kwargs)
    ds.context.wait_for_min_actors_s = POOL_START_TIMEOUT_S
    return ds


TEST_UNIT_DELAY_ENV = "CLUSTERSCALE_TEST_UNIT_DELAY"
"""Test hook (tests/test_multinode.py): the path of a JSON file {stage: seconds}; each unit of that stage (an embed
or assign unit, a dedup block, a shard group, a mine search group or bucket, a training step) waits that long first,
so that a test can remove a node between two units, and adds the line "<stage> <node id>" to the file's `.units`
sibling as it starts: which nodes have started how many units. Read by the workers, which inherit it from the node's
environment; unset, it costs one lookup."""


def unit_delay_for_tests(stage: str) -> None:
    path = os.environ.get(TEST_UNIT_DELAY_ENV)
    if not path:
        return
    try:
        with open(path) as f:
            delay_s = float(json.load(f).get(stage, 0))
    except (OSError, ValueError, AttributeError):  # no file (the test is not slowing anything now)
        return
    if delay_s > 0:
        with open(f"{path}.units", "a") as f:  # one short append: whole lines from every process of the machine
            f.write(f"{stage} {this_node()}\n")
    time.sleep(delay_s)

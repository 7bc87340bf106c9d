"""A multi-node Ray cluster on this machine for tests/test_multinode.py, run in a process of its own.

Ray's own multi-node test harness (ray.cluster_utils.Cluster): a head without CPU, and worker nodes of
CPUS_PER_WORKER CPUs each, every node a raylet of its own. It runs here, not in pytest's process, because Ray reads the auth mode once
per process: pytest's process may already hold a local Ray (token auth off or on), and the cluster must be started
and driven with token auth on (RAY_AUTH_MODE=token in this process's environment, the token of ~/.ray/auth_token).

Usage: python tests/multinode_cluster.py TEMP_DIR. Commands on stdin, one per line: `add` (one more worker node), `remove NODE_ID` (kill that node's raylet and workers at once: a lost spot node), `quit`. Each answer is one
line on stdout: `CLUSTER {json}`. The cluster stops when stdin closes.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PREFIX = "CLUSTER "
# Logical CPUs of a worker node. Two, not one: a stage's actor pool beside its Ray Data tasks on every node needs
# more than one (on 1-CPU nodes shard's writers stay on one node, or the shuffle's tasks would find no CPU).
CPUS_PER_WORKER = 2
# The GCS marks a node dead after health_check_failure_threshold failed checks health_check_period_ms apart (Ray's
# defaults: 5 x 3 s). A killed raylet refuses the checks at once (a slow one still has health_check_timeout_ms to
# answer), so 3 x 1 s finds a lost node in ~3 s instead of ~15 s: what each lost node costs a test that waits for Ray
# to notice it (tests/test_multinode.py loses one in each of five stages).
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
# The answers keep stdout; anything else this process writes there (Ray's own output) goes to stderr, so that the
# pipe the test reads only at its commands never fills up.
ANSWERS = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def say(**fields) -> None:
    print(PREFIX + json.dumps(fields), file=ANSWERS, flush=True)


def start_head(temp_dir: str):
    """The cluster with its head; the machine's default Ray address file is left as it was: Cluster writes its
    address to /tmp/ray/ray_current_cluster, where every `ray.init()` without an address on this machine would find
    it and join this cluster instead of starting its own (other tests, other users)."""
    from ray._private.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    address_file = Path(get_ray_address_file(None))
    before = address_file.read_text() if address_file.exists() else None
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "temp_dir": temp_dir,
                                                            "include_dashboard": False,
                                                            "_system_config": HEALTH_CHECKS})
    if before is None:
        address_file.unlink(missing_ok=True)
    else:
        address_file.write_text(before)
    return cluster


def main(temp_dir: str) -> None:
    cluster, workers = start_head(temp_dir), {}
    say(address=cluster.address)
    try:
        for line in sys.stdin:
            command, *args = line.split()
            if command == "add":
                node = cluster.add_node(num_cpus=CPUS_PER_WORKER)
                cluster.wait_for_nodes()
                workers[node.node_id] = node
                say(added=node.node_id)
            elif command == "remove":
                cluster.remove_node(workers.pop(args[0]), allow_graceful=False)
                say(removed=args[0])
            elif command == "quit":
                break
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

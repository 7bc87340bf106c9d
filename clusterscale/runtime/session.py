"""Connecting to Ray: a local instance (dashboard off or on loopback) or the cluster a job was submitted to."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import sys
import uuid
from collections.abc import Iterator

import ray

from clusterscale.config import ConfigError, RayConfig
from clusterscale.runtime import interrupt

# OpenMP wait policy for faiss on CPU (see faiss_runtime_env). _local_workers_inherit_env: init_ray started a local
# Ray (whose workers inherit this process's environment); _workers_have_omp_policy: every worker of this job has the
# policy (a local Ray's by inheritance, a joined cluster's from the job's runtime_env that init_ray sets).
OMP_POLICY = "PASSIVE"
_local_workers_inherit_env = False
_workers_have_omp_policy = False


def cluster_address(cfg: RayConfig) -> str | None:
    """Where to connect: ray.address, else the cluster of a submitted job (RAY_ADDRESS), else None (local)."""
    return cfg.address or os.environ.get("RAY_ADDRESS") or None


@contextlib.contextmanager
def _loopback_node_ip() -> Iterator[None]:
    """While a local Ray starts, make its node IP 127.0.0.1, so that its servers listen on loopback only.

    gcs_server, raylet, the agents and every worker bind to all interfaces (0.0.0.0/::) unless the node IP
    is a loopback address, and ray.init rewrites `_node_ip_address="127.0.0.1"` to the machine's routable
    IP unless Ray runs in its single-machine mode (its default on macOS/Windows). That mode is a constant
    read once at import from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER; it is set here in this process only, and
    only around ray.init, so nothing else (a later join of a cluster, child processes) sees it.
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 keeps Ray's own choice (all interfaces).
    """
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = os.environ.get(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR) == "1"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextlib.contextmanager
def _own_address_for_ray_processes() -> Iterator[None]:
    """While a local Ray starts, fix its GCS port and give its processes RAY_ADDRESS=127.0.0.1:<that port>.

    Ray's State API client, called without an address (Ray Train's PlacementGroupCleaner, a detached actor, asks it
    every second whether the run's controller lives), looks for a cluster by itself: RAY_ADDRESS, else the last
    `ray start` head of this machine, else the only gcs_server running here. Beside another local Ray (a second
    clusterscale command) it fails with "Found multiple active Ray instances" and a traceback; beside a `ray start`
    head it asks that other cluster, where the controller is unknown. A local Ray's workers inherit the environment
    of ray.init; this process's own is restored after it (a later init_ray must not join a stopped Ray). A port the
    user exported in RAY_GCS_SERVER_PORT is kept."""
    from ray._private.ray_constants import GCS_PORT_ENVIRONMENT_VARIABLE as GCS_PORT

    saved = {name: os.environ.get(name) for name in (GCS_PORT, "RAY_ADDRESS")}
    if not saved[GCS_PORT]:
        with socket.socket() as probe:  # a free port; the gcs_server binds it a moment later
            probe.bind(("127.0.0.1", 0))
            os.environ[GCS_PORT] = str(probe.getsockname()[1])
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{os.environ[GCS_PORT]}"
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# Lines of Ray's own library loggers that workers send to the driver over and over: Ray Train's placement-group
# cleaner warns every few seconds that the State API is unavailable when the dashboard is off (a local run), and
# every rank logs "Reporting training result ..." at each ray.train.report; the gcs_server logs "Failed to kill
# actor ... Socket closed" when Ray Data ends an actor pool whose actor already exited. The log files keep them.
WORKER_LOG_NOISE = re.compile(r"Failed to query Ray Train Controller actor state|Reporting training result \d+: "
                              r"|Failed to kill actor \w+, return status: Invalid: KillActor RPC failed")


def _drop_worker_log_noise() -> None:
    """Wrap the driver's printer of worker output so the WORKER_LOG_NOISE lines are not shown.

    Ray has no public hook for this; its printer is a named handler of a private dispatcher. If that changes,
    the lines simply show again (filtering them in the workers instead would need a runtime_env hook that costs
    ~0.5 s per worker process)."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    with dispatcher._lock:
        for i, (name, handler) in enumerate(dispatcher.handlers):
            if name == "ray_print_logs" and not getattr(handler, "drops_noise", False):
                def filtered(data: dict, _print=handler) -> None:
                    lines = [line for line in data.get("lines", []) if not WORKER_LOG_NOISE.search(line)]
                    if lines:
                        _print({**data, "lines": lines})
                filtered.drops_noise = True
                dispatcher.handlers[i] = (name, filtered)


def _is_loopback_address(address: str) -> bool:
    """Whether a Ray address (host:port, or a scheme://host:port) names this machine's loopback interface."""
    if address.startswith("ray://"):  # Ray Client: the server's node IP is its own business
        return False
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def _loopback_only(address: str) -> str | None:
    """The host:port of a Ray on this machine that listens on loopback only (started by init_ray, or by
    `ray start --node-ip-address=127.0.0.1`), or None for any other cluster.

    Ray rewrites a loopback address to the machine's routable IP before it connects; a Ray bound to loopback is
    not there, and the driver waits for it in vain. The opposite mistake fails too: a driver that forces its node
    IP to 127.0.0.1 finds no raylet registered at it on a cluster started with plain `ray start` (its nodes
    register at the routable IP). So ask the machine: does the port answer on the routable IP?"""
    if address == "auto":
        from ray._private.services import find_bootstrap_address

        address = find_bootstrap_address(None) or ""
    if not address or not _is_loopback_address(address):
        return None
    host_port = address.split("://", 1)[-1]
    try:
        port = int(host_port.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None
    from ray._private.services import node_ip_address_from_perspective

    routable = node_ip_address_from_perspective()
    if _is_loopback_address(f"{routable}:0"):
        return host_port
    try:
        socket.create_connection((routable, port), timeout=2).close()
        return None
    except OSError:
        return host_port


def _join_failed(address: str, exc: BaseException) -> ConfigError:
    source = "ray.address" if address != os.environ.get("RAY_ADDRESS") else "RAY_ADDRESS"
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return ConfigError(
        f"Could not join the Ray cluster at {address} ({source}): {reason}. Check that the cluster is up and "
        f"reachable from this machine (`ray status --address {address}`), and that this machine holds the "
        f"cluster's auth token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token). Every form Ray takes "
        f"works: host:port (loopback or the head's IP), auto, or ray://host:10001. To run on a local Ray "
        f"instead, unset RAY_ADDRESS and ray.address.")


def _check_reachable(address: str) -> None:
    """Fail at once on a host:port where nothing listens (Ray itself retries for minutes before it gives up)."""
    if address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except (OSError, ValueError) as exc:
        raise _join_failed(address, exc) from None


IDLE_WORKERS = 8  # idle worker processes a local Ray keeps for the next tasks (each ~100-200 MB)


def init_ray(cfg: RayConfig) -> None:
    """Start or join Ray once per process. Jobs submitted with `ray job submit` join via RAY_ADDRESS."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    address = cluster_address(cfg)
    kwargs = dict(address=address, logging_level=logging.WARNING, log_to_driver=True)
    loopback = address is None
    if address is not None:
        _check_reachable(address)
    if address is not None and (bound := _loopback_only(address)):
        kwargs.update(address=bound, _node_ip_address="127.0.0.1")
        loopback = True
    if address is not None and (job_env := omp_policy_runtime_env()):
        kwargs["runtime_env"] = job_env
    if address is None:  # a local instance: nothing listens beyond loopback unless asked
        # "local": a new instance of our own, never one found on this machine (ray.init() without an address
        # joins the Ray of /tmp/ray/ray_current_cluster, e.g. a `ray start` head someone else runs here).
        kwargs["address"] = "local"
        os.environ.setdefault("OMP_WAIT_POLICY", OMP_POLICY)  # inherited by the local workers
        # Ray Train sends each print of a rank both to stdout and to its root logger: every line twice.
        os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
        # Ray kills the idle workers beyond num_cpus after 1 s, so each Ray Data step started new processes that
        # imported pyarrow and Ray Data again (~1-2 s of CPU each): a 268-pair mine took 46-54 s, 34-35 s with 8
        # kept (raylet's RAY_num_workers_soft_limit, read when it starts; a value the user exported wins).
        os.environ.setdefault("RAY_num_workers_soft_limit", str(max(IDLE_WORKERS, cfg.num_cpus or os.cpu_count() or 1)))
        # Ray Train starts a PreemptionWatcher actor per training run to follow node drains (a cluster's spot reclaim
        # notice); a local Ray is one node that no autoscaler drains, and the actor's start held each training's
        # first step back ~1-3 s here (a value the user exported wins).
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        kwargs.update(num_cpus=cfg.num_cpus, include_dashboard=cfg.include_dashboard,
                      dashboard_host="127.0.0.1", _node_ip_address="127.0.0.1")
        from clusterscale.runtime.reaper import remove_orphaned_shuffle_files

        if removed := remove_orphaned_shuffle_files():  # a killed run's, when no Ray runs here
            print(f"[ray] removed the disk-shuffle files of {len(removed)} shuffles of killed runs from "
                  f"{os.path.dirname(removed[0])}", flush=True)
        if cfg.object_store_mib is not None:
            kwargs["object_store_memory"] = cfg.object_store_mib * 1024 * 1024
    for attempt in range(3 if address is None else 1):
        try:
            with _loopback_node_ip() if loopback else contextlib.nullcontext(), \
                    _own_address_for_ray_processes() if address is None else contextlib.nullcontext():
                ray.init(**kwargs)
            break
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this one
            if address is not None:
                ray.shutdown()
                raise _join_failed(address, exc) from None
            # Ray waits a fixed 30 s for a local raylet; on an overloaded machine that is not enough.
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
            print(f"[ray] the local Ray node did not start within Ray's 30 s (machine busy?); retrying "
                  f"({attempt + 2}/3)", flush=True)
            ray.shutdown()
    interrupt.reclaim_sigterm()  # ray.init set sys.exit on SIGTERM for this driver
    if address is None:
        _watch_local_ray()
    _drop_worker_log_noise()
    global _local_workers_inherit_env, _workers_have_omp_policy
    _local_workers_inherit_env = _workers_have_omp_policy = address is None
    if address is not None:  # set by this job's runtime_env, or by the job it was submitted in
        _workers_have_omp_policy = True
    ray_data_progress(sys.stdout.isatty())


_reapers: list = []  # the watchers of this process's local Rays (runtime/reaper.py); their pipes close with it


def _watch_local_ray() -> None:
    """Start the watcher that ends the local Ray's agents at once if this driver is killed (runtime/reaper.py)."""
    from ray._private.ray_constants import PROCESS_TYPE_RAYLET

    from clusterscale.runtime import reaper

    try:  # Ray's own record of the processes it started; without it, nothing to watch
        raylet_pid = ray._private.worker._global_node.all_processes[PROCESS_TYPE_RAYLET][0].process.pid
    except (AttributeError, KeyError, IndexError):
        return
    if (watcher := reaper.start(raylet_pid)) is not None:
        _reapers.append(watcher)


def ray_data_progress(on_terminal: bool) -> None:
    """Ray Data's bars on a terminal; elsewhere the stages' own progress lines (clusterscale.runtime.progress).

    Off a terminal Ray Data logs an 8-line status block every 10 s instead of bars; its one-time notice
    that bars are off and its per-dataset plan lines are dropped too (the full logs keep them)."""
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = on_terminal
    ctx.print_on_execution_start = on_terminal
    ctx.verbose_stats_logs = False
    logging.getLogger("ray.data._internal.progress").setLevel(logging.NOTSET if on_terminal else logging.ERROR)


def faiss_runtime_env() -> dict:
    """Ray runtime_env for actors that run faiss on CPU: OpenMP threads sleep between parallel regions.

    faiss-cpu's OpenMP threads otherwise spin after each search and compete with its OpenBLAS calls and
    the rest of the step: faiss.Kmeans on 2 cores ran 1.4x faster with OMP_WAIT_POLICY=PASSIVE (see
    benchmarks/RESULTS.md); torch embedding speed is unchanged by it. A value the user exported wins.
    Empty once init_ray started or joined Ray: every worker of the job has the policy then (a local Ray's
    workers inherit it, a cluster's get it from the job's runtime_env), and a runtime_env of their own would
    put these actors in a worker pool of their own, new processes on every node (~1-2 CPU-s each)."""
    if _workers_have_omp_policy:
        return {}
    return {"env_vars": {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", OMP_POLICY)}}


def omp_policy_runtime_env() -> dict:
    """The job-level runtime_env that gives a joined cluster's workers the OpenMP wait policy (faiss_runtime_env);
    empty when the job this driver was submitted in already sets OMP_WAIT_POLICY (Ray refuses a driver's
    runtime_env that repeats a key of the job's)."""
    injected = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if injected:
        try:
            job_env = (json.loads(injected).get("runtime_env") or {}).get("env_vars") or {}
        except (ValueError, AttributeError):
            job_env = {}
        if "OMP_WAIT_POLICY" in job_env:
            return {}
    return {"env_vars": {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", OMP_POLICY)}}


@ray.remote(num_cpus=0, max_retries=0)
def _sees(path: str) -> tuple[str, bool]:
    return ray.util.get_node_ip_address(), os.path.exists(path)


def cluster_can_add_nodes(alive: list[dict]) -> str:
    """Why this Ray cluster may start more nodes later ("" = it cannot, as far as Ray tells).

    An autoscaling cluster may have only its head up when a run starts (the shipped aws-gpu-cluster.yaml:
    head num_cpus 0, min_workers 0), so a probe over the nodes alive now proves nothing. Two signs: the
    alive nodes have no CPU and no GPU for the work (it can only run on nodes still to come), or the
    autoscaler reports configured node types (named worker types, not the per-node ones of a plain
    `ray start` cluster or a local instance)."""
    if not any(n.get("Resources", {}).get("CPU") or n.get("Resources", {}).get("GPU") for n in alive):
        return "its nodes alive now have no CPU or GPU (the work waits for worker nodes the autoscaler adds)"
    try:
        from ray.experimental.internal_kv import _internal_kv_get

        status = json.loads(_internal_kv_get("__autoscaling_status") or b"{}")
    except Exception:  # noqa: BLE001 - no autoscaler status (older Ray, or none running): nothing to tell
        return ""
    report = status.get("autoscaler_report") or {}
    types = {t for t in (report.get("node_type_mapping") or {}).values() if t and not t.startswith("node_")}
    return f"its autoscaler runs node types {sorted(types)}" if types else ""


_checked_run_dirs: set[str] = set()


def check_run_dir_shared(run, declared_shared: bool = False) -> None:
    """On a cluster, fail early when a local --run-dir is not the same folder on every node (once per run dir).

    Stages write from whichever node runs the work, so a folder on the head's own disk would scatter
    the run over the nodes. Object-store URIs are shared by construction and are not checked. A local
    Ray (started by this process) is one machine. On a cluster that can add nodes, the nodes of later
    are not there to probe: a local folder is refused unless `declared_shared` (ray.shared_run_dir).
    """
    if not run.is_local or run.uri in _checked_run_dirs or _local_workers_inherit_env or not ray.is_initialized():
        return
    alive = [n for n in ray.nodes() if n.get("Alive")]
    grows = "" if declared_shared else cluster_can_add_nodes(alive)
    if grows:
        raise ConfigError(
            f"--run-dir {run.uri} is a local folder, and this Ray cluster can add nodes ({grows}): nodes that "
            f"join later write their part of the run to their own disk. Use an object-store URI such as "
            f"s3://bucket/runs/name, or shared storage mounted at the same path on every node (NFS/EFS/"
            f"Filestore; the KubeRay manifests mount one at /mnt/runs) and set ray.shared_run_dir=true.")
    if len(alive) >= 2:
        _probe_nodes(run, alive)
    _checked_run_dirs.add(run.uri)


def _probe_nodes(run, alive: list[dict]) -> None:
    """Raise ConfigError unless every alive node sees a file the driver writes into the run directory."""
    probe = f".node-probe-{uuid.uuid4().hex}"
    run.write_text(probe, "written by the driver")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        refs = [_sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(run.path(probe)) for n in alive]
        blind = sorted(ip for ip, seen in ray.get(refs, timeout=300) if not seen)
    finally:
        run.remove(probe)
    if blind:
        raise ConfigError(
            f"--run-dir {run.uri} is a local folder that node(s) {', '.join(blind)} cannot see. Every node "
            f"writes part of the run: use shared storage mounted at the same path on every node (NFS/EFS/"
            f"Filestore; the KubeRay manifests mount one at /mnt/runs) or an object-store URI such as "
            f"s3://bucket/runs/name.")

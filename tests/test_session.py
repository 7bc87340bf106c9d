"""A local Ray started by clusterscale listens on loopback only."""
from __future__ import annotations

import pytest

import ipaddress


def listening_addresses(root_pid: int) -> list[tuple[str, str, int]]:
    """(process name, ip, port) of every listening inet socket in the process tree under root_pid."""
    import psutil  # vendored by ray; importable once ray is imported

    root = psutil.Process(root_pid)
    found = []
    for proc in [root] + root.children(recursive=True):
        try:
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.Error:  # a worker that exited meanwhile
            continue
        found += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return (mapped or address).is_loopback


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.0.2.2")


def test_local_ray_listens_on_loopback_only(ray_local):
    """gcs_server, raylet, the agents and the workers of init_ray's local Ray bind 127.0.0.1 (or ::1) only."""
    import os

    ray = ray_local
    assert ray.get(ray.remote(ray.util.get_node_ip_address).remote()) == "127.0.0.1"
    listeners = listening_addresses(os.getpid())
    assert len({name for name, _, _ in listeners}) >= 3, listeners  # the driver, gcs_server, raylet at least
    exposed = [entry for entry in listeners if not is_loopback(entry[1])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_driver_drops_rays_repeated_worker_noise(ray_local, capfd):
    """Ray Train's cleaner warning and the per-report line are not shown; other worker lines are."""
    import logging
    import time

    @ray_local.remote
    def speak():
        log = logging.getLogger("worker-noise-test")
        log.warning("Failed to query Ray Train Controller actor state. State API may be temporarily unavailable.")
        log.warning("Reporting training result 3: TrainingReport(checkpoint=None, metrics={})")
        log.warning("(gcs_server) gcs_actor_scheduler.cc:538: Failed to kill actor f950fc5b, return status: Invalid: "
                    "KillActor RPC failed for actor f950fc5b: RpcError: RPC error: Socket closed rpc_code: 14")
        log.warning("a real warning from a worker")

    ray_local.get(speak.remote())
    deadline, seen = time.time() + 20, ""
    while "a real warning from a worker" not in seen and time.time() < deadline:
        time.sleep(0.5)
        out, err = capfd.readouterr()
        seen += out + err
    assert "a real warning from a worker" in seen
    assert "Failed to query" not in seen and "Reporting training result" not in seen and "Failed to kill" not in seen


HEAD_ONLY = [{"Alive": True, "NodeID": "h", "Resources": {"CPU": 0.0, "memory": 1e9}}]
ONE_WORKER = [{"Alive": True, "NodeID": "h", "Resources": {"CPU": 8.0}}]


def test_cluster_that_can_add_nodes_is_recognised(monkeypatch):
    """A head without CPU/GPU (the shipped autoscaling config) or named autoscaler node types: it can grow."""
    import json

    import ray.experimental.internal_kv as kv

    from clusterscale.runtime import session

    assert "no CPU or GPU" in session.cluster_can_add_nodes(HEAD_ONLY)
    status = {"autoscaler_report": {"node_type_mapping": {"a1": "node_a1"}}}  # a plain `ray start` node
    monkeypatch.setattr(kv, "_internal_kv_get", lambda key: json.dumps(status).encode())
    assert session.cluster_can_add_nodes(ONE_WORKER) == ""
    status["autoscaler_report"]["node_type_mapping"]["b2"] = "ray.worker.gpu"
    assert "ray.worker.gpu" in session.cluster_can_add_nodes(ONE_WORKER)


def test_local_run_dir_is_refused_on_a_growing_cluster_unless_declared_shared(monkeypatch, tmp_path):
    import pytest

    from clusterscale.config import ConfigError
    from clusterscale.io.rundir import RunDir
    from clusterscale.runtime import session

    monkeypatch.setattr(session.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(session.ray, "nodes", lambda: HEAD_ONLY)
    monkeypatch.setattr(session, "_local_workers_inherit_env", False)  # joined a cluster, not a local Ray
    monkeypatch.setattr(session, "_checked_run_dirs", set())
    with pytest.raises(ConfigError, match="can add nodes.*s3://.*ray.shared_run_dir=true"):
        session.check_run_dir_shared(RunDir(str(tmp_path / "run")))
    session.check_run_dir_shared(RunDir(str(tmp_path / "run")), declared_shared=True)  # one node up: nothing to probe
    remote = RunDir(str(tmp_path / "remote"))
    remote.is_local = False  # as for an object-store URI: shared by construction
    session.check_run_dir_shared(remote)


def test_joining_an_address_where_nothing_listens_is_one_paragraph_at_once():
    """A wrong RAY_ADDRESS fails before Ray's minutes of retries, naming the address and what to check."""
    import socket

    import pytest

    from clusterscale.config import ConfigError
    from clusterscale.runtime.session import _check_reachable

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError) as caught:  # (init_ray's first step; this process may be in a Ray already)
        _check_reachable(f"127.0.0.1:{port}")
    message = str(caught.value)
    assert f"Could not join the Ray cluster at 127.0.0.1:{port}" in message
    assert "ray status --address" in message and "unset RAY_ADDRESS" in message


def test_a_local_start_never_joins_another_ray_on_this_machine(monkeypatch):
    """Without ray.address and RAY_ADDRESS, init_ray starts Ray with address="local": a plain ray.init() would join
    the Ray named in /tmp/ray/ray_current_cluster (a `ray start` head someone else runs on this machine)."""
    from clusterscale.config import RayConfig
    from clusterscale.runtime import session

    seen = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(session.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(session.ray, "init", lambda **kwargs: seen.append(kwargs))
    monkeypatch.setattr(session, "_drop_worker_log_noise", lambda: None)
    monkeypatch.setattr(session, "ray_data_progress", lambda on_terminal: None)
    monkeypatch.setattr(session, "_watch_local_ray", lambda: None)  # no watcher for the suite's own Ray
    session.init_ray(RayConfig(num_cpus=2, include_dashboard=False))
    assert [kwargs["address"] for kwargs in seen] == ["local"] and seen[0]["num_cpus"] == 2


def test_a_local_ray_starts_ray_train_without_its_preemption_watcher_unless_the_user_says(monkeypatch):
    """A local Ray is one node that nothing drains: its raylet (so Ray Train's controller) gets
    RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0 unless exported; a joined cluster keeps Ray's default (the watcher)."""
    import os

    from clusterscale.config import RayConfig
    from clusterscale.runtime import session

    seen = []
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"
                                        and k != "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"})  # restored after the test
    monkeypatch.setattr(session.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(session.ray, "init", lambda **kwargs: seen.append(
        os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")))
    for name in ("_drop_worker_log_noise", "_watch_local_ray", "_check_reachable"):
        monkeypatch.setattr(session, name, lambda *args: None)
    monkeypatch.setattr(session, "ray_data_progress", lambda on_terminal: None)
    session.init_ray(RayConfig(num_cpus=2, include_dashboard=False))
    os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "1"  # exported by the user: theirs wins
    session.init_ray(RayConfig(num_cpus=2, include_dashboard=False))
    del os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"]
    session.init_ray(RayConfig(num_cpus=2, include_dashboard=False, address="10.0.0.1:6379"))
    assert seen == ["0", "1", None]


def test_a_joined_cluster_gets_the_omp_policy_once_for_the_job_not_per_faiss_actor(monkeypatch):
    """faiss' OpenMP policy reaches a cluster's workers through the job's runtime_env (one worker pool), unless the
    job it was submitted in sets it already (Ray refuses a driver runtime_env that repeats a key of the job's)."""
    import json

    from clusterscale.runtime import session

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert session.omp_policy_runtime_env() == {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}
    job = {"runtime_env": {"working_dir": "gcs://pkg.zip", "env_vars": {"HF_HUB_OFFLINE": "1"}}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # exported by the user: theirs wins
    assert session.omp_policy_runtime_env() == {"env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}}
    job["runtime_env"]["env_vars"]["OMP_WAIT_POLICY"] = "PASSIVE"
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    assert session.omp_policy_runtime_env() == {}
    monkeypatch.setattr(session, "_workers_have_omp_policy", True)
    assert session.faiss_runtime_env() == {}
    monkeypatch.setattr(session, "_workers_have_omp_policy", False)  # Ray started by someone else
    assert session.faiss_runtime_env() == {"env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}}


def test_local_ray_processes_know_their_own_address(ray_local):
    """init_ray gives its local Ray's processes RAY_ADDRESS=<its GCS>: Ray's State API client, called without an
    address (Ray Train's PlacementGroupCleaner), finds this Ray even beside another one. The driver's own environment
    has none (a later init_ray must not join it); a watcher ends the agents if the driver is killed (reaper.py)."""
    import os

    from clusterscale.runtime import session

    @ray_local.remote(num_cpus=0)
    def address_seen() -> tuple[str | None, str]:
        from ray._private.services import canonicalize_bootstrap_address_or_die

        return os.environ.get("RAY_ADDRESS"), canonicalize_bootstrap_address_or_die(None)  # the State API's lookup

    own = ray_local.get_runtime_context().gcs_address
    assert ray_local.get(address_seen.remote()) == (own, own)
    assert "RAY_ADDRESS" not in os.environ and "RAY_GCS_SERVER_PORT" not in os.environ
    assert any(watcher.poll() is None for watcher in session._reapers)


def test_the_state_api_of_a_worker_beside_another_local_ray_asks_its_own(ray_local):
    """A second Ray on this machine (`ray start --head`, own temp dir and ports, stopped by killing its processes only:
    never `ray stop`, which stops every Ray here): the call Ray Train's PlacementGroupCleaner makes every second finds
    this Ray, instead of failing with "Found multiple active Ray instances" and a traceback. Slow for this file:
    10-20 s, most of it starting and stopping that Ray."""
    import os
    import shutil
    import subprocess

    from tests.test_jobs import RAY, free_port, processes_of, stop_head

    @ray_local.remote(num_cpus=0)
    def cleaner_query() -> str:
        from ray.train.v2._internal.state.util import is_actor_alive
        from ray.util.state.exception import RayStateApiException

        try:  # the cleaner's own call; this Ray's dashboard is off, so its State API answers with an error
            is_actor_alive(actor_id="ff" * 16, timeout=5)
        except RayStateApiException as exc:
            return f"asked this Ray: {type(exc).__name__}"
        return "asked this Ray"

    temp_dir = f"/tmp/csaddr-{os.getpid()}"  # short: Ray's socket paths are length-limited
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    try:
        subprocess.run([RAY, "start", "--head", "--num-cpus=0", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
                        "--include-dashboard=false", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
                       env=env, check=True, timeout=120, capture_output=True)
        assert ray_local.get(cleaner_query.remote()).startswith("asked this Ray")
    finally:
        stop_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not processes_of(temp_dir)


@pytest.mark.integration
def test_a_killed_drivers_watcher_ends_what_its_raylet_left(tmp_path):
    """runtime/reaper.py: when the driver's pipe ends and its raylet is gone, the processes the raylet started (here
    stand-ins that ignore SIGTERM, as the agents do for a minute) are killed; another raylet's are not."""
    import os
    import subprocess
    import sys

    from clusterscale.runtime import reaper

    gone = subprocess.Popen(["true"])
    gone.wait()  # a raylet that died with its driver
    stay = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    left = subprocess.Popen([sys.executable, "-c", stay], env={**os.environ, "RAY_RAYLET_PID": str(gone.pid)})
    other = subprocess.Popen([sys.executable, "-c", stay], env={**os.environ, "RAY_RAYLET_PID": str(os.getpid())})
    try:
        watcher = reaper.start(gone.pid)
        watcher.stdin.close()  # what the kernel does when the driver is killed
        assert watcher.wait(timeout=10) == 0
        assert left.wait(timeout=5) == -9 and other.poll() is None
    finally:
        for proc in (left, other):
            proc.kill()
            proc.wait()


@pytest.mark.unit
def test_a_killed_runs_shuffle_files_go_once_no_ray_runs_here(tmp_path, monkeypatch):
    """reaper.remove_orphaned_shuffle_files: Ray Data's disk-shuffle folders in the temporary folder are removed when
    no raylet runs on the machine (none can be in use), kept while one does; nothing else there is touched."""
    from clusterscale.runtime import reaper

    for name in ("ray_shuffle_disk_0123abcd_map", "ray_shuffle_disk_0123abcd_reduce"):
        (tmp_path / name / "part").mkdir(parents=True)
        (tmp_path / name / "part" / "0.arrow").write_bytes(b"x" * 100)
    (tmp_path / "someone_elses").mkdir()
    monkeypatch.setattr(reaper, "raylets_alive", lambda: True)
    assert reaper.remove_orphaned_shuffle_files(str(tmp_path)) == []
    assert len(list(tmp_path.iterdir())) == 3
    monkeypatch.setattr(reaper, "raylets_alive", lambda: False)
    assert sorted(p.rsplit("/", 1)[1] for p in reaper.remove_orphaned_shuffle_files(str(tmp_path))) == [
        "ray_shuffle_disk_0123abcd_map", "ray_shuffle_disk_0123abcd_reduce"]
    assert [p.name for p in tmp_path.iterdir()] == ["someone_elses"]

"""Every YAML under cluster_configs/ is loaded and checked: pipeline configs by the config schema, the
cluster launcher and KubeRay manifests structurally (GPU group, token auth, loopback dashboard, Ray pin)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from clusterscale import config as config_mod

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "cluster_configs"
YAMLS = sorted(CONFIGS.glob("*.yaml"))


def ray_pin() -> str:
    pins = set(re.findall(r'"ray\[[^\]]*\]==([0-9.]+)"', (REPO / "pyproject.toml").read_text()))
    assert len(pins) == 1, f"pyproject.toml must pin ray exactly, and everywhere the same: {pins}"
    return pins.pop()


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kind_of(doc: dict) -> str:
    if "provider" in doc and "available_node_types" in doc:
        return "launcher"
    if str(doc.get("apiVersion", "")).startswith("ray.io/"):
        return doc["kind"]
    if doc.get("apiVersion") and doc.get("kind"):
        return "kubernetes"
    assert set(doc) <= set(config_mod.SECTIONS), f"unknown YAML kind with keys {sorted(doc)}"
    return "pipeline"


def by_kind(kind: str) -> list[tuple[Path, dict]]:
    return [(p, d) for p in YAMLS for d in documents(p) if kind_of(d) == kind]


def test_every_yaml_is_of_a_known_kind_and_all_kinds_are_shipped():
    kinds = {kind_of(d) for p in YAMLS for d in documents(p)}
    assert {"pipeline", "launcher", "RayCluster", "RayJob"} <= kinds


@pytest.mark.parametrize("path", [p for p, _ in by_kind("pipeline")], ids=lambda p: p.name)
def test_pipeline_configs_pass_the_schema_and_use_gpus(path):
    cfg = config_mod.load(path)
    assert cfg.train.compute.use_gpu and cfg.train.schedule.global_batch_size % cfg.train.compute.num_workers == 0
    assert cfg.data.path.startswith(("s3://", "gs://", "hdfs://")), "the default path is Parquet in an object store"
    assert not cfg.embed.trust_remote_code


def test_paper_config_is_the_papers_recipe():
    cfg = config_mod.load(CONFIGS / "msmarco-paper.yaml")
    assert (cfg.embed.model, cfg.embed.side, cfg.cluster.k) == ("Snowflake/snowflake-arctic-embed-m", "passage", 10)
    t = cfg.train
    assert (t.student.init, t.student.pooling, t.schedule.global_batch_size, t.schedule.epochs,
            t.optimizer.warmup_steps) == ("scratch", "mean", 4096, 3, 50)
    assert (t.optimizer.lr, t.optimizer.final_lr, t.objective.temperature,
            t.optimizer.max_grad_norm) == (4e-4, 4e-5, 0.02, 1.0)
    assert (t.student.query_max_length, t.student.passage_max_length) == (32, 256)
    assert (t.student.scratch_hidden_size, t.student.scratch_num_layers, t.student.scratch_num_heads) == (768, 12, 12)


def test_scale_config_has_hundreds_of_clusters_and_one_actor_per_gpu():
    cfg = config_mod.load(CONFIGS / "scale-100m.yaml")
    assert 100 <= cfg.cluster.k < 1000
    assert cfg.embed.num_actors == cfg.train.compute.num_workers  # both sized to the cluster's GPU count
    assert 100_000_000 // cfg.cluster.k >= 10 * cfg.train.schedule.global_batch_size  # clusters yield many full batches


@pytest.mark.parametrize("path", [p for p, _ in by_kind("pipeline")], ids=lambda p: p.name)
def test_pipeline_configs_survive_a_preempted_node(path):
    """Spot nodes: checkpoints every few percent of the run, and Ray Train restarts the workers from them."""
    t = config_mod.load(path).train
    steps = (100_000_000 if "100m" in path.name else 500_000) // t.schedule.global_batch_size * t.schedule.epochs
    assert t.checkpoint.max_failures >= 1 and 0 < t.checkpoint.checkpoint_every_steps <= 0.1 * steps


def test_launcher_has_gpu_workers_token_auth_loopback_dashboard_and_the_pinned_ray():
    (path, doc), = by_kind("launcher")
    assert doc["docker"]["image"].startswith(f"rayproject/ray:{ray_pin()}-")
    head = doc["head_node_type"]
    gpu_types = {name: t for name, t in doc["available_node_types"].items()
                 if name != head and re.match(r"(p\d|g\d)", t["node_config"]["InstanceType"])}
    assert gpu_types, "a GPU worker group"
    for t in gpu_types.values():
        assert 0 <= t["min_workers"] <= t["max_workers"] <= doc["max_workers"]
    head_start = " ".join(doc["head_start_ray_commands"])
    worker_start = " ".join(doc["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in head_start and "RAY_AUTH_MODE=token" in worker_start
    assert "--dashboard-host=127.0.0.1" in head_start
    assert any("pip install" in c and "clusterscale" in c for c in doc["setup_commands"])
    # The token is copied from the user's machine, never from a file in the repository.
    token_sources = [src for dst, src in doc["file_mounts"].items() if "auth_token" in dst]
    assert token_sources and all(src.startswith("~") for src in token_sources)


def ray_cluster_specs() -> list[tuple[str, dict]]:
    specs = [(f"{p.name}:RayCluster", d["spec"]) for p, d in by_kind("RayCluster")]
    specs += [(f"{p.name}:RayJob", d["spec"]["rayClusterSpec"]) for p, d in by_kind("RayJob")]
    return specs


@pytest.mark.parametrize("name,spec", ray_cluster_specs(), ids=lambda x: x if isinstance(x, str) else "")
def test_kuberay_clusters_have_gpu_group_token_auth_shared_runs_and_the_pinned_ray(name, spec):
    assert spec["rayVersion"] == ray_pin()
    assert spec["authOptions"]["mode"] == "token"
    assert spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    gpu_groups = []
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        if "nvidia.com/gpu" in container["resources"].get("limits", {}):
            assert container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"]
            assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
            gpu_groups.append(group)
    assert gpu_groups, f"{name}: a GPU worker group"
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    for pod in pods:  # every pod sees the same run directories; a token only ever comes from a Secret
        assert any(m["mountPath"] == "/mnt/runs" for m in pod["containers"][0]["volumeMounts"])
        assert any("persistentVolumeClaim" in v for v in pod["volumes"])
        for env in (e for c in pod["containers"] for e in c.get("env", [])):
            assert not (env["name"].startswith("RAY_AUTH_TOKEN") and "value" in env), f"{name}: literal token"


def test_rayjob_runs_a_shipped_job_on_a_shipped_config():
    (_, doc), = by_kind("RayJob")
    entry = doc["spec"]["entrypoint"].split()
    job = next(a for a in entry if a.endswith(".py"))
    config = next(a for a in entry if a.endswith(".yaml"))
    assert (REPO / "jobs" / Path(job).name).exists() and (CONFIGS / Path(config).name).exists()


def test_image_is_built_on_the_pinned_ray():
    first = next(line for line in (CONFIGS / "Dockerfile").read_text().splitlines() if line.startswith("FROM"))
    assert first.split()[1].startswith(f"rayproject/ray:{ray_pin()}-")


def test_no_secret_is_committed_and_no_dashboard_listens_beyond_loopback():
    for path in YAMLS + [CONFIGS / "Dockerfile"]:
        text = path.read_text()
        assert not re.search(r"AKIA[0-9A-Z]{16}", text), f"{path.name}: an AWS access key"
        assert not re.search(r"RAY_AUTH_TOKEN\s*[:=]\s*\S", text.replace("RAY_AUTH_TOKEN=$(", "")), \
            f"{path.name}: a literal Ray token"
        for host in re.findall(r"dashboard-host[\"']?\s*[:=]\s*[\"']?([0-9.]+)", text):
            assert host == "127.0.0.1", f"{path.name}: dashboard on {host}"


def test_readme_commands_name_files_that_exist():
    readme = (REPO / "README.md").read_text()
    named = set(re.findall(r"(jobs/\w+\.py|cluster_configs/[\w.-]+\.yaml)", readme))
    assert any(n.startswith("jobs/") for n in named)
    for rel in named:
        assert (REPO / rel).exists(), rel

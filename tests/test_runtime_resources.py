"""Actor sizing from declared resources (runtime/resources.py), on made-up clusters: no Ray needed."""
from clusterscale.runtime.resources import ActorPlan, ClusterResources, Resources, plan_actors

CPU_BOX = ClusterResources(cpus=2, gpus=0, nodes=1)
CPU_CLUSTER = ClusterResources(cpus=64, gpus=0, nodes=4)
GPU_CLUSTER = ClusterResources(cpus=64, gpus=8, nodes=2)


def test_fixed_cpus_per_actor_fill_the_cluster():
    plan = plan_actors(Resources(cpus=1, gpus=1), cluster=CPU_BOX)  # embed's default threads_per_actor=1
    assert plan == ActorPlan(actors=2, threads=1, num_cpus=1, num_gpus=0)
    assert plan.options == {"num_cpus": 1} and plan.device == "cpu"
    plan = plan_actors(Resources(cpus=4, gpus=1), cluster=CPU_BOX)  # never more CPUs than the cluster has
    assert (plan.actors, plan.threads, plan.num_cpus) == (1, 2, 2)


def test_fractional_cpus_keep_one_thread():
    plan = plan_actors(Resources(cpus=0.5, gpus=1, cpus_with_gpu=None), cpu_actors=CPU_BOX.cpus, cluster=CPU_BOX)
    assert (plan.actors, plan.threads, plan.options) == (2, 1, {"num_cpus": 0.5})


def test_shared_cpus_split_over_the_actors():
    plan = plan_actors(Resources(gpus=1), max_actors=0, work_units=3, cpu_actors=CPU_CLUSTER.cpus // 8,
                       cluster=CPU_CLUSTER)  # mine: 8 actors wanted, 3 files to mine
    assert (plan.actors, plan.threads, plan.num_cpus) == (3, 21, 21)
    ranks = plan_actors(Resources(gpus=1), max_actors=3, use_gpu=False, cluster=CPU_BOX)  # DDP ranks all run at once
    assert (ranks.threads, ranks.resources_per_worker) == (1, {"CPU": 2 / 3})


def test_gpu_actors_one_per_gpu():
    plan = plan_actors(Resources(cpus=4, gpus=1), cluster=GPU_CLUSTER)
    assert plan == ActorPlan(actors=8, threads=1, num_cpus=1.0, num_gpus=1)
    assert plan.options == {"num_gpus": 1, "num_cpus": 1.0} and plan.resources_per_worker == {"GPU": 1, "CPU": 1.0}
    assert plan_actors(Resources(gpus=1, cpus_with_gpu=None), max_actors=2, cluster=GPU_CLUSTER).options == {"num_gpus": 1}
    assert not plan_actors(Resources(cpus=1), cluster=GPU_CLUSTER).on_gpu  # a CPU-only stage stays on CPUs
    assert not plan_actors(Resources(gpus=1), use_gpu=False, cluster=GPU_CLUSTER).on_gpu  # faiss without GPU support


def test_memory_request_capped_at_the_largest_node():
    node = ClusterResources(cpus=64, gpus=0, nodes=4, node_memory_bytes=8e9)
    plan = plan_actors(Resources(cpus=0.5, memory_bytes=2e9), cpu_actors=64, work_units=200, cluster=node)
    assert (plan.actors, plan.options) == (64, {"num_cpus": 0.5, "memory": 2_000_000_000})
    capped = plan_actors(Resources(cpus=0.5, memory_bytes=3e10), cluster=node)  # never unschedulable
    assert capped.options["memory"] == 8_000_000_000
    assert "memory" not in plan_actors(Resources(cpus=0.5), cluster=node).options


def test_no_actor_asks_for_more_cpus_than_one_node_holds():
    nodes = ClusterResources(cpus=256, gpus=0, nodes=8, node_cpus=32)  # 8 nodes of 32 CPUs
    evaluate = plan_actors(Resources(gpus=1), max_actors=1, cluster=nodes)  # one actor "with every CPU"
    assert (evaluate.threads, evaluate.num_cpus) == (32, 32)
    ranks = plan_actors(Resources(gpus=1), max_actors=2, use_gpu=False, cluster=nodes)  # two DDP ranks
    assert ranks.resources_per_worker == {"CPU": 32}
    assert plan_actors(Resources(cpus=64), cluster=nodes).num_cpus == 32
    one_cpu_workers = ClusterResources(cpus=3, gpus=0, nodes=3, node_cpus=1)  # head with no CPU + 3 x 1 CPU
    assert plan_actors(Resources(gpus=1), max_actors=1, cluster=one_cpu_workers).num_cpus == 1

"""Connecting to Ray: a local instance (dashboard off or on loopback) or an existing cluster."""
from __future__ import annotations

import logging
import os

import ray

from clusterscale.config import RayConfig


def init_ray(cfg: RayConfig) -> None:
    """Start or join Ray once per process. Jobs submitted to a cluster join it via RAY_ADDRESS."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    address = cfg.address or os.environ.get("RAY_ADDRESS") or None
    kwargs = dict(address=address, logging_level=logging.WARNING, log_to_driver=True)
    if address is None:  # a local instance: nothing listens beyond loopback unless asked
        kwargs.update(num_cpus=cfg.num_cpus, include_dashboard=cfg.include_dashboard,
                      dashboard_host="127.0.0.1")
    ray.init(**kwargs)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = True
    ctx.verbose_stats_logs = False

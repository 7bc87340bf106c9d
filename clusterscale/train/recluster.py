"""Re-clustering during training (train.recluster_every): training runs in segments of N steps.

After each segment the driver exports the current model, and the pipeline's train stage re-embeds
every training pair with it, re-fits k-means and re-assigns and re-shards (the ordinary embed, fit,
assign and shard stages, which stages/train.run_train runs through the executor, ctx.stage, while training waits) into
train/<name>/recluster/seg-<s>/, a child run directory with its own done markers, so a killed run
redoes only what is missing. Segment s then trains on those shards, continuing from the checkpoint
(model, optimizer, LR schedule). The batches of a segment are a pure function of (seed, segment,
epoch within the segment) and its shards. This module holds the segment arithmetic and names.
"""
from __future__ import annotations


from clusterscale.config import Config, variant
from clusterscale.io.layout import train_dir


def segment_bounds(num_steps: int, every: int) -> list[tuple[int, int]]:
    """[(first step, stop step)] of each segment; one segment when re-clustering is off."""
    if not every or every >= num_steps:
        return [(0, num_steps)]
    return [(s, min(s + every, num_steps)) for s in range(0, num_steps, every)]


def segment_dir(name: str, segment: int) -> str:
    return f"{train_dir(name)}/recluster/seg-{segment}"


def segment_config(cfg: Config, encoder_uri: str) -> Config:
    """The config of a segment's re-clustering: the training run's, embedding with the segment's encoder."""
    return variant(cfg, embed={"model": encoder_uri, "pooling": "auto", "query_prompt": None,  # the segment's
                               "passage_prompt": None})  # encoder folder carries the student's prompts


def segment_start_step(cfg: Config, segment: int) -> int:
    return segment * cfg.train.shards.recluster_every

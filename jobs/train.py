"""Ray job: train on the shards of a preprocessed run (Ray Train DDP, every global batch from one cluster).
Mines hard negatives first when train.negatives_per_query is set (reusing negatives/ when already mined).

    ray job submit --working-dir . -- python jobs/train.py CONFIG --run-dir URI [--set train.sampler=random ...]
"""
import sys

from _job import stages_job

from clusterscale.pipeline import pipeline

if __name__ == "__main__":
    sys.exit(stages_job(__doc__, lambda cfg: pipeline(cfg, "mine", "train")))

"""Ray job: the whole pipeline (ingest, embed, fit, assign, shard, [mine,] train, evaluate, report).

    ray job submit --working-dir . -- python jobs/run_pipeline.py CONFIG --run-dir URI [--set KEY=VALUE ...]
"""
import sys

from _job import stages_job

from clusterscale.pipeline import pipeline

if __name__ == "__main__":
    sys.exit(stages_job(__doc__, pipeline))

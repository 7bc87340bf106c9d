"""Ray job: preprocessing only (ingest, embed, fit, assign, shard); ends with shards/k=<k>/manifest.json.

    ray job submit --working-dir . -- python jobs/preprocess.py CONFIG --run-dir URI [--set KEY=VALUE ...]
"""
import sys

from _job import stages_job

from clusterscale.pipeline import PREPROCESS

if __name__ == "__main__":
    sys.exit(stages_job(__doc__, PREPROCESS))

"""Ray job: held-out retrieval metrics of the frozen encoder and the trained model, then the report.

    ray job submit --working-dir . -- python jobs/evaluate.py CONFIG --run-dir URI [--set KEY=VALUE ...]
"""
import sys

from _job import stages_job

if __name__ == "__main__":
    sys.exit(stages_job(__doc__, ("evaluate", "report")))

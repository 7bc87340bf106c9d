"""The logging keys of the train section: progress lines, batch logs, TensorBoard and the collapse guard (config
only, torch-free; the logger is train/metrics.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clusterscale.knobs import POSITIVE, Section, knob


@dataclass
class LoggingConfig(Section):
    """Logging and the collapse guard."""
    section: ClassVar[str] = "train"

    log_batches: bool = knob(False, "Write every rank's pair_ids per step to batches/rank-<r>.jsonl "
                                    "(for audits; large at scale).", affects_output=False)
    log_every_steps: int = knob(10, "Print a progress line every N steps.", affects_output=False, bounds=POSITIVE)
    tensorboard: bool = knob(False, "Also log the per-step metrics to train/<name>/tensorboard (needs the "
                                    "`tensorboard` package; local run directories only).", affects_output=False)
    stop_on_collapse: bool = knob(True, "Stop a run that is not learning (after warm-up, loss within 2% of chance "
                                        "level and mean in-batch negative cosine >= 0.9 for 3 logging intervals) "
                                        "with an error "
                                        "naming the likely causes; false = warn and go on. Either way "
                                        "train/<name>/collapse.json records it and the report flags the run.",
                                  affects_output=False)

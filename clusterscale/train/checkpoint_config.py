"""The checkpoint and fault-tolerance keys of the train section (config only, torch-free; the checkpointer is
train/checkpoint.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clusterscale.knobs import NON_NEGATIVE, POSITIVE, Section, knob


@dataclass
class CheckpointConfig(Section):
    """Checkpoints and fault tolerance."""
    section: ClassVar[str] = "train"

    checkpoint_every_steps: int = knob(0, "Save a resumable checkpoint (weights, optimizer, scheduler, data "
                                          "cursor) every N steps; 0 = only at the end.", affects_output=False,
                                       bounds=NON_NEGATIVE)
    stop_after_steps: int | None = knob(None, "Stop (with a checkpoint) after this many steps without changing "
                                              "the LR schedule; continue with `clusterscale train --resume`.",
                                        affects_output=False, bounds=POSITIVE)
    keep_checkpoint: bool = knob(False, "Keep the Ray Train checkpoints (train/<name>/ray: weights, optimizer "
                                        "and scheduler state) after the final export; false = delete them once "
                                        "model/ is written (an unfinished run always keeps them for --resume).",
                                 affects_output=False)
    max_failures: int = knob(0, "Ray Train FailureConfig.max_failures: restart failed workers this many times, "
                                "continuing from the latest checkpoint.", affects_output=False, bounds=NON_NEGATIVE)

"""Resumable checkpoints: weights (safetensors), optimizer + scheduler state, and the data cursor.

`Checkpointer` writes and restores one rank's state in a checkpoint folder (Ray Train moves the folders).
The cursor is the next global step; with the schedule a pure function of (seed, epoch) and dropout
seeded per (step, rank), a resumed run continues with exactly the batches and masks it would have had.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_model, save_model

from clusterscale.errors import UserError
from clusterscale.modeling.encoder import save_sentence_transformers_dir

WEIGHTS, OPTIMIZER, CURSOR = "weights.safetensors", "optimizer.pt", "cursor.json"
MODEL = "model"  # the exported encoder in a final checkpoint (a sentence-transformers folder)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def save_state(directory: str, model: torch.nn.Module, optimizer, scheduler, cursor: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    save_model(unwrap(model), os.path.join(directory, WEIGHTS))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               os.path.join(directory, OPTIMIZER))
    with open(os.path.join(directory, CURSOR), "w") as f:
        json.dump(cursor, f)


def load_state(directory: str, model: torch.nn.Module, optimizer, scheduler, device: torch.device) -> dict:
    """Restore weights, optimizer and scheduler in place; returns the cursor."""
    load_model(unwrap(model), os.path.join(directory, WEIGHTS), device=str(device))
    # weights_only: a checkpoint from shared storage must not be able to run code on load.
    state = torch.load(os.path.join(directory, OPTIMIZER), map_location=device, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    with open(os.path.join(directory, CURSOR)) as f:
        return json.load(f)


class CheckpointMismatchError(UserError, ValueError):
    """A checkpoint of another schedule than this run's: one paragraph, not a worker's traceback."""


def check_cursor(cursor: dict, expected: dict) -> None:
    """A checkpoint continues only the run it came from: same schedule, same number of steps."""
    for key, value in expected.items():
        if cursor.get(key) != value:
            raise CheckpointMismatchError(f"The checkpoint to resume was made with {key}={cursor.get(key)!r}, this "
                                          f"run has {value!r}: resume with the original config, or start afresh "
                                          f"without --resume.")


@dataclass(frozen=True)
class ModelExport:
    """What a final checkpoint needs to export the encoder besides its weights."""

    tokenizer: object
    pooling: str
    max_length: int
    prompts: tuple[str, str] = ("", "")  # train.query_prompt, train.passage_prompt


class Checkpointer:
    """Saves and restores the training state of one run: weights, optimizer, scheduler and the cursor
    (`cursor` holds what a checkpoint must match to continue this run; the step and epoch are added)."""

    def __init__(self, model: torch.nn.Module, optimizer, scheduler, cursor: dict, export: ModelExport):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.cursor, self.export = cursor, export

    def restore(self, directory: str, device: torch.device) -> int:
        """Load a checkpoint folder in place; returns the step to continue at. Refuses another run's checkpoint."""
        cursor = load_state(directory, self.model, self.optimizer, self.scheduler, device)
        check_cursor(cursor, self.cursor)
        return cursor["step"]

    def write(self, directory: str, step: int, epoch: int, final: bool) -> None:
        """The state at `step` into `directory`; `final` adds the exported encoder under model/."""
        save_state(directory, self.model, self.optimizer, self.scheduler, {**self.cursor, "step": step, "epoch": epoch})
        if final:
            save_sentence_transformers_dir(unwrap(self.model), self.export.tokenizer, os.path.join(directory, MODEL),
                                           self.export.pooling, self.export.max_length, self.export.prompts)

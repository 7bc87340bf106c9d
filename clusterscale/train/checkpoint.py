"""Resumable checkpoints: weights (safetensors), optimizer + scheduler state, and the data cursor.

The cursor is the next global step; with the schedule a pure function of (seed, epoch) and dropout
seeded per (step, rank), a resumed run continues with exactly the batches and masks it would have had.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_model, save_model

WEIGHTS, OPTIMIZER, CURSOR = "weights.safetensors", "optimizer.pt", "cursor.json"


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


def check_cursor(cursor: dict, expected: dict) -> None:
    """A checkpoint continues only the run it came from: same schedule, same number of steps."""
    for key, value in expected.items():
        if cursor.get(key) != value:
            raise ValueError(f"The checkpoint to resume was made with {key}={cursor.get(key)!r}, this run has "
                             f"{value!r}: resume with the original config, or start afresh without --resume.")

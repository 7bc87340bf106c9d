"""Checkpoint state round trip (safetensors weights, optimizer, scheduler, cursor) and the cursor check."""
from __future__ import annotations

import pytest
import torch

from clusterscale.train.checkpoint import check_cursor, load_state, save_state


def _setup(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps: int, start: int = 0):
    for step in range(start, start + steps):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()


def test_resumed_training_is_bit_identical(tmp_path):
    model, optimizer, scheduler = _setup(0)
    _train(model, optimizer, scheduler, 6)
    reference = [p.detach().clone() for p in model.parameters()]

    model, optimizer, scheduler = _setup(0)
    _train(model, optimizer, scheduler, 3)
    save_state(str(tmp_path), model, optimizer, scheduler, {"step": 3, "num_steps": 6})
    model, optimizer, scheduler = _setup(1)  # different weights: everything must come from the checkpoint
    cursor = load_state(str(tmp_path), model, optimizer, scheduler, torch.device("cpu"))
    assert cursor == {"step": 3, "num_steps": 6}
    assert scheduler.last_epoch == 3
    _train(model, optimizer, scheduler, 3, start=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference))
    assert (tmp_path / "weights.safetensors").exists()


def test_cursor_of_another_schedule_is_refused():
    check_cursor({"num_steps": 8, "sampler": "clustered", "step": 3}, {"num_steps": 8, "sampler": "clustered"})
    with pytest.raises(ValueError, match="made with num_steps=8, this run has 9.*without --resume"):
        check_cursor({"num_steps": 8, "step": 3}, {"num_steps": 9})


def test_checkpointer_restores_refuses_another_run_and_exports_the_final_model(tmp_path, tiny_model):
    import json

    from clusterscale.modeling.encoder import load_model, load_tokenizer
    from clusterscale.train.checkpoint import Checkpointer, ModelExport

    model = load_model(tiny_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    cursor = {"num_steps": 8, "sampler": "clustered"}
    checkpointer = Checkpointer(model, optimizer, scheduler, cursor, ModelExport(load_tokenizer(tiny_model), "mean", 32))
    checkpointer.write(str(tmp_path / "a"), step=3, epoch=1, final=False)
    assert json.loads((tmp_path / "a" / "cursor.json").read_text()) == {**cursor, "step": 3, "epoch": 1}
    assert not (tmp_path / "a" / "model").exists()
    assert checkpointer.restore(str(tmp_path / "a"), torch.device("cpu")) == 3
    other = Checkpointer(model, optimizer, scheduler, {**cursor, "num_steps": 9}, checkpointer.export)
    with pytest.raises(ValueError, match="made with num_steps=8, this run has 9"):
        other.restore(str(tmp_path / "a"), torch.device("cpu"))
    checkpointer.write(str(tmp_path / "b"), step=8, epoch=2, final=True)
    exported = load_model(str(tmp_path / "b" / "model"))
    assert all(torch.equal(a, b) for a, b in zip(exported.state_dict().values(), model.state_dict().values()))

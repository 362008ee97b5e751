"""Checkpoint files: atomic writes, latest-epoch lookup, weights_only loading, RNG round trips."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from dask_dl.checkpoint import REQUIRED_KEYS, checkpoint_name, latest_checkpoint, list_checkpoints, load_checkpoint
from dask_dl.errors import TrainingError
from dask_dl.train.checkpoint import rng_state, save_checkpoint, set_rng_state


def _checkpoint(epoch: int) -> dict:
    torch.manual_seed(epoch)
    return {
        "format": 1,
        "model_name": "small_cnn",
        "model_kwargs": {"width": 4},
        "model": {"fc.weight": torch.randn(3, 4), "bn.num_batches_tracked": torch.tensor(7)},
        "labels": ["a", "b", "c"],
        "task": "multilabel",
        "input_size": 32,
        "in_channels": 1,
        "normalization": {"mean": 0.5, "std": 0.25},
        "epoch": epoch,
        "optimizer": {"state": {0: {"momentum_buffer": torch.ones(2)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "compressor": [{"step": 3, "residuals": [torch.zeros(5)]}, {"step": 3, "residuals": [torch.ones(5)]}],
        "rng": [rng_state(), rng_state()],
        "history": [{"epoch": e, "train_loss": 0.5, "event": ""} for e in range(epoch + 1)],
    }


def test_name_and_latest(tmp_path):
    assert checkpoint_name(3) == "epoch-0003.pt"
    assert latest_checkpoint(tmp_path / "missing") is None
    for epoch in (0, 2, 10, 1):
        path = save_checkpoint(_checkpoint(epoch), tmp_path / "ck")
        assert os.path.basename(path) == checkpoint_name(epoch)
    # numeric order, not file-listing order; stray files are ignored
    (tmp_path / "ck" / "notes.txt").write_text("x")
    assert [e for e, _ in list_checkpoints(tmp_path / "ck")] == [0, 1, 2, 10]
    assert latest_checkpoint(tmp_path / "ck").endswith("epoch-0010.pt")
    assert not [p for p in os.listdir(tmp_path / "ck") if p.endswith(".tmp")]


def test_roundtrip_weights_only(tmp_path):
    original = _checkpoint(2)
    path = save_checkpoint(original, tmp_path)
    # the contract: plain torch.load with weights_only reads it
    raw = torch.load(path, weights_only=True)
    assert set(REQUIRED_KEYS) <= set(raw)
    loaded = load_checkpoint(tmp_path)  # a directory means its latest checkpoint
    assert loaded["epoch"] == 2
    assert torch.equal(loaded["model"]["fc.weight"], original["model"]["fc.weight"])
    assert torch.equal(loaded["compressor"][1]["residuals"][0], torch.ones(5))
    assert loaded["history"][-1] == {"epoch": 2, "train_loss": 0.5, "event": ""}


def test_fsspec_memory_url():
    url = "memory://dask-dl-ck-test/run"
    save_checkpoint(_checkpoint(0), url)
    save_checkpoint(_checkpoint(1), url)
    assert latest_checkpoint(url).endswith("epoch-0001.pt")
    assert load_checkpoint(url)["epoch"] == 1


def test_atomic_write_keeps_previous_on_failure(tmp_path, monkeypatch):
    save_checkpoint(_checkpoint(0), tmp_path)

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(_checkpoint(1), tmp_path)
    monkeypatch.undo()
    # the half-written epoch-1 never got its final name: the latest checkpoint is still epoch 0, and readable
    assert load_checkpoint(tmp_path)["epoch"] == 0


def test_bad_checkpoints(tmp_path):
    with pytest.raises(TrainingError, match="no checkpoint"):
        load_checkpoint(tmp_path)
    torch.save({"format": 99}, tmp_path / "epoch-0000.pt")
    with pytest.raises(TrainingError, match="not a dask_dl checkpoint"):
        load_checkpoint(tmp_path)
    incomplete = _checkpoint(0)
    del incomplete["optimizer"]
    with pytest.raises(TrainingError, match="optimizer"):
        save_checkpoint(incomplete, tmp_path)


def test_rng_state_roundtrip(tmp_path):
    state = rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    save_checkpoint({**_checkpoint(0), "rng": [state]}, tmp_path)
    set_rng_state(load_checkpoint(tmp_path)["rng"][0])
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]

"""Checkpoint files: atomic writes, latest-epoch lookup, weights_only loading, RNG round trips."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
from pathlib import Path

import dask
import numpy as np
import pytest
import torch

from dask_dl.checkpoint import REQUIRED_KEYS, checkpoint_name, latest_checkpoint, list_checkpoints, load_checkpoint
from dask_dl.errors import CheckpointError, TrainingError
from dask_dl.train.checkpoint import (
    rng_state,
    save_checkpoint,
    set_rng_state,
    shards_name,
    step_checkpoint_name,
)


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


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_step_checkpoint_takes_its_shards_along_when_it_goes(tmp_path, where):
    """Sharded (FSDP) step checkpoints: the older ones go with their shard folders, also a folder whose .pt a
    killed run never wrote; epoch shard folders stay."""
    import fsspec

    url = str(tmp_path / "ck") if where == "local" else f"memory://dask-dl-shards-{os.getpid()}/ck"
    fs, root = fsspec.core.url_to_fs(url)

    def shards(name: str) -> None:  # what torch.distributed.checkpoint leaves: a folder of files
        fs.makedirs(f"{root}/{shards_name(name)}", exist_ok=True)
        fs.pipe_file(f"{root}/{shards_name(name)}/__0_0.distcp", b"shard")

    def names() -> list[str]:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))

    assert shards_name(checkpoint_name(3)) == "epoch-0003.dcp"
    assert shards_name(step_checkpoint_name(1, 12)) == "step-0001-000000012.dcp"
    shards(checkpoint_name(0))
    save_checkpoint(_checkpoint(0), url)
    first, orphan, second = (step_checkpoint_name(1, s) for s in (6, 9, 12))
    shards(first)
    save_checkpoint(_checkpoint(0), url, name=first)
    shards(orphan)  # the run was killed after the shards, before the .pt
    shards(second)
    save_checkpoint(_checkpoint(0), url, name=second)
    assert names() == [
        "epoch-0000.dcp",
        "epoch-0000.pt",
        "epoch-0000.pt.sha256",
        "step-0001-000000012.dcp",
        "step-0001-000000012.pt",
        "step-0001-000000012.pt.sha256",
    ]
    assert fs.cat(f"{root}/step-0001-000000012.dcp/__0_0.distcp") == b"shard"
    shards(checkpoint_name(1))
    save_checkpoint(_checkpoint(1), url)  # the epoch's checkpoint replaces its step checkpoint, shards and all
    assert [n for n in names() if n.startswith("step-")] == []
    assert {"epoch-0000.dcp", "epoch-0001.dcp"} <= set(names())


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


# ---- integrity, damaged, hostile and special files ------------------------------------------------------------


def _flip_tensor_bytes(path, pattern: bytes, n: int = 64) -> None:
    """Invert ``n`` bytes inside the stored tensor whose raw bytes start with ``pattern`` (file size unchanged)."""
    data = bytearray(Path(path).read_bytes())
    at = data.index(pattern)
    data[at + 16 : at + 16 + n] = bytes(b ^ 0xFF for b in data[at + 16 : at + 16 + n])
    Path(path).write_bytes(bytes(data))


def _with_big_tensor(epoch: int) -> dict:
    ck = _checkpoint(epoch)
    ck["model"]["conv.weight"] = torch.arange(1000, dtype=torch.float32) + 0.5
    return ck


def test_manifest_written_last_and_flipped_bytes_refused(tmp_path):
    path = save_checkpoint(_with_big_tensor(3), tmp_path)
    manifest = json.loads((tmp_path / "epoch-0003.pt.sha256").read_text())
    data = Path(path).read_bytes()
    assert manifest == {"file": "epoch-0003.pt", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert [e for e, _ in list_checkpoints(tmp_path)] == [3]  # the manifest is not a checkpoint
    size = os.path.getsize(path)
    _flip_tensor_bytes(path, (torch.arange(4, dtype=torch.float32) + 0.5).numpy().tobytes())
    assert os.path.getsize(path) == size
    # torch.load alone reads the damaged tensor silently: that is what the manifest is for
    assert not torch.equal(torch.load(path, weights_only=True)["model"]["conv.weight"], torch.arange(1000) + 0.5)
    with pytest.raises(CheckpointError, match=r"epoch-0003\.pt' is damaged: its SHA-256 is"):
        load_checkpoint(tmp_path)
    with pytest.raises(TrainingError):  # a CheckpointError is a TrainingError
        load_checkpoint(path)


def test_truncated_and_empty_files_name_the_file(tmp_path):
    path = save_checkpoint(_checkpoint(1), tmp_path)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])
    half = len(data) // 2
    with pytest.raises(CheckpointError, match=rf"epoch-0001\.pt' is damaged: {half} bytes .*\(truncated\)"):
        load_checkpoint(path)
    os.remove(str(path) + ".sha256")  # without a manifest: torch's own failure, named and explained
    torch_failure = r"epoch-0001\.pt' is damaged or not a torch file \((RuntimeError|ValueError): "
    with pytest.raises(CheckpointError, match=torch_failure):
        load_checkpoint(path)
    Path(path).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"epoch-0001\.pt' is empty \(0 bytes\)"):
        load_checkpoint(path)


def test_hostile_file_refused_without_weights_only_advice(tmp_path):
    hostile = {**_checkpoint(0), "payload": collections.OrderedDict, "evil": os.system}
    torch.save(hostile, tmp_path / "epoch-0000.pt")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    message = str(info.value)
    assert "epoch-0000.pt' is refused: it holds objects other than tensors and plain data" in message
    assert "weights_only" not in message and info.value.__cause__ is None


def test_only_regular_files_within_the_size_limit(tmp_path):
    (tmp_path / "zero").mkdir()
    os.symlink("/dev/zero", tmp_path / "zero" / "epoch-0000.pt")
    with pytest.raises(CheckpointError, match=r"is not a regular file \(a character device\)"):
        load_checkpoint(tmp_path / "zero")
    fifo = tmp_path / "epoch-0001.pt"
    os.mkfifo(fifo)  # opening it would block until a writer comes: it must be refused before that
    with pytest.raises(CheckpointError, match=r"is not a regular file \(a FIFO\)"):
        load_checkpoint(fifo)
    sparse = tmp_path / "sparse" / "epoch-0002.pt"
    sparse.parent.mkdir()
    with open(sparse, "wb") as f:
        f.truncate(20 * 2**30)  # 20 GiB, no blocks on disk
    with pytest.raises(CheckpointError, match=r"is 21474836480 bytes, more than dask-dl.checkpoint.max-bytes"):
        load_checkpoint(sparse.parent)
    # a link to a regular checkpoint is fine; the limit comes from config
    path = save_checkpoint(_checkpoint(4), tmp_path / "real")
    os.symlink(path, tmp_path / "link.pt")
    assert load_checkpoint(tmp_path / "link.pt")["epoch"] == 4
    with (
        dask.config.set({"dask-dl.checkpoint.max-bytes": 1000}),
        pytest.raises(CheckpointError, match=r"more than dask-dl.checkpoint.max-bytes=1000"),
    ):
        load_checkpoint(path)


def test_resume_point_falls_back_to_newest_good_checkpoint(tmp_path):
    from dask_dl.train.run import newest_good_checkpoint

    assert newest_good_checkpoint(str(tmp_path / "none")) == (None, None)
    for epoch in (0, 1, 2):
        save_checkpoint(_with_big_tensor(epoch), tmp_path)
    _flip_tensor_bytes(tmp_path / "epoch-0002.pt", (torch.arange(4, dtype=torch.float32) + 0.5).numpy().tobytes())
    (tmp_path / "epoch-0001.pt").write_bytes(b"")
    with pytest.warns(UserWarning, match=r"skipped 2 newer checkpoint\(s\).*epoch-0002\.pt' is damaged.*epoch-0001"):
        path, ck = newest_good_checkpoint(str(tmp_path))
    assert path.endswith("epoch-0000.pt") and ck["epoch"] == 0
    (tmp_path / "epoch-0000.pt").write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*epoch-0002.*epoch-0001.*epoch-0000"):
        newest_good_checkpoint(str(tmp_path))


def test_export_refuses_a_damaged_checkpoint(tmp_path):
    from dask_dl import ExportError, export_onnx

    path = save_checkpoint(_with_big_tensor(0), tmp_path)
    _flip_tensor_bytes(path, (torch.arange(4, dtype=torch.float32) + 0.5).numpy().tobytes())
    with pytest.raises(ExportError, match=r"epoch-0000\.pt' is damaged: its SHA-256"):
        export_onnx(path, tmp_path / "model.onnx")

"""Checkpoint files: one ``torch.save`` dict per completed epoch, written atomically.

A checkpoint is ``<checkpoint_dir>/epoch-0003.pt`` (epoch numbers are 0-based and count completed epochs) and holds
plain tensors, numbers, strings, lists and dicts only, so ``torch.load(path, weights_only=True)`` reads it. Keys:

``format`` (1), ``model_name``, ``model_kwargs``, ``model`` (state_dict of the unwrapped module), ``labels``,
``task``, ``input_size``, ``in_channels``, ``normalization``, ``epoch``, ``optimizer``, ``compressor`` (list, one
state per rank: error-feedback residuals differ per rank), ``rng`` (list, one per rank: torch, numpy and python
generator states as tensors and lists), ``history`` (list of dicts, one per epoch).

``checkpoint_dir`` is a local path or any fsspec URL. Writing goes to a temporary name beside the target, then
renames it (``os.replace`` locally; ``fs.mv`` elsewhere), so a reader never sees half a file and a run killed while
writing keeps the previous checkpoint.
"""

from __future__ import annotations

import io
import os
import random
import re
import uuid
from typing import Any

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from dask_dl.errors import TrainingError

FORMAT = 1
REQUIRED_KEYS: tuple[str, ...] = (
    "format",
    "model_name",
    "model_kwargs",
    "model",
    "labels",
    "task",
    "input_size",
    "in_channels",
    "normalization",
    "epoch",
    "optimizer",
    "compressor",
    "rng",
    "history",
)
_NAME = re.compile(r"^epoch-(\d+)\.pt$")


def checkpoint_name(epoch: int) -> str:
    """Return the file name of the checkpoint of completed epoch ``epoch`` (``epoch-0003.pt``)."""
    return f"epoch-{epoch:04d}.pt"


def _fs(directory: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(str(directory))
    return fs, path.rstrip("/")


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def save_checkpoint(checkpoint: dict[str, Any], directory: str | os.PathLike) -> str:
    """Write ``checkpoint`` to ``directory`` as ``epoch-NNNN.pt``, atomically.

    Parameters
    ----------
    checkpoint
        A dict with the keys in :data:`REQUIRED_KEYS`.
    directory
        Local directory or fsspec URL; created when missing.

    Returns
    -------
    str
        The path (or URL path) written.
    """
    missing = [k for k in REQUIRED_KEYS if k not in checkpoint]
    if missing:
        raise TrainingError(f"checkpoint lacks keys {missing}; a checkpoint needs {list(REQUIRED_KEYS)}")
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return write_atomic(directory, checkpoint_name(int(checkpoint["epoch"])), buffer.getbuffer())


def write_atomic(directory: str | os.PathLike, name: str, data: bytes | memoryview) -> str:
    """Write ``data`` to ``directory/name`` (local or fsspec URL) through a temporary file and a rename.

    A reader never sees half a file, and a run killed while writing leaves the previous file in place.
    """
    fs, root = _fs(directory)
    fs.makedirs(root, exist_ok=True)
    target = f"{root}/{name}"
    temporary = f"{root}/.{name}.{uuid.uuid4().hex}.tmp"
    if _is_local(fs):
        # fsync before the rename: after a crash the new name must never point at a torn file
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, target)
    else:
        fs.pipe_file(temporary, bytes(data))
        fs.mv(temporary, target)
    return target


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, str]]:
    """Return ``(epoch, path)`` of every checkpoint in ``directory``, oldest first ([] when there is none)."""
    fs, root = _fs(directory)
    if not fs.exists(root):
        return []
    found = []
    for path in fs.ls(root, detail=False):
        match = _NAME.match(path.rstrip("/").rsplit("/", 1)[-1])
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """Return the path of the checkpoint with the highest epoch in ``directory``, or None when there is none."""
    found = list_checkpoints(directory)
    if not found:
        return None
    fs, _ = _fs(directory)
    return found[-1][1] if _is_local(fs) else fs.unstrip_protocol(found[-1][1])


def load_checkpoint(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint file (or the latest checkpoint of a directory) with ``weights_only=True``.

    Raises
    ------
    TrainingError
        When there is no checkpoint there, or the file is not a dask_dl checkpoint.
    """
    fs, fpath = _fs(path)
    if fs.isdir(fpath):
        latest = latest_checkpoint(path)
        if latest is None:
            raise TrainingError(
                f"no checkpoint (epoch-NNNN.pt) in {str(path)!r}; train with fit(..., checkpoint_dir={str(path)!r}) "
                "first, or pass resume=False"
            )
        fs, fpath = _fs(latest)
    if not fs.exists(fpath):
        raise TrainingError(f"checkpoint {str(path)!r} does not exist")
    with fs.open(fpath, "rb") as f:
        checkpoint = torch.load(io.BytesIO(f.read()), map_location=map_location, weights_only=True)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise TrainingError(
            f"{str(path)!r} is not a dask_dl checkpoint of format {FORMAT}: found "
            f"{type(checkpoint).__name__} with format {getattr(checkpoint, 'get', lambda k: None)('format')!r}"
        )
    missing = [k for k in REQUIRED_KEYS if k not in checkpoint]
    if missing:
        raise TrainingError(f"checkpoint {str(path)!r} lacks keys {missing}; it was not written by dask_dl.fit")
    return checkpoint


def rng_state() -> dict[str, Any]:
    """Return the torch, numpy and python generator states of this process as tensors and lists."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore generator states saved by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

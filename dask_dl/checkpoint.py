"""The checkpoint format: what a dask_dl checkpoint file holds, where it lies, and reading it.

A checkpoint is ``<checkpoint_dir>/epoch-0003.pt`` (epoch numbers are 0-based and count completed epochs), one
``torch.save`` dict that holds plain tensors, numbers, strings, lists and dicts only, so
``torch.load(path, weights_only=True)`` reads it. Keys:

``format`` (1), ``model_name``, ``model_kwargs``, ``model`` (state_dict of the unwrapped module), ``labels``,
``task``, ``input_size``, ``in_channels``, ``normalization``, ``epoch``, ``optimizer``, ``compressor`` (list, one
state per rank: error-feedback residuals differ per rank), ``rng`` (list, one per rank: torch, numpy and python
generator states as tensors and lists), ``history`` (list of dicts, one per epoch).

``checkpoint_dir`` is a local path or any fsspec URL. This module is neutral ground: training writes checkpoints
(:mod:`dask_dl.train.checkpoint`), export and resuming read them, and neither imports the other.
"""

from __future__ import annotations

import io
import os
import re
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dask_dl.errors import TrainingError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "FORMAT",
    "REQUIRED_KEYS",
    "checkpoint_name",
    "fs_of",
    "is_local",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
]

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


def fs_of(directory: str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of a local path or URL, and the path on it without a trailing slash."""
    fs, path = fsspec.core.url_to_fs(str(directory))
    return fs, path.rstrip("/")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True for the local filesystem (where an atomic rename is ``os.replace``)."""
    return isinstance(fs, LocalFileSystem)


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, str]]:
    """Return ``(epoch, path)`` of every checkpoint in ``directory``, oldest first ([] when there is none)."""
    fs, root = fs_of(directory)
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
    fs, _ = fs_of(directory)
    return found[-1][1] if is_local(fs) else fs.unstrip_protocol(found[-1][1])


def load_checkpoint(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint file (or the latest checkpoint of a directory) with ``weights_only=True``.

    Raises
    ------
    TrainingError
        When there is no checkpoint there, or the file is not a dask_dl checkpoint.
    """
    fs, fpath = fs_of(path)
    if fs.isdir(fpath):
        latest = latest_checkpoint(path)
        if latest is None:
            raise TrainingError(
                f"no checkpoint (epoch-NNNN.pt) in {str(path)!r}; train with fit(..., checkpoint_dir={str(path)!r}) "
                "first, or pass resume=False"
            )
        fs, fpath = fs_of(latest)
    if not fs.exists(fpath):
        raise TrainingError(f"checkpoint {str(path)!r} does not exist")
    import torch

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

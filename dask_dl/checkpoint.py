"""The checkpoint format: what a dask_dl checkpoint file holds, where it lies, and reading it.

A checkpoint is ``<checkpoint_dir>/epoch-0003.pt`` (epoch numbers are 0-based and count completed epochs), one
``torch.save`` dict that holds plain tensors, numbers, strings, lists and dicts only, so
``torch.load(path, weights_only=True)`` reads it. Keys:

``format`` (1), ``model_name``, ``model_kwargs``, ``model`` (state_dict of the unwrapped module), ``labels``,
``task``, ``input_size``, ``in_channels``, ``normalization``, ``epoch``, ``optimizer``, ``compressor`` (list, one
state per rank: error-feedback residuals differ per rank), ``rng`` (list, one per rank: torch, numpy and python
generator states as tensors and lists), ``history`` (list of dicts, one per epoch). Optional keys (checkpoints
written before them lack them): ``model_source`` (how to rebuild the model: ``kind``, ``name``, ``kwargs``,
``path``; see :mod:`dask_dl.models.source`), ``loss`` (its name, None for a function), ``tuning`` (the
learning-rate schedule's position) and ``scaler`` (the fp16 gradient scaler's state).

Beside each file lies its manifest ``epoch-0003.pt.sha256`` (JSON: ``file``, ``bytes``, ``sha256``), written after
the checkpoint itself: loading checks size and SHA-256 against it, so a damaged or truncated file is refused with
its name rather than loaded silently (``torch.load`` does not check the zip's CRCs). A file without a manifest
(written before manifests existed, or copied alone) is read after a logged warning. Only regular files are read,
at most ``dask-dl.checkpoint.max-bytes``, and only tensors and plain data are unpickled.

``checkpoint_dir`` is a local path or any fsspec URL. This module is neutral ground: training writes checkpoints
(:mod:`dask_dl.train.checkpoint`), export and resuming read them, and neither imports the other.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
import stat
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dask_dl import config
from dask_dl.errors import CheckpointError, TrainingError

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
    "manifest_name",
    "read_checkpoint_bytes",
    "verify_manifest",
]

logger = logging.getLogger(__name__)

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
MANIFEST_SUFFIX = ".sha256"


def checkpoint_name(epoch: int) -> str:
    """Return the file name of the checkpoint of completed epoch ``epoch`` (``epoch-0003.pt``)."""
    return f"epoch-{epoch:04d}.pt"


def manifest_name(name: str) -> str:
    """Return the file name of the manifest of checkpoint file ``name`` (``epoch-0003.pt.sha256``)."""
    return name + MANIFEST_SUFFIX


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
    """Read a checkpoint file (or the latest checkpoint of a directory), checked, with ``weights_only=True``.

    Parameters
    ----------
    path
        A checkpoint file, or a directory (local or fsspec URL) whose newest ``epoch-NNNN.pt`` is read.
    map_location
        Where tensors are placed.

    Returns
    -------
    dict
        The checkpoint (see the module's description of its keys).

    Raises
    ------
    CheckpointError
        When the file is not a regular file, is larger than ``dask-dl.checkpoint.max-bytes``, does not match its
        manifest (damaged or truncated), cannot be read by ``torch.load`` or holds objects other than tensors and
        plain data.
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
        path = latest
        fs, fpath = fs_of(latest)
    if not fs.exists(fpath) and not _is_link(fs, fpath):
        raise TrainingError(f"checkpoint {str(path)!r} does not exist")
    data = read_checkpoint_bytes(path)
    verify_manifest(path, data)
    checkpoint = _unpickle(str(path), data, map_location)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise TrainingError(
            f"{str(path)!r} is not a dask_dl checkpoint of format {FORMAT}: found "
            f"{type(checkpoint).__name__} with format {getattr(checkpoint, 'get', lambda k: None)('format')!r}"
        )
    missing = [k for k in REQUIRED_KEYS if k not in checkpoint]
    if missing:
        raise TrainingError(f"checkpoint {str(path)!r} lacks keys {missing}; it was not written by dask_dl.fit")
    return checkpoint


def read_checkpoint_bytes(path: str | os.PathLike, *, max_bytes: int | None = None) -> bytes:
    """Return the bytes of checkpoint file ``path``: a regular file (or object) of at most ``max_bytes``.

    Special files are refused before they are opened (a FIFO would block, ``/dev/zero`` never ends), and so is a
    file larger than the limit (a sparse 20 GiB file would fill memory).

    Parameters
    ----------
    path
        Local path or fsspec URL of the file.
    max_bytes
        Largest size accepted; None: ``dask-dl.checkpoint.max-bytes``.

    Returns
    -------
    bytes
        The file's content.

    Raises
    ------
    CheckpointError
        When ``path`` is not a regular file or is larger than ``max_bytes``.
    """
    limit = int(config.get("checkpoint.max-bytes", max_bytes))
    fs, fpath = fs_of(path)
    if is_local(fs):
        try:
            info = os.stat(fpath)  # follows links: a link to a regular file is fine, a link to /dev/zero is not
        except OSError as exc:
            raise CheckpointError(f"checkpoint {str(path)!r} cannot be read: {exc.strerror or exc}") from exc
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(
                f"checkpoint {str(path)!r} is not a regular file ({_kind(info.st_mode)}); a checkpoint is a file "
                "written by dask_dl.fit (epoch-NNNN.pt): point at that file or its directory"
            )
        size = info.st_size
    else:
        info = fs.info(fpath)
        if info.get("type") != "file":
            raise CheckpointError(f"checkpoint {str(path)!r} is not a file (type {info.get('type')!r})")
        size = int(info.get("size") or 0)
    if size > limit:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is {size} bytes, more than dask-dl.checkpoint.max-bytes={limit}; refused "
            "unread. If it is a genuine checkpoint of a large model, raise the limit, e.g. "
            f"dask.config.set({{'dask-dl.checkpoint.max-bytes': {2 * size}}})"
        )
    if size == 0:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is empty (0 bytes): it was damaged or not written completely; resume from an "
            "older checkpoint (fit(resume=True) does so by itself) or delete it"
        )
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)  # a file swapped for a FIFO since stat must not block
    if is_local(fs):
        fd = os.open(fpath, flags)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise CheckpointError(f"checkpoint {str(path)!r} is not a regular file")
            data = f.read(limit + 1)
    else:
        with fs.open(fpath, "rb") as f:
            data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"checkpoint {str(path)!r} grew beyond dask-dl.checkpoint.max-bytes={limit} while read")
    return data


def verify_manifest(path: str | os.PathLike, data: bytes) -> None:
    """Check ``data`` (the bytes of checkpoint ``path``) against the manifest beside it.

    A checkpoint without a manifest is accepted after a logged warning (files written before manifests existed).

    Raises
    ------
    CheckpointError
        When the size or the SHA-256 differ from the manifest's, or the manifest is unreadable.
    """
    fs, fpath = fs_of(path)
    mpath = manifest_name(fpath)
    try:
        if not fs.exists(mpath):
            logger.warning(
                "checkpoint %r has no manifest (%s): its integrity is not verified", str(path), mpath.rsplit("/", 1)[-1]
            )
            return
        with fs.open(mpath, "rb") as f:
            manifest = json.loads(f.read(65536).decode("utf-8"))
        expected_bytes, expected_sha = int(manifest["bytes"]), str(manifest["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"the manifest {mpath!r} of checkpoint {str(path)!r} is unreadable ({type(exc).__name__}: {exc}); "
            "the checkpoint cannot be verified: use an older checkpoint or delete both files"
        ) from exc
    if len(data) != expected_bytes:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is damaged: {len(data)} bytes where its manifest says {expected_bytes} "
            f"({'truncated' if len(data) < expected_bytes else 'bytes appended'}); use an older checkpoint "
            "(fit(resume=True) does so by itself)"
        )
    found = hashlib.sha256(data).hexdigest()
    if found != expected_sha:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is damaged: its SHA-256 is {found[:16]}... where its manifest says "
            f"{expected_sha[:16]}... (bytes changed on disk or in transfer); use an older checkpoint "
            "(fit(resume=True) does so by itself)"
        )


def _unpickle(name: str, data: bytes, map_location: Any) -> Any:
    import torch

    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        # torch's message advises weights_only=False: the wrong advice for a file that may be hostile
        raise CheckpointError(
            f"checkpoint {name!r} is refused: it holds objects other than tensors and plain data (numbers, "
            "strings, lists, dicts), which a dask_dl checkpoint never does, and unpickling them could run code. "
            "Use a checkpoint written by dask_dl.fit"
        ) from None
    except (EOFError, RuntimeError, ValueError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else "no further detail"
        raise CheckpointError(
            f"checkpoint {name!r} is damaged or not a torch file ({type(exc).__name__}: {first}); use an older "
            "checkpoint (fit(resume=True) does so by itself) or one written by dask_dl.fit"
        ) from None


def _is_link(fs: fsspec.AbstractFileSystem, fpath: str) -> bool:
    return is_local(fs) and os.path.islink(fpath)


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return f"file mode {oct(mode)}"

"""Writing checkpoints (the format is :mod:`dask_dl.checkpoint`'s), atomically, and the per-rank RNG state.

Writing goes to a temporary name beside the target, then renames it (``os.replace`` locally; ``fs.mv``
elsewhere), so a reader never sees half a file and a run killed while writing keeps the previous checkpoint. The
manifest (size and SHA-256, :func:`dask_dl.checkpoint.verify_manifest`) is written last, the same way.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import uuid
from typing import Any

import numpy as np
import torch

from dask_dl.checkpoint import REQUIRED_KEYS, checkpoint_name, fs_of, is_local, manifest_name
from dask_dl.errors import TrainingError

__all__ = ["rng_state", "save_checkpoint", "set_rng_state", "write_atomic"]


def save_checkpoint(checkpoint: dict[str, Any], directory: str | os.PathLike) -> str:
    """Write ``checkpoint`` to ``directory`` as ``epoch-NNNN.pt``, atomically, then its manifest.

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
    data = buffer.getbuffer()
    name = checkpoint_name(int(checkpoint["epoch"]))
    manifest = {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    fs, root = fs_of(directory)
    if fs.exists(f"{root}/{manifest_name(name)}"):  # a stale manifest must not judge the new file
        fs.rm(f"{root}/{manifest_name(name)}")
    target = write_atomic(directory, name, data)
    # written last: a run killed between the two leaves a complete checkpoint without manifest (read with a warning)
    write_atomic(directory, manifest_name(name), json.dumps(manifest).encode())
    return target


def write_atomic(directory: str | os.PathLike, name: str, data: bytes | memoryview) -> str:
    """Write ``data`` to ``directory/name`` (local or fsspec URL) through a temporary file and a rename.

    A reader never sees half a file, and a run killed while writing leaves the previous file in place.
    """
    fs, root = fs_of(directory)
    fs.makedirs(root, exist_ok=True)
    target = f"{root}/{name}"
    temporary = f"{root}/.{name}.{uuid.uuid4().hex}.tmp"
    if is_local(fs):
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

"""Writing checkpoints (the format is :mod:`dask_dl.checkpoint`'s), atomically, and the per-rank RNG state.

Writing goes to a temporary name beside the target, then renames it (``os.replace`` locally; ``fs.mv``
elsewhere), so a reader never sees half a file and a run killed while writing keeps the previous checkpoint. The
manifest (size and SHA-256, :func:`dask_dl.checkpoint.verify_manifest`) is written last, the same way.

Step checkpoints (taken inside an epoch, with the loader's position) are ``step-EEEE-GGGGGGGGG.pt`` (the epoch in
progress and the run's optimizer steps so far) beside the epoch files; only the newest is kept, and an epoch's
checkpoint removes the step files of that epoch and before. A sharded (FSDP) checkpoint keeps its shards in a
folder of the same name ending in ``.dcp`` (:func:`shards_name`), written before the ``.pt``; a step checkpoint's
folder goes with it, and so does one whose ``.pt`` was never written (a run killed between the two).
:func:`resume_candidates` orders both kinds, newest first, for resuming. Export and ``latest_checkpoint`` read
epoch files only.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
import uuid
from typing import Any

import numpy as np
import torch

from dask_dl.checkpoint import REQUIRED_KEYS, checkpoint_name, fs_of, is_local, list_checkpoints, manifest_name
from dask_dl.errors import TrainingError

__all__ = [
    "failure_causes",
    "resume_candidates",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "shards_name",
    "step_checkpoint_name",
    "to_cpu",
    "write_atomic",
]

logger = logging.getLogger("dask_dl.train")

_STEP_NAME = re.compile(r"^step-(\d+)-(\d+)\.pt$")
_STEP_SHARDS = re.compile(r"^step-(\d+)-(\d+)\.dcp$")


def step_checkpoint_name(epoch: int, global_step: int) -> str:
    """The file name of a step checkpoint inside epoch ``epoch`` after ``global_step`` steps of the run."""
    return f"step-{epoch:04d}-{global_step:09d}.pt"


def shards_name(name: str) -> str:
    """The folder of checkpoint file ``name``'s shards (``epoch-0003.pt`` -> ``epoch-0003.dcp``)."""
    return f"{name.removesuffix('.pt')}.dcp"


def list_step_checkpoints(directory: str | os.PathLike) -> list[tuple[int, int, str]]:
    """``(epoch, global_step, path)`` of every step checkpoint in ``directory``, oldest first."""
    fs, root = fs_of(directory)
    if not fs.exists(root):
        return []
    found = []
    for path in fs.ls(root, detail=False):
        match = _STEP_NAME.match(path.rstrip("/").rsplit("/", 1)[-1])
        if match:
            found.append((int(match.group(1)), int(match.group(2)), path))
    return sorted(found)


def resume_candidates(directory: str | os.PathLike) -> list[str]:
    """Every checkpoint of ``directory`` (epoch and step files), newest first: where a resume may start.

    A step checkpoint inside epoch ``e`` is newer than the checkpoint of epoch ``e - 1`` and older than epoch
    ``e``'s.
    """
    fs, _ = fs_of(directory)
    keyed = [((epoch + 1, 0), path) for epoch, path in list_checkpoints(directory)]
    keyed += [((epoch, 1 + step), path) for epoch, step, path in list_step_checkpoints(directory)]
    return [path if is_local(fs) else fs.unstrip_protocol(path) for _, path in sorted(keyed, reverse=True)]


def save_checkpoint(checkpoint: dict[str, Any], directory: str | os.PathLike, *, name: str | None = None) -> str:
    """Write ``checkpoint`` to ``directory`` as ``epoch-NNNN.pt`` (or ``name``), atomically, then its manifest.

    Older step checkpoints (all of them after an epoch's checkpoint) are removed afterwards.

    Parameters
    ----------
    checkpoint
        A dict with the keys in :data:`REQUIRED_KEYS`.
    directory
        Local directory or fsspec URL; created when missing.
    name
        The file name (a step checkpoint's, :func:`step_checkpoint_name`); default ``epoch-NNNN.pt``.

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
    name = name or checkpoint_name(int(checkpoint["epoch"]))
    manifest = {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    fs, root = fs_of(directory)
    if fs.exists(f"{root}/{manifest_name(name)}"):  # a stale manifest must not judge the new file
        fs.rm(f"{root}/{manifest_name(name)}")
    target = write_atomic(directory, name, data)
    # written last: a run killed between the two leaves a complete checkpoint without manifest (read with a warning)
    write_atomic(directory, manifest_name(name), json.dumps(manifest).encode())
    _remove_older_steps(directory, keep=name)
    return target


def _remove_older_steps(directory: str | os.PathLike, *, keep: str) -> None:
    """Delete the step checkpoints that ``keep`` (just written) makes obsolete, with their manifests and shards."""
    fs, root = fs_of(directory)
    victims = []
    for _, _, path in list_step_checkpoints(directory):
        if path.rstrip("/").rsplit("/", 1)[-1] != keep:
            victims += [path, manifest_name(path)]
    for path in fs.ls(root, detail=False):  # shards, also those a killed run wrote without their .pt
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if _STEP_SHARDS.match(name) and name != shards_name(keep):
            victims.append(path)
    for victim in victims:
        try:
            if fs.exists(victim):
                fs.rm(victim, recursive=True)
        except OSError as exc:  # a leftover step file costs disk, not correctness: resume orders by name
            logger.warning("could not remove the old step checkpoint %s: %s", victim, exc)


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


def failure_causes(exc: BaseException) -> str:
    """What went wrong, in one line: each rank's error of torch's ``CheckpointException`` (its ``failures``, which
    its message would show as whole tracebacks), or ``exc`` itself."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(exc).__name__}: {exc}"
    causes = []
    for rank, failure in sorted(failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure  # (exception, its stack summary)
        causes.append(f"rank {rank}: {type(cause).__name__}" + (f": {cause}" if str(cause) else ""))
    return "; ".join(causes)


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


def to_cpu(obj: Any) -> Any:
    """A copy of ``obj`` (tensors in dicts, lists and tuples) with every tensor detached and on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj

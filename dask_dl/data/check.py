"""Verify a dask_dl store against its contract: metadata, shapes, labels, coordinates, shard files, every chunk.

:func:`check_store` reads the whole store once (each chunk decoded once) and reports every problem with the
samples it touches, so that a damaged store can be repaired (delete the shard and its status file, ingest again:
only missing shards are rewritten) instead of failing a training run half-way.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from dask_dl.data import store as contract
from dask_dl.data.order import warn_if_sorted
from dask_dl.data.schema import SPLITS
from dask_dl.data.store import StoreFiles, StoreLayout, lost_shards, open_store
from dask_dl.errors import DaskDLError

__all__ = ["StoreCheck", "check_store"]

_COLUMNS = ["check", "samples", "problem"]


@dataclass(frozen=True)
class StoreCheck:
    """What :func:`check_store` found.

    Attributes
    ----------
    store
        The store's path or URL.
    layout
        Its layout, when the metadata could be read.
    problems
        One row per problem: ``check`` (metadata, arrays, labels, coordinates, shards, chunks, rejects), ``samples``
        (the rows it touches, e.g. ``"16..23"``, empty for the whole store) and ``problem``.
    chunks_read
        Chunks decoded.
    notes
        What is not damage but will hurt training: a sample order far from shuffled
        (:class:`~dask_dl.data.order.SampleOrderWarning`, also warned).
    """

    store: str
    layout: StoreLayout | None
    problems: pd.DataFrame = field(repr=False)
    chunks_read: int = 0
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not len(self.problems)

    def summary(self) -> str:
        """Human-readable lines, as ``dask-dl check`` prints them."""
        notes = [f"  note: {note}" for note in self.notes]
        if self.ok:
            n = self.layout.n if self.layout else 0
            ok = f"{self.store}: ok ({n} samples, {self.chunks_read} chunks decoded, every shard present)"
            return "\n".join([ok, *notes])
        lines = [f"{self.store}: {len(self.problems)} problem(s)"]
        for row in self.problems.itertuples():
            where = f" samples {row.samples}" if row.samples else ""
            lines.append(f"  [{row.check}]{where}: {row.problem}")
        lines.append(
            "  repair: delete the damaged shard files and their _dask_dl/status/shard-*.json, then run ingest again "
            "(it rewrites only missing shards), or ingest into a new store"
        )
        return "\n".join(lines + notes)


def _span(rows: Any) -> str:
    rows = np.asarray(list(rows), dtype=np.int64)
    if not rows.size:
        return ""
    if rows.size == rows[-1] - rows[0] + 1 and np.all(np.diff(rows) == 1):
        return f"{rows[0]}..{rows[-1]}" if rows.size > 1 else str(rows[0])
    shown = ", ".join(map(str, rows[:8]))
    return shown + (f" and {rows.size - 8} more" if rows.size > 8 else "")


def check_store(store: str | os.PathLike) -> StoreCheck:
    """Verify every part of a dask_dl store and report problems by sample.

    Parameters
    ----------
    store
        Path or fsspec URL of a store written by :func:`dask_dl.ingest`.

    Returns
    -------
    StoreCheck
        ``ok`` is True when the metadata, array shapes and dtypes, labels, coordinates, shard and status files,
        every chunk (decoded) and the rejects table agree with the contract in :mod:`dask_dl.data.store`.

    Raises
    ------
    StoreNotFoundError
        Nothing at ``store``.

    Examples
    --------
    On a store of yours (not run as a doctest: it needs the store):

    >>> report = dask_dl.check_store("cxr.zarr")  # doctest: +SKIP
    >>> print(report.summary())  # doctest: +SKIP
    cxr.zarr: ok (112120 samples, 3504 chunks decoded, every shard present)
    """
    from dask_dl.errors import StoreNotFoundError

    url = os.fspath(store)
    problems: list[tuple[str, str, str]] = []
    try:
        url, group, layout = open_store(url, require_complete=False)
    except StoreNotFoundError:
        raise
    except DaskDLError as exc:
        return StoreCheck(url, None, pd.DataFrame([("metadata", "", str(exc))], columns=_COLUMNS))
    if not layout.complete:
        problems.append(("metadata", "", "the store is incomplete: an ingest into it did not finish; run it again"))
    problems += _arrays(group, layout)
    if not any(p[0] == "arrays" for p in problems):
        valid = np.asarray(group[contract.VALID][:], dtype=bool)
        problems += _labels(group, layout, valid)
        problems += _coordinates(group, layout)
        problems += _rejects(url, layout, valid)
    files = StoreFiles(url)
    problems += _shards(files, layout)
    chunk_problems, read = _chunks(group, layout, group[contract.VALID][:] if contract.VALID in group else None)
    problems += chunk_problems
    order = None
    if layout.complete and not any(p[0] == "arrays" for p in problems):  # not damage: the store reads as written
        order = warn_if_sorted(url, split="train", stacklevel=2)
    notes = (order.message(),) if order is not None and order.far else ()
    return StoreCheck(url, layout, pd.DataFrame(problems, columns=_COLUMNS), chunks_read=read, notes=notes)


def _arrays(group: Any, layout: StoreLayout) -> list[tuple[str, str, str]]:
    n, labels = layout.n, len(layout.labels)
    expected = {
        contract.IMAGE: ((n, *layout.image_shape), "uint8"),
        contract.LABEL: ((n, labels), "uint8"),
        contract.VALID: ((n,), "bool"),
        contract.SAMPLE: ((n,), "int64"),
        contract.FINDING: ((labels,), None),
        **{name: ((n,), None) for name in contract.COORDS},
    }
    out = []
    for name, (shape, dtype) in expected.items():
        if name not in group:
            out.append(("arrays", "", f"the {name!r} array is missing"))
            continue
        array = group[name]
        if tuple(array.shape) != shape:
            out.append(("arrays", "", f"{name!r} has shape {tuple(array.shape)}, the layout says {shape}"))
        if dtype is not None and str(array.dtype) != dtype:
            out.append(("arrays", "", f"{name!r} has dtype {array.dtype}, the contract says {dtype}"))
        dims, want = tuple(array.metadata.dimension_names or ()), contract.DIMS[name]
        if name == contract.IMAGE:
            want = layout.image_dims  # a colour store adds `channel`
        if dims != want:
            out.append(("arrays", "", f"{name!r} has dimensions {dims}, the contract says {want}"))
    if contract.IMAGE in group and int(group[contract.IMAGE].chunks[0]) != layout.chunk:
        out.append(("arrays", "", f"'image' chunks hold {group[contract.IMAGE].chunks[0]} images, not {layout.chunk}"))
    return out


def _labels(group: Any, layout: StoreLayout, valid: np.ndarray) -> list[tuple[str, str, str]]:
    out = []
    finding = [str(v) for v in np.asarray(group[contract.FINDING][:]).tolist()]
    if finding != list(layout.labels):
        out.append(("labels", "", f"the finding coordinate {finding} differs from the labels {list(layout.labels)}"))
    label = np.asarray(group[contract.LABEL][:])
    bad = np.flatnonzero((label > 1).any(axis=1))
    if bad.size:
        out.append(("labels", _span(bad), "label values other than 0 and 1"))
    if layout.task == "multiclass":
        wrong = np.flatnonzero(valid & (label.sum(axis=1) != 1))
        if wrong.size:
            out.append(("labels", _span(wrong), "a multiclass store needs exactly one label per sample"))
    return out


def _coordinates(group: Any, layout: StoreLayout) -> list[tuple[str, str, str]]:
    out = []
    sample = np.asarray(group[contract.SAMPLE][:])
    wrong = np.flatnonzero(sample != np.arange(layout.n))
    if wrong.size:
        out.append(("coordinates", _span(wrong), "the sample coordinate is not the row number"))
    values = {name: np.asarray(np.asarray(group[name][:]).tolist(), dtype=str) for name in contract.COORDS}
    for name, column in values.items():
        blank = np.flatnonzero(np.char.strip(column) == "")
        if blank.size:
            out.append(("coordinates", _span(blank), f"empty {name}"))
    bad_split = np.flatnonzero(~np.isin(values["split"], SPLITS))
    if bad_split.size:
        out.append(("coordinates", _span(bad_split), f"split not one of {list(SPLITS)}"))
    duplicated = np.flatnonzero(pd.Series(values["image_id"]).duplicated(keep=False).to_numpy())
    if duplicated.size:
        out.append(("coordinates", _span(duplicated), "image_id appears more than once"))
    splits = pd.Series(values["split"]).groupby(values["patient_id"]).nunique()
    for patient in splits.index[splits > 1][:3]:
        rows = np.flatnonzero(values["patient_id"] == patient)
        out.append(("coordinates", _span(rows), f"patient {patient!r} is in more than one split"))
    return out


def _rejects(url: str, layout: StoreLayout, valid: np.ndarray) -> list[tuple[str, str, str]]:
    if not layout.complete:
        return []
    data = StoreFiles(url).get(contract.REJECTS_KEY)
    if data is None:
        return [("rejects", "", f"the rejects table {contract.REJECTS_KEY} is missing")]
    try:
        rows = pd.read_parquet(io.BytesIO(data))["row"].to_numpy()
    except Exception as exc:  # pyarrow raises several kinds of errors for a damaged file
        return [("rejects", "", f"the rejects table cannot be read: {type(exc).__name__}: {exc}")]
    if not np.array_equal(np.sort(rows), np.flatnonzero(~valid)):
        differ = np.setxor1d(rows, np.flatnonzero(~valid))
        return [("rejects", _span(differ), "the rejects table and the valid array disagree")]
    return []


def _shards(files: StoreFiles, layout: StoreLayout) -> list[tuple[str, str, str]]:
    out = []
    done = set(files.list(contract.STATUS_PREFIX))
    lost = set(lost_shards(files, layout))
    for shard in range(layout.n_shards):
        rows = layout.shard_rows_of(shard)
        span = f"{rows.start}..{rows.stop - 1}"
        if shard in lost:
            out.append(("shards", span, f"shard {shard}'s file {layout.shard_key(shard)} is missing"))
        if layout.status_key(shard).rsplit("/", 1)[-1] not in done:
            out.append(("shards", span, f"shard {shard} has no status file: its ingest did not finish"))
    return out


def _chunks(group: Any, layout: StoreLayout, valid: np.ndarray | None) -> tuple[list[tuple[str, str, str]], int]:
    if contract.IMAGE not in group:
        return [], 0
    image = group[contract.IMAGE]
    out, read = [], 0
    for start in range(0, layout.n, layout.chunk):
        stop = min(start + layout.chunk, layout.n)
        try:
            block = np.asarray(image[start:stop])
            read += 1
        except Exception as exc:  # codecs raise their own errors for damaged bytes
            chunk = start // layout.chunk
            out.append(("chunks", f"{start}..{stop - 1}", f"chunk {chunk} cannot be decoded: {type(exc).__name__}"))
            continue
        if valid is not None and layout.complete:
            dirty = np.flatnonzero(~np.asarray(valid[start:stop], bool) & block.reshape(len(block), -1).any(axis=1))
            if dirty.size:
                out.append(("chunks", _span(dirty + start), "rejected samples hold pixels (they must be all zero)"))
    return out, read

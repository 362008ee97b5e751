"""Ingest a catalog into a sharded Zarr 3 store with one Dask task per shard.

The store (the contract every reader builds on):

==============  =====================  ==========================================================================
array           shape, dtype           notes
==============  =====================  ==========================================================================
``image``       (n, S, S) uint8        dims ``sample, y, x``; chunks ``(chunk, S, S)`` inside shards of
                                       ``chunk * shard`` images; zstd; rejected rows stay all zero
``label``       (n, n_labels) uint8    dims ``sample, finding``
``valid``       (n,) bool              False for rejected rows
coordinates     (n,) str               ``image_id``, ``patient_id``, ``split``, ``site``; ``finding`` (labels);
                                       ``sample`` int64 = row number 0..n-1
==============  =====================  ==========================================================================

The group attribute ``dask_dl`` holds ``format, size, chunk, shard, labels, task, n, complete``; row ``i`` is row
``i`` of the validated catalog. Beside the arrays, in the store's ``_dask_dl/`` group:

- ``status/shard-000012.json``: written (atomically) after shard 12 is written; it is how a restarted run knows
  which shards are done, and it holds that shard's per-row status (ok, reason);
- ``rejects.parquet``: the rejected rows with their reason, also returned as :attr:`IngestResult.rejects` and read
  back by :func:`read_rejects`. Rejected images do not fail the run.

The order of writes makes a killed run safe to restart: the skeleton (all arrays, ``valid`` all False,
``complete: false``) first; then the shards, each followed by its status file; then ``valid``, the rejects table
and ``complete: true``. A shard without a status file, half-written or not, is written again whole. Labels and
coordinates come from the catalog and are rewritten on every run, so a relabelled catalog with the same images
updates them.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import zarr
from zarr.codecs import ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore

from dask_dl import config
from dask_dl.data.images import ImageRejected, load_image
from dask_dl.data.schema import labels_of, task_of, validate_catalog
from dask_dl.errors import CatalogError, ConfigurationError, StoreError, StoreNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = ["IngestResult", "ingest", "read_rejects"]

logger = logging.getLogger(__name__)

FORMAT = 1
COORDS: tuple[str, ...] = ("image_id", "patient_id", "split", "site")
META_GROUP = "_dask_dl"
STATUS_PREFIX = f"{META_GROUP}/status/"
REJECTS_KEY = f"{META_GROUP}/rejects.parquet"
# label/valid/coordinate arrays are small: chunk them by at least this many rows to keep the file count low
_META_ROWS = 65536
_STATUS_COLUMNS = ["row", "image_id", "ok", "reason", "message"]


@dataclass(frozen=True, eq=False)
class IngestResult:
    """What :func:`ingest` did.

    Attributes
    ----------
    store
        The store path or URL.
    n
        Rows in the store (= rows of the catalog).
    n_written
        Images decoded and written by this run (resumed runs skip finished shards).
    n_rejected
        Rejected rows in the whole store.
    rejects
        Those rows: ``row, image_id, path, patient_id, split, site, reason, message``.
    shards_written, shards_skipped
        Shards written by this run, and shards found finished by an earlier run.
    seconds
        Wall time of the run.
    """

    store: str
    n: int
    n_written: int
    n_rejected: int
    rejects: pd.DataFrame = field(repr=False)
    shards_written: int
    shards_skipped: int
    seconds: float

    def summary(self) -> str:
        """One human-readable paragraph, as the CLI prints it."""
        rate = self.n_written / self.seconds if self.seconds > 0 else 0.0
        lines = [
            f"ingested {self.n} images into {self.store}: {self.n - self.n_rejected} valid, {self.n_rejected} rejected",
            f"  shards written {self.shards_written}, already done {self.shards_skipped}; "
            f"{self.n_written} images decoded in {self.seconds:.1f} s ({rate:.1f} images/s)",
        ]
        if self.n_rejected:
            counts = self.rejects["reason"].value_counts().sort_index()
            lines.append("  rejected: " + ", ".join(f"{reason} {count}" for reason, count in counts.items()))
            lines.append(f"  each rejected image with its reason: dask_dl.data.ingest.read_rejects({self.store!r})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The counts as a plain dict (without the rejects table)."""
        return {
            "store": self.store,
            "n": self.n,
            "n_written": self.n_written,
            "n_rejected": self.n_rejected,
            "shards_written": self.shards_written,
            "shards_skipped": self.shards_skipped,
            "seconds": self.seconds,
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items() if k != "seconds")
        return f"IngestResult({fields}, seconds={self.seconds:.2f})"


def ingest(
    catalog: pd.DataFrame,
    store: str | os.PathLike,
    *,
    size: int | None = None,
    chunk: int | None = None,
    shard: int | None = None,
    overwrite: bool = False,
    client: Client | None = None,
    progress: bool | None = None,
    rejects: str | os.PathLike | None = None,
) -> IngestResult:
    """Decode, grayscale and resize every image of ``catalog`` into a sharded Zarr store, on a Dask cluster.

    One task per Zarr shard (``chunk * shard`` images) writes that whole shard, so no two tasks ever touch the
    same shard file. Re-running on a store a killed run left behind writes only the missing shards.

    Parameters
    ----------
    catalog
        A catalog (see :mod:`dask_dl.data.schema`); validated first, before any work.
    store
        Local path or fsspec URL of the Zarr store; the workers must be able to write there and to read the
        catalog's paths.
    size, chunk, shard
        Image side, images per chunk, chunks per shard; default ``dask-dl.ingest.size/chunk/shard``.
    overwrite
        Replace an existing store that holds something else (other size, catalog, ...).
    client
        Dask client; default :func:`dask_dl.cluster.get_client` (the current client or a new local cluster).
    progress
        Show a ``distributed.progress`` bar; ``False`` logs a line per 10 % instead (batch jobs). Default: a bar
        when ``dask-dl.ingest.progress`` is true and the session is interactive (a terminal or a notebook).
    rejects
        Also write the rejects table to this Parquet file (it is always in ``<store>/_dask_dl/rejects.parquet``).

    Returns
    -------
    IngestResult

    Raises
    ------
    CatalogError
        The catalog is malformed (missing columns, duplicated ids, a patient in two splits, ...).
    StoreError
        The store holds another dataset and ``overwrite`` is False.
    ConfigurationError
        ``size``, ``chunk`` or ``shard`` is not a positive integer.

    Examples
    --------
    >>> result = dask_dl.ingest(catalog, "cxr.zarr", size=224)  # doctest: +SKIP
    >>> print(result.summary())  # doctest: +SKIP
    """
    from dask_dl.cluster import close_client, get_client

    started = time.perf_counter()
    catalog = validate_catalog(catalog)
    if not len(catalog):
        raise CatalogError("the catalog has no rows: there is nothing to ingest")
    layout = _layout(catalog, size=size, chunk=chunk, shard=shard)
    url = os.fspath(store)
    group = _prepare_store(url, catalog, layout, overwrite=overwrite)
    done = _finished_shards(group.store)
    jobs = [job for job in _jobs(catalog, layout) if job["shard"] not in done]
    if progress is None:  # a bar where someone watches; log lines in batch jobs and CI logs
        progress = bool(config.get("ingest.progress")) and _interactive()
    tables: list[pd.DataFrame] = []
    if jobs:  # a finished store needs no cluster
        client_ = get_client(client)
        try:
            tables = _run(client_, jobs, url, layout, progress=progress)
        finally:
            if client is None:
                close_client(client_)
    status = _all_status(group.store, layout, new=tables)
    rejected = _finish(group, catalog, status, layout)
    if rejects is not None:
        rejected.to_parquet(os.fspath(rejects), index=False)
    return IngestResult(
        store=url,
        n=layout["n"],
        n_written=int(sum(int(t["ok"].sum()) for t in tables)),
        n_rejected=len(rejected),
        rejects=rejected,
        shards_written=len(jobs),
        shards_skipped=len(done),
        seconds=time.perf_counter() - started,
    )


def read_rejects(store: str | os.PathLike) -> pd.DataFrame:
    """Return the rejects table of a finished store: ``row, image_id, path, ..., reason, message``."""
    data = _get(_open_store(os.fspath(store), read_only=True), REJECTS_KEY)
    if data is None:
        raise StoreNotFoundError(
            f"no rejects table in {os.fspath(store)!r}: the store was not written by a finished dask_dl.ingest; "
            "run ingest again to finish it"
        )
    return pd.read_parquet(io.BytesIO(data))


def _interactive() -> bool:
    import sys

    return sys.stdout.isatty() or "ipykernel" in sys.modules


# ---- layout and store checks -------------------------------------------------------------------------------


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ConfigurationError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


def _layout(catalog: pd.DataFrame, *, size: int | None, chunk: int | None, shard: int | None) -> dict[str, Any]:
    compressor = config.get("ingest.compressor")
    if compressor not in ("zstd", "none"):
        raise ConfigurationError(
            f"dask-dl.ingest.compressor is {compressor!r}; use 'zstd' or 'none', "
            "e.g. dask.config.set({'dask-dl.ingest.compressor': 'zstd'})"
        )
    image_ids = "\n".join(catalog["image_id"]).encode()
    return {
        "format": FORMAT,
        "size": _positive("size", config.get("ingest.size", size)),
        "chunk": _positive("chunk", config.get("ingest.chunk", chunk)),
        "shard": _positive("shard", config.get("ingest.shard", shard)),
        "labels": labels_of(catalog),
        "task": task_of(catalog),
        "n": len(catalog),
        "min_size": _positive("min-size", config.get("ingest.min-size")),
        "compressor": compressor,
        "image_ids_sha256": hashlib.sha256(image_ids).hexdigest(),
    }


# keys of the layout that go into the contract's ``dask_dl`` attribute; the rest go into ``dask_dl_ingest``
_CONTRACT_KEYS = ("format", "size", "chunk", "shard", "labels", "task", "n")


def _attrs(layout: dict[str, Any], *, complete: bool) -> dict[str, Any]:
    return {
        "dask_dl": {**{k: layout[k] for k in _CONTRACT_KEYS}, "complete": complete},
        "dask_dl_ingest": {k: v for k, v in layout.items() if k not in _CONTRACT_KEYS},
    }


def _open_store(url: str, *, read_only: bool = False) -> LocalStore | FsspecStore:
    if "://" in url and not url.startswith("file://"):
        return FsspecStore.from_url(url, read_only=read_only)
    return LocalStore(url.removeprefix("file://"), read_only=read_only)


def _differences(attrs: dict[str, Any], layout: dict[str, Any]) -> list[str]:
    stored = {**attrs.get("dask_dl_ingest", {}), **attrs.get("dask_dl", {})}
    names = {"image_ids_sha256": "catalog (hash of the image ids)"}
    return [
        f"{names.get(key, key)}: store has {stored.get(key)!r}, asked for {layout[key]!r}"
        for key in layout
        if stored.get(key) != layout[key]
    ]


def _prepare_store(url: str, catalog: pd.DataFrame, layout: dict[str, Any], *, overwrite: bool) -> zarr.Group:
    """Check an existing store against the request, then write the skeleton (arrays, coordinates, labels)."""
    store = _open_store(url)
    fresh = overwrite or sync(store.is_empty(""))
    if not fresh:
        try:
            existing = zarr.open_group(store, mode="r")
            attrs = dict(existing.attrs)
            fresh = not attrs and not list(existing.keys())  # a run killed right after creating the group
        except (FileNotFoundError, ValueError, TypeError):
            attrs = {}
    if not fresh:
        if "dask_dl" not in attrs:
            raise StoreError(
                f"{url!r} exists and is not a dask_dl store; choose another path, or pass overwrite=True "
                "to delete what is there and ingest into it"
            )
        diffs = _differences(attrs, layout)
        if diffs:
            raise StoreError(
                f"the store {url!r} holds another dataset: {'; '.join(diffs)}. Pass overwrite=True to replace it "
                "(or --overwrite on the command line), or ingest into a new store"
            )
    group = zarr.open_group(store, mode="w" if fresh else "r+", zarr_format=3)
    group.attrs.update(_attrs(layout, complete=False))
    if "image" not in group:  # also when a run was killed right after writing the attributes
        _create_image(group, layout)
    group.require_group(META_GROUP)
    _write_table_arrays(group, catalog, layout)
    return group


def _create_image(group: zarr.Group, layout: dict[str, Any]) -> None:
    n, size, chunk, shard = layout["n"], layout["size"], layout["chunk"], layout["shard"]
    group.create_array(
        "image",
        shape=(n, size, size),
        dtype="uint8",
        chunks=(chunk, size, size),
        shards=(chunk * shard, size, size),
        compressors=ZstdCodec(level=3) if layout["compressor"] == "zstd" else None,
        fill_value=0,
        dimension_names=("sample", "y", "x"),
        attributes={"coordinates": " ".join(COORDS)},
    )


def _write_table_arrays(group: zarr.Group, catalog: pd.DataFrame, layout: dict[str, Any]) -> None:
    """(Re)write ``label``, ``valid`` (all False) and the coordinates from the catalog."""
    n, labels = layout["n"], layout["labels"]
    shard_rows = layout["chunk"] * layout["shard"]
    rows = min(n, -(-_META_ROWS // shard_rows) * shard_rows)

    def create(name: str, values: np.ndarray, dims: tuple[str, ...], **kwargs: Any) -> None:
        array = group.create_array(
            name,
            shape=values.shape,
            dtype=values.dtype if values.dtype.kind != "U" else str,
            chunks=(rows, *values.shape[1:]) if dims[0] == "sample" else values.shape,
            dimension_names=dims,
            overwrite=True,
            **kwargs,
        )
        array[...] = values

    coords = {"coordinates": " ".join(COORDS)}
    label = catalog[labels].to_numpy(np.uint8).reshape(n, len(labels))
    create("label", label, ("sample", "finding"), attributes=coords)
    create("valid", np.zeros(n, bool), ("sample",), attributes=coords)
    create("sample", np.arange(n, dtype=np.int64), ("sample",))
    create("finding", np.array(labels, dtype=str), ("finding",))
    for name in COORDS:
        create(name, catalog[name].to_numpy(dtype=str), ("sample",))


# ---- shards ------------------------------------------------------------------------------------------------


def _status_key(shard: int) -> str:
    return f"{STATUS_PREFIX}shard-{shard:06d}.json"


def _get(store: LocalStore | FsspecStore, key: str) -> bytes | None:
    buffer = sync(store.get(key, prototype=default_buffer_prototype()))
    return None if buffer is None else buffer.to_bytes()


def _put(store: LocalStore | FsspecStore, key: str, data: bytes) -> None:
    # LocalStore writes to a temporary file and renames it; object stores' puts are atomic anyway
    sync(store.set(key, default_buffer_prototype().buffer.from_bytes(data)))


def _finished_shards(store: LocalStore | FsspecStore) -> set[int]:
    async def keys() -> list[str]:
        return [key async for key in store.list_prefix(STATUS_PREFIX)]

    names = [key.rsplit("/", 1)[-1] for key in sync(keys())]
    return {int(name[len("shard-") : -len(".json")]) for name in names if name.startswith("shard-")}


def _jobs(catalog: pd.DataFrame, layout: dict[str, Any]) -> Iterator[dict[str, Any]]:
    rows = layout["chunk"] * layout["shard"]
    for shard, start in enumerate(range(0, layout["n"], rows)):
        part = catalog.iloc[start : start + rows]
        yield {
            "shard": shard,
            "start": start,
            "paths": part["path"].tolist(),
            "image_ids": part["image_id"].tolist(),
        }


def _ingest_shard(job: dict[str, Any], *, url: str, size: int, min_size: int) -> pd.DataFrame:
    """The task: decode one shard's images, write the whole shard, then its status file."""
    block = np.zeros((len(job["paths"]), size, size), np.uint8)
    status = []
    for i, (path, image_id) in enumerate(zip(job["paths"], job["image_ids"], strict=True)):
        row = job["start"] + i
        try:
            block[i] = load_image(path, size=size, min_size=min_size)
            status.append((row, image_id, True, "", ""))
        except ImageRejected as exc:
            status.append((row, image_id, False, exc.reason, exc.detail))
    store = _open_store(url)
    image = zarr.open_array(store, path="image", mode="r+")
    # zarr reads an existing shard before writing into it, even when the write covers all of it; the file a killed
    # run left may be half-written and unreadable, so start from nothing (this task is the shard's only writer)
    sync(store.delete("image/" + image.metadata.encode_chunk_key((job["shard"], 0, 0))))
    image[job["start"] : job["start"] + len(block)] = block
    table = pd.DataFrame(status, columns=_STATUS_COLUMNS)
    record = {"shard": job["shard"], "start": job["start"], "status": table.to_dict(orient="list")}
    _put(store, _status_key(job["shard"]), json.dumps(record).encode())
    return table


def _run(
    client: Client, jobs: list[dict[str, Any]], url: str, layout: dict[str, Any], *, progress: bool
) -> list[pd.DataFrame]:
    from distributed import as_completed
    from distributed import progress as progress_bar

    from dask_dl.cluster.workers import cpu_workers

    run = uuid.uuid4().hex
    futures = client.map(
        _ingest_shard,
        jobs,
        url=url,
        size=layout["size"],
        min_size=layout["min_size"],
        key=[f"ingest-shard-{run}-{job['shard']}" for job in jobs],
        workers=cpu_workers(client),  # on a cluster with GPU workers, leave them to the trainers
    )
    try:
        if progress:
            progress_bar(futures)
            return client.gather(futures)
        tables, step = [], max(1, len(futures) // 10)
        for done, future in enumerate(as_completed(futures), 1):
            tables.append(future.result())
            if done % step == 0 or done == len(futures):
                logger.info("ingest %s: %d/%d shards written", url, done, len(futures))
        return tables
    finally:
        client.cancel(futures)


def _all_status(store: LocalStore | FsspecStore, layout: dict[str, Any], *, new: list[pd.DataFrame]) -> pd.DataFrame:
    """Per-row status of the whole store: this run's tables plus the status files of earlier runs."""
    written = {int(t["row"].iloc[0]) for t in new if len(t)}
    tables = list(new)
    for shard in sorted(_finished_shards(store)):
        record = json.loads(_get(store, _status_key(shard)))
        if record["start"] not in written:
            tables.append(pd.DataFrame(record["status"], columns=_STATUS_COLUMNS))
    status = pd.concat(tables, ignore_index=True).sort_values("row", ignore_index=True)
    if not np.array_equal(status["row"].to_numpy(), np.arange(layout["n"])):
        raise StoreError(
            f"the shard status files cover {len(status)} rows, not rows 0..{layout['n'] - 1}; the store is "
            "damaged: ingest again with overwrite=True"
        )
    return status


def _finish(group: zarr.Group, catalog: pd.DataFrame, status: pd.DataFrame, layout: dict[str, Any]) -> pd.DataFrame:
    """Write ``valid`` and the rejects table, then mark the store complete; return the rejects."""
    if not (status["image_id"].to_numpy() == catalog["image_id"].to_numpy()).all():
        raise StoreError("the shard status files name other images than the catalog: ingest with overwrite=True")
    ok = status["ok"].to_numpy(bool)
    group["valid"][:] = ok
    rejected = status.loc[~ok, ["row", "image_id", "reason", "message"]].reset_index(drop=True)
    extra = catalog.iloc[rejected["row"].to_numpy()][["path", "patient_id", "split", "site"]].reset_index(drop=True)
    rejected = pd.concat([rejected[["row", "image_id"]], extra, rejected[["reason", "message"]]], axis=1)
    rejected["row"] = rejected["row"].astype(np.int64)
    buffer = io.BytesIO()
    rejected.to_parquet(buffer, index=False)
    _put(group.store, REJECTS_KEY, buffer.getvalue())
    group.attrs.update(_attrs(layout, complete=True))
    return rejected

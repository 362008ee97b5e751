"""Ingest a catalog into a sharded Zarr 3 store with one Dask task per shard.

The layout of the store is the contract in :mod:`dask_dl.data.store`. Row ``i`` of the store is row
``catalog_row[i]`` of the validated catalog: a seeded random permutation by default (``dask-dl.ingest.order``), so
that every chunk the loader reads mixes labels as a full shuffle does, whatever the catalog's order. Beside the
arrays, in the store's ``_dask_dl/`` group:

- ``status/shard-000012.json``: written (atomically) after shard 12 is written; it is how a restarted run knows
  which shards are done, and it holds that shard's per-row status (ok, reason, message: for a kept image, what the
  decoder warned about while decoding it intact, such as padding after a DICOM's pixel data);
- ``rejects.parquet``: the rejected rows with their reason, also returned as :attr:`IngestResult.rejects` and read
  back by :func:`read_rejects`. A rejected image does not fail the run; a run that keeps no image, or rejects more
  than ``dask-dl.ingest.max-reject-share`` of them, fails with an :class:`~dask_dl.errors.IngestError` after
  writing the table.

The order of writes makes a killed run safe to restart: the skeleton (all arrays, ``valid`` all False,
``complete: false``) first; then the shards, each followed by its status file; then ``valid``, the rejects table
and ``complete: true``. A shard without a status file, half-written or not, is written again whole. Labels and
coordinates come from the catalog and are rewritten on every run, so a relabelled catalog with the same images
updates them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import re
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import zarr

from dask_dl import allocator, config
from dask_dl.checks import one_of, positive_int
from dask_dl.cluster.storage import absolute
from dask_dl.data import store as contract
from dask_dl.data.images import CHANNELS, ImageRejected, load_image, release_buffers
from dask_dl.data.lease import StoreLease
from dask_dl.data.paths import PathPolicy
from dask_dl.data.rejects import check_share
from dask_dl.data.schema import labels_of, task_of, validate_catalog
from dask_dl.data.store import StoreFiles, StoreLayout, lost_shards
from dask_dl.errors import CatalogError, ConfigurationError, StoreError, StoreNotFoundError
from dask_dl.interrupt import Interrupted, caught_interrupt

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = ["IngestResult", "ingest", "read_rejects"]

logger = logging.getLogger(__name__)

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
    min_size: int | None = None,
    max_reject_share: float | None = None,
    overwrite: bool = False,
    client: Client | None = None,
    progress: bool | None = None,
    rejects: str | os.PathLike | None = None,
    channels: int | None = None,
) -> IngestResult:
    """Decode, grayscale (or keep RGB) and resize every image of ``catalog`` into a sharded Zarr store, on Dask.

    One task per Zarr shard (``chunk * shard`` images) writes that whole shard, so no two tasks ever touch the
    same shard file. Re-running on a store a killed run left behind writes only the missing shards.

    The samples are stored in a seeded random permutation of the catalog (``dask-dl.ingest.order: shuffled``,
    ``order-seed``), so that the chunks a loader reads mix labels as a full shuffle does whatever the catalog's
    order (class folders list one class after another); :func:`dask_dl.data.store.catalog_rows` gives each
    sample's catalog row. ``order: catalog`` keeps the catalog's order.

    Parameters
    ----------
    catalog
        A catalog (see :mod:`dask_dl.data.schema`); validated first, before any work.
    store
        Local path or fsspec URL of the Zarr store; the workers must be able to write there and to read the
        catalog's paths.
    size, chunk, shard
        Image side, images per chunk, chunks per shard; default ``dask-dl.ingest.size/chunk/shard``.
    min_size
        Reject images with a side shorter than this. Default ``dask-dl.ingest.min-size``, and when that is unset
        ``size // 4``: an image is upscaled at most four times, so a 32 px collection ingests at ``size=32``.
    max_reject_share
        Fail (after writing the store and its rejects table) when more than this share of the images is
        rejected; default ``dask-dl.ingest.max-reject-share`` (0.5). A run that keeps no image always fails.
    overwrite
        Replace an existing store that holds something else (other size, catalog, ...).
    client
        Dask client; default :func:`dask_dl.cluster.get_client` (the current client or a new local cluster).
    progress
        Show a ``distributed.progress`` bar; ``False`` logs a line per 10 % instead (batch jobs). Default: a bar
        when ``dask-dl.ingest.progress`` is true and the session is interactive (a terminal or a notebook).
    rejects
        Also write the rejects table to this Parquet file (it is always in ``<store>/_dask_dl/rejects.parquet``).
    channels
        1: grey ``image(sample, y, x)``, colour images become their luma (radiographs); 3: RGB
        ``image(sample, y, x, channel)``, grey images are replicated into three channels and alpha is dropped (see
        :mod:`dask_dl.data.images`). Default ``dask-dl.ingest.channels`` (1).

    Returns
    -------
    IngestResult

    Raises
    ------
    CatalogError
        The catalog is malformed (missing columns, duplicated ids, a patient in two splits, ...).
    StoreError
        The store holds another dataset and ``overwrite`` is False; another ingest is writing it (its lease);
        the store's disk is full (free space and run again: it resumes).
    ConfigurationError
        ``size``, ``chunk``, ``shard`` or ``min_size`` is not a positive integer, ``max_reject_share`` is not
        a fraction, or ``channels`` is not 1 or 3.
    IngestError
        No image was kept, or more than ``max_reject_share`` were rejected; the message counts the reasons, shows
        the first rejected rows and the fix.

    Examples
    --------
    >>> result = dask_dl.ingest(catalog, "cxr.zarr", size=224)  # doctest: +SKIP
    >>> print(result.summary())  # doctest: +SKIP
    >>> dask_dl.ingest(read_folders("derm/"), "derm.zarr", size=128, channels=3)  # colour  # doctest: +SKIP
    """
    from dask_dl.cluster import close_client, get_client

    started = time.perf_counter()
    catalog = validate_catalog(catalog)
    if not len(catalog):
        raise CatalogError("the catalog has no rows: there is nothing to ingest")
    # the workers read the images, maybe from another folder (a gateway's, a batch job's): a relative path is taken
    # from this process's folder, as the store's is
    catalog = catalog.assign(path=catalog["path"].map(absolute))
    layout, options = _layout(catalog, size=size, chunk=chunk, shard=shard, min_size=min_size, channels=channels)
    # the hash of the image ids is over the catalog's order; the permutation depends on n and the seed only, so a
    # resumed run cuts the same shards
    catalog = catalog.iloc[layout.catalog_rows()].reset_index(drop=True)
    share = _share("max_reject_share", config.get("ingest.max-reject-share", max_reject_share))
    reading = {  # the driver's settings, not each worker's
        "max_image_bytes": positive_int("max-image-bytes", config.get("ingest.max-image-bytes")),
        "policy": PathPolicy.from_config(),
    }
    url = absolute(store)  # the workers that write it may run in another folder (a gateway's, a batch job's)
    lease = StoreLease(url)
    lease.refuse_if_held()  # a store another ingest is creating looks half-made: name that ingest instead
    try:  # before the lease: never write into a foreign folder
        _check_store(url, layout, options, overwrite=overwrite)
    except StoreError:
        lease.refuse_if_held()  # another ingest started in between: that is the news, not its half-made store
        raise
    with _disk_full(url, "its metadata"), lease:
        group = _prepare_store(url, catalog, layout, options, overwrite=overwrite, lease=lease)
        files = StoreFiles(url)
        done = _finished_shards(files)
        jobs = [job for job in _jobs(catalog, layout) if job["shard"] not in done]
        if progress is None:  # a bar where someone watches; log lines in batch jobs and CI logs
            progress = bool(config.get("ingest.progress")) and _interactive()
        tables: list[pd.DataFrame] = []
        if jobs:  # a finished store needs no cluster
            client_ = get_client(client)
            try:
                tables = _run(client_, jobs, url, layout, options, reading, progress=progress)
            except KeyboardInterrupt:
                written, total = len(_finished_shards(files)), layout.n_shards
                rest = f"write the other {total - written}" if written < total else "mark the store complete"
                raise Interrupted(
                    f"ingest into {url!r} stopped by Ctrl-C with {written} of {total} shards written; run the "
                    f"same ingest again to {rest} (it keeps the written shards)"
                ) from None
            finally:
                if client is None:
                    close_client(client_)
        status = _all_status(files, layout, new=tables)
        rejected = _finish(group, files, catalog, status, layout)
    if rejects is not None:
        rejected.to_parquet(os.fspath(rejects), index=False)
    result = IngestResult(
        store=url,
        n=layout.n,
        n_written=int(sum(int(t["ok"].sum()) for t in tables)),
        n_rejected=len(rejected),
        rejects=rejected,
        shards_written=len(jobs),
        shards_skipped=len(done),
        seconds=time.perf_counter() - started,
    )
    check_share(store=url, n=result.n, rejects=rejected, share=share, min_size=options["min_size"])
    return result


def read_rejects(store: str | os.PathLike) -> pd.DataFrame:
    """Return the rejects table of a finished store: ``row, image_id, path, ..., reason, message``."""
    data = StoreFiles(store).get(contract.REJECTS_KEY)
    if data is None:
        raise StoreNotFoundError(
            f"no rejects table in {os.fspath(store)!r}: the store was not written by a finished dask_dl.ingest; "
            "run ingest again to finish it"
        )
    return pd.read_parquet(io.BytesIO(data))


def _interactive() -> bool:
    return sys.stdout.isatty() or "ipykernel" in sys.modules


# ---- layout and store checks -------------------------------------------------------------------------------


def _share(name: str, value: Any) -> float:
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = float("nan")
    if isinstance(value, bool) or not 0.0 <= share <= 1.0:
        raise ConfigurationError(f"{name} must be a fraction in [0, 1], got {value!r}; pass e.g. {name}=0.5")
    return share


def _layout(
    catalog: pd.DataFrame,
    *,
    size: int | None,
    chunk: int | None,
    shard: int | None,
    min_size: int | None,
    channels: int | None = None,
) -> tuple[StoreLayout, dict[str, Any]]:
    """The store's layout, and the ingest options that decide which rows are rejected."""
    compressor = config.get("ingest.compressor")
    if compressor not in ("zstd", "none"):
        raise ConfigurationError(
            f"dask-dl.ingest.compressor is {compressor!r}; use 'zstd' or 'none', "
            "e.g. dask.config.set({'dask-dl.ingest.compressor': 'zstd'})"
        )
    layout = StoreLayout(
        size=positive_int("size", config.get("ingest.size", size), example=224),
        chunk=positive_int("chunk", config.get("ingest.chunk", chunk), example=32),
        shard=positive_int("shard", config.get("ingest.shard", shard), example=8),
        labels=tuple(labels_of(catalog)),
        task=one_of("task", task_of(catalog), contract.TASKS),
        n=len(catalog),
        channels=one_of("channels", config.get("ingest.channels", channels), CHANNELS),
        order=one_of("dask-dl.ingest.order", config.get("ingest.order"), contract.ORDERS),
        order_seed=_seed(config.get("ingest.order-seed")),
    )
    min_size = config.get("ingest.min-size", min_size)
    image_ids = "\n".join(catalog["image_id"]).encode()
    options = {
        "min_size": positive_int("min_size", max(1, layout.size // 4) if min_size is None else min_size),
        "compressor": compressor,
        "image_ids_sha256": hashlib.sha256(image_ids).hexdigest(),
    }
    return layout, options


def _seed(value: Any) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
        raise ConfigurationError(
            f"dask-dl.ingest.order-seed must be an integer >= 0, got {value!r}; e.g. "
            "dask.config.set({'dask-dl.ingest.order-seed': 0})"
        )
    return int(value)


def _differences(attrs: dict[str, Any], layout: StoreLayout, options: dict[str, Any]) -> list[str]:
    stored = {**attrs.get(contract.INGEST_ATTRIBUTE, {}), **attrs.get(contract.ATTRIBUTE, {})}
    asked = {**{k: v for k, v in layout.to_dict().items() if k != "complete"}, **options}
    names = {"image_ids_sha256": "catalog (hash of the image ids)", "order": "sample order (dask-dl.ingest.order)"}
    defaults = {"channels": 1, "order": "catalog", "order_seed": 0}  # stores written before these existed
    return [
        f"{names.get(key, key)}: store has {stored.get(key, defaults.get(key))!r}, asked for {value!r}"
        for key, value in asked.items()
        if stored.get(key, defaults.get(key)) != value
    ]


def _attrs(layout: StoreLayout, options: dict[str, Any]) -> dict[str, Any]:
    return {contract.ATTRIBUTE: layout.to_dict(), contract.INGEST_ATTRIBUTE: dict(options)}


def _check_store(url: str, layout: StoreLayout, options: dict[str, Any], *, overwrite: bool) -> bool:
    """Whether the store is to be written from scratch; a StoreError when it holds something else."""
    if overwrite or StoreFiles(url).is_empty():
        return True
    try:
        existing = zarr.open_group(contract.zarr_store(url, read_only=True), mode="r")
        attrs = dict(existing.attrs)
        with warnings.catch_warnings():  # the lease's folder is not a Zarr group yet: expected, not news
            warnings.filterwarnings("ignore", message=f"Object at {contract.META_GROUP} is not recognized")
            keys = list(existing.keys())
        if not attrs and not keys:  # a run killed right after creating the group
            return True
    except (FileNotFoundError, ValueError, TypeError):
        attrs = {}
    if contract.ATTRIBUTE not in attrs:
        raise StoreError(
            f"{url!r} exists and is not a dask_dl store; choose another path, or pass overwrite=True "
            "to delete what is there and ingest into it"
        )
    diffs = _differences(attrs, layout, options)
    if diffs:
        raise StoreError(
            f"the store {url!r} holds another dataset: {'; '.join(diffs)}. Pass overwrite=True to replace it "
            "(or --overwrite on the command line), or ingest into a new store"
        )
    return False


def _prepare_store(
    url: str,
    catalog: pd.DataFrame,
    layout: StoreLayout,
    options: dict[str, Any],
    *,
    overwrite: bool,
    lease: StoreLease,
) -> zarr.Group:
    """Check the store again under the lease (another ingest may have finished), then write the skeleton."""
    fresh = _check_store(url, layout, options, overwrite=overwrite)
    if fresh:  # not Zarr's mode "w": it deletes the lease too, and for that moment another ingest could take it
        StoreFiles(url).clear(keep=contract.LEASE_KEY)
    group = zarr.open_group(contract.zarr_store(url), mode="a" if fresh else "r+", zarr_format=3)
    group.attrs.update(_attrs(layout, options))
    if contract.IMAGE not in group:  # also when a run was killed right after writing the attributes
        contract.create_image(group, layout, compressor=options["compressor"])
    group.require_group(contract.META_GROUP)
    _write_table_arrays(group, catalog, layout)
    return group


def _write_table_arrays(group: zarr.Group, catalog: pd.DataFrame, layout: StoreLayout) -> None:
    """(Re)write the per-sample arrays from the (permuted) catalog: labels, valid all False, coordinates."""
    label = catalog[list(layout.labels)].to_numpy(np.uint8).reshape(layout.n, len(layout.labels))
    coords = {name: catalog[name].to_numpy(dtype=str) for name in contract.COORDS}
    contract.write_sample_arrays(group, layout, label=label, coords=coords)


# ---- shards ------------------------------------------------------------------------------------------------


def _finished_shards(files: StoreFiles) -> set[int]:
    names = files.list(contract.STATUS_PREFIX)
    return {int(name[6:12]) for name in names if re.fullmatch(r"shard-\d{6}\.json", name)}


def _jobs(catalog: pd.DataFrame, layout: StoreLayout) -> Iterator[dict[str, Any]]:
    for shard in range(layout.n_shards):
        rows = layout.shard_rows_of(shard)
        part = catalog.iloc[rows.start : rows.stop]
        yield {
            "shard": shard,
            "start": rows.start,
            "paths": part["path"].tolist(),
            "image_ids": part["image_id"].tolist(),
        }


def _ingest_shard(
    job: dict[str, Any], *, url: str, layout: dict[str, Any], min_size: int, max_image_bytes: int, policy: PathPolicy
) -> pd.DataFrame:
    """The task: decode one shard's images, write the whole shard, then its status file."""
    # the scheduler runs a finished task again when the worker that held its result dies before the driver let go
    # of it; the status file says the shard is written, and writing it again would delete it first (a hole in the
    # store when this worker dies in between)
    written = StoreFiles(url).get(StoreLayout.status_key(job["shard"]))
    if written is not None:
        return pd.DataFrame(json.loads(written)["status"], columns=_STATUS_COLUMNS)
    # the nanny's MALLOC_TRIM_THRESHOLD_ would fault in about 400 fresh pages per image (file bytes, Pillow's
    # intermediate images, zstd contexts, the shard's buffers): 0.7 ms of system time against 10 ms of decoding
    with allocator.kept_freed_memory():
        try:
            return _write_shard(
                job, url=url, layout=layout, min_size=min_size, max_image_bytes=max_image_bytes, policy=policy
            )
        finally:
            release_buffers()  # before the allocator hands the freed memory back to the system


def _write_shard(
    job: dict[str, Any], *, url: str, layout: dict[str, Any], min_size: int, max_image_bytes: int, policy: PathPolicy
) -> pd.DataFrame:
    layout_ = StoreLayout.from_dict(layout)
    size = layout_.size
    block = np.zeros((len(job["paths"]), *layout_.image_shape), np.uint8)
    status = []
    for i, (path, image_id) in enumerate(zip(job["paths"], job["image_ids"], strict=True)):
        row = job["start"] + i
        notes: list[str] = []  # the decoder's warnings about pixels it decoded intact: kept in the status file
        try:
            block[i] = load_image(
                path,
                size=size,
                min_size=min_size,
                max_image_bytes=max_image_bytes,
                policy=policy,
                channels=layout_.channels,
                notes=notes,
            )
            status.append((row, image_id, True, "", "; ".join(notes)))
        except ImageRejected as exc:
            status.append((row, image_id, False, exc.reason, exc.detail))
    files = StoreFiles(url)
    image = zarr.open_array(contract.zarr_store(url), path=contract.IMAGE, mode="r+")
    # zarr reads an existing shard before writing into it, even when the write covers all of it; the file a killed
    # run left may be half-written and unreadable, so start from nothing (this task is the shard's only writer)
    table = pd.DataFrame(status, columns=_STATUS_COLUMNS)
    # zarr writes no file for an all-zero shard: say so, so that a missing file can be told from a lost one
    record = {
        "shard": job["shard"],
        "start": job["start"],
        "empty": not block.any(),
        "status": table.to_dict(orient="list"),
    }
    rows = layout_.shard_rows_of(job["shard"])
    with _disk_full(url, f"shard {job['shard']} (samples {rows.start}..{rows.stop - 1})"):
        files.delete(layout_.shard_key(job["shard"]))
        image[job["start"] : job["start"] + len(block)] = block
        files.put(layout_.status_key(job["shard"]), json.dumps(record).encode())
    return table


@contextlib.contextmanager
def _disk_full(url: str, what: str) -> Iterator[None]:
    """Turn "no space left" while writing into a StoreError that says how to go on."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise StoreError(
            f"no space left on the device of the store {url!r} while writing {what} ({exc.strerror}); free space "
            "or move the store, then run ingest again: it resumes with the shards that are missing"
        ) from None


def _run(
    client: Client,
    jobs: list[dict[str, Any]],
    url: str,
    layout: StoreLayout,
    options: dict[str, Any],
    reading: dict[str, Any],
    *,
    progress: bool,
) -> list[pd.DataFrame]:
    """Write the shards of ``jobs`` on the cluster's CPU workers; return their status tables.

    On Ctrl-C the shards not started are cancelled and the ones being written are waited for (a second Ctrl-C
    leaves them), so that no task writes into the store once the lease is given back; KeyboardInterrupt follows.
    """
    from distributed import progress as progress_bar

    from dask_dl.cluster.storage import check_visible
    from dask_dl.cluster.workers import cpu_workers

    writers = cpu_workers(client)  # on a cluster with GPU workers, leave them to the trainers
    check_visible(client, url, workers=writers)  # before any work: which worker cannot reach the store
    prefix = f"ingest-shard-{uuid.uuid4().hex}-"
    futures = client.map(
        _ingest_shard,
        jobs,
        url=url,
        layout=layout.to_dict(),
        min_size=options["min_size"],
        **reading,
        key=[f"{prefix}{job['shard']}" for job in jobs],
        workers=writers,
    )
    try:
        if progress:  # the bar blocks; Python's own handler raises Ctrl-C in its wait
            progress_bar(futures)
            return client.gather(futures)
        return _gather_logged(futures, url)
    except KeyboardInterrupt:
        if progress and sys.stdout.isatty():
            print(flush=True)  # end the bar's line: what follows starts on a line of its own
        client.cancel(futures)  # the shards not started; the running ones finish under the lease
        _wait_for_running(client, prefix)
        raise
    finally:
        client.cancel(futures)  # after a failed shard, the others are not wanted


def _gather_logged(futures: list[Any], url: str) -> list[pd.DataFrame]:
    """The futures' results as they finish, with a log line per tenth; Ctrl-C is checked between polls."""
    from distributed import wait

    tables: list[pd.DataFrame] = []
    pending, step = list(futures), max(1, len(futures) // 10)
    with caught_interrupt() as interrupt:  # never lost in a finalizer (dask_dl.interrupt)
        while pending:
            interrupt.check()
            waiting = []
            for future in pending:
                if not future.done():
                    waiting.append(future)
                    continue
                tables.append(future.result())  # a failed shard raises here, as it did in the task
                if len(tables) % step == 0 or len(tables) == len(futures):
                    logger.info("ingest %s: %d/%d shards written", url, len(tables), len(futures))
            if len(waiting) == len(pending):  # back as soon as a shard is written, at the latest in 0.1 s
                with contextlib.suppress(TimeoutError):
                    wait(waiting, timeout=0.1, return_when="FIRST_COMPLETED")
            pending = waiting
    return tables


def _running_keys(prefix: str, dask_worker: Any = None) -> list[str]:
    """On a worker: the keys starting with ``prefix`` that a thread still runs (cancelled ones included)."""
    return [ts.key for ts in dask_worker.state.executing if str(ts.key).startswith(prefix)]


def _wait_for_running(client: Client, prefix: str) -> None:
    """Wait until no worker runs a task whose key starts with ``prefix``; a second Ctrl-C stops waiting."""
    told = False
    with caught_interrupt() as interrupt:
        while True:
            per_worker = client.run(_running_keys, prefix, on_error="return")  # a lost worker runs nothing
            running = sum(len(keys) for keys in per_worker.values() if isinstance(keys, list))
            if not running:
                return
            if not told:
                logger.warning(
                    "ingest stopping: waiting for the %d shard(s) being written to finish (Ctrl-C again to leave "
                    "them; the next ingest rewrites them)",
                    running,
                )
                told = True
            interrupt.check()
            time.sleep(0.2)


def _all_status(files: StoreFiles, layout: StoreLayout, *, new: list[pd.DataFrame]) -> pd.DataFrame:
    """Per-row status of the whole store: this run's tables plus the status files of earlier runs."""
    written = {int(t["row"].iloc[0]) for t in new if len(t)}
    tables = list(new)
    for shard in sorted(_finished_shards(files)):
        record = json.loads(files.get(layout.status_key(shard)))
        if record["start"] not in written:
            tables.append(pd.DataFrame(record["status"], columns=_STATUS_COLUMNS))
    status = pd.concat(tables, ignore_index=True).sort_values("row", ignore_index=True)
    if not np.array_equal(status["row"].to_numpy(), np.arange(layout.n)):
        raise StoreError(
            f"the shard status files cover {len(status)} rows, not rows 0..{layout.n - 1}; the store is "
            "damaged: ingest again with overwrite=True"
        )
    return status


def _finish(
    group: zarr.Group, files: StoreFiles, catalog: pd.DataFrame, status: pd.DataFrame, layout: StoreLayout
) -> pd.DataFrame:
    """Write ``valid`` and the rejects table, then mark the store complete; return the rejects."""
    if not (status["image_id"].to_numpy() == catalog["image_id"].to_numpy()).all():
        raise StoreError("the shard status files name other images than the catalog: ingest with overwrite=True")
    missing = lost_shards(files, layout)
    if missing:  # e.g. deleted by a process that ignored the lease: rewrite them on the next run
        for shard in missing:
            files.delete(layout.status_key(shard))
        rows = ", ".join(f"{layout.shard_rows_of(s).start}..{layout.shard_rows_of(s).stop - 1}" for s in missing[:5])
        raise StoreError(
            f"after writing, the store {files.url!r} lacks the file(s) of shard(s) {missing[:5]} (samples {rows}); "
            "it is not marked complete. Run ingest again: it rewrites those shards"
        )
    ok = status["ok"].to_numpy(bool)
    group[contract.VALID][:] = ok
    rejected = status.loc[~ok, ["row", "image_id", "reason", "message"]].reset_index(drop=True)
    extra = catalog.iloc[rejected["row"].to_numpy()][["path", "patient_id", "split", "site"]].reset_index(drop=True)
    rejected = pd.concat([rejected[["row", "image_id"]], extra, rejected[["reason", "message"]]], axis=1)
    rejected["row"] = rejected["row"].astype(np.int64)
    buffer = io.BytesIO()
    rejected.to_parquet(buffer, index=False)
    files.put(contract.REJECTS_KEY, buffer.getvalue())
    group.attrs.update({contract.ATTRIBUTE: layout.replace(complete=True).to_dict()})
    return rejected

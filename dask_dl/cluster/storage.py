"""Data where the workers are: object-storage settings given once, and paths checked from the workers' side.

Gateway and HPC workers rarely share the client's disk, so stores, catalogs, checkpoints and ONNX models live on
object storage (``s3://...``) reached through fsspec. :func:`set_storage_options` gives the storage options
(endpoint, credentials) once: they become fsspec's defaults for that protocol in this process and, through a
worker plugin, on every worker, including workers that join later, so no function needs ``storage_options=``.
:func:`check_visible` asks every worker whether it can see a path before work starts, and names the ones that
cannot.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin

from dask_dl.cluster.workers import ask_workers
from dask_dl.errors import ConfigurationError, StoreNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = [
    "StorageOptions",
    "absolute",
    "check_visible",
    "exists",
    "fetch",
    "file_stamp",
    "is_url",
    "publish",
    "set_storage_options",
]

logger = logging.getLogger(__name__)


class StorageOptions(WorkerPlugin):
    """Worker plugin that sets fsspec's default options per protocol (``fsspec.config.conf``) on a worker."""

    name = "dask-dl-storage-options"

    def __init__(self, options: dict[str, dict[str, Any]]) -> None:
        self.options = options

    def setup(self, worker: Any = None) -> None:
        _apply(self.options)


def _apply(options: dict[str, dict[str, Any]]) -> None:
    import fsspec.config

    for protocol, values in options.items():
        fsspec.config.conf[protocol] = dict(values)  # replaces earlier options of the protocol, not merged
        _forget_instances(protocol)


def _forget_instances(protocol: str) -> None:
    """Drop cached filesystems of ``protocol``: they were made with the old options."""
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        logger.debug("no fsspec filesystem for %r yet (%s): nothing cached to forget", protocol, exc)
        return
    cls.clear_instance_cache()


def set_storage_options(client: Client | None, options: dict[str, dict[str, Any]]) -> None:
    """Use ``options`` for every fsspec URL of a protocol, here and on every worker of ``client``'s cluster.

    Parameters
    ----------
    client
        Client of the cluster whose workers get the options (now and when they join later); None: only here.
    options
        ``{protocol: storage options}``, e.g. ``{"s3": {"endpoint_url": "http://127.0.0.1:9000", "key": ...,
        "secret": ...}}``.

    Raises
    ------
    ConfigurationError
        ``options`` is not a mapping of protocol names to mappings.

    Examples
    --------
    >>> set_storage_options(client, {"s3": {"endpoint_url": "https://minio.example.org"}})  # doctest: +SKIP
    >>> dask_dl.ingest(catalog, "s3://bucket/cxr.zarr", client=client)  # doctest: +SKIP
    """
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise ConfigurationError(
            f"storage options must map a protocol to its options, got {options!r}; pass e.g. "
            "{'s3': {'endpoint_url': 'http://127.0.0.1:9000'}}"
        )
    _apply(options)
    if client is not None:
        client.register_plugin(StorageOptions(options))


def _probe(path: str) -> str | None:
    """On a worker: None when ``path`` exists, else why not."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(path)
        return None if fs.exists(root) else "does not exist there"
    except Exception as exc:  # a probe: every failure is an answer, reported with the worker's name
        return f"{type(exc).__name__}: {exc}"


def check_visible(client: Client, *paths: str | os.PathLike, workers: list[str] | None = None) -> None:
    """Make sure every worker (or ``workers``) sees every path, before any work is sent.

    A worker lost while it is asked is left out (:func:`~dask_dl.cluster.workers.ask_workers`): it takes no work.

    Parameters
    ----------
    client
        Client of the cluster.
    *paths
        Local paths or fsspec URLs of things the workers will open (a store, a model, a checkpoint folder).
    workers
        Only ask these workers (e.g. the trainers); default all.

    Raises
    ------
    StoreNotFoundError
        A worker cannot see a path; the message names the worker, the path and why, and the fix.
    """
    urls = [os.fspath(p) for p in paths if p is not None]
    if not urls:
        return
    answers = ask_workers(client, lambda: {url: _probe(url) for url in urls}, workers=workers)
    problems = [(w, url, why) for w, found in sorted(answers.items()) for url, why in found.items() if why]
    if problems:
        lines = "; ".join(f"worker {w} cannot see {url!r} ({why})" for w, url, why in problems)
        raise StoreNotFoundError(
            f"{lines}. The workers open these paths themselves: put them on storage every worker reaches (a "
            f"shared filesystem, or s3://... with dask_dl.cluster.set_storage_options(client, {{'s3': {{...}}}}))"
        )


# ---- single files (ONNX models) on object storage ---------------------------------------------------------------
# onnxruntime and onnx read local files only: a model on s3:// is fetched once per machine into a cache keyed by
# its URL and version, and an exported model is written locally, checked, then uploaded.


def is_url(path: str | os.PathLike) -> bool:
    """True for an fsspec URL of a remote filesystem (``s3://...``), False for local paths and ``file://``."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def absolute(path: str | os.PathLike) -> str:
    """``path`` as a worker must be told it: a local path made absolute (from this process's folder), a URL as is.

    A worker may run in another folder than the client (a gateway's or a batch job's working folder, a remote
    machine with a shared filesystem), where a relative path names another place. ``file://`` is dropped.
    """
    text = os.fspath(path)
    if is_url(text):
        return text
    return os.path.abspath(os.path.expanduser(text.removeprefix("file://")))


def file_stamp(path: str | os.PathLike) -> tuple[int, int]:
    """``(version, size)`` of a file: modification time for local files, a hash of the ETag (or mtime) for URLs.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    """
    if not is_url(path):
        st = os.stat(path)
        return (st.st_mtime_ns, st.st_size)
    import fsspec

    fs, root = fsspec.core.url_to_fs(os.fspath(path))
    info = fs.info(root)
    version = str(info.get("ETag") or info.get("LastModified") or info.get("mtime") or "")
    return (int(hashlib.sha256(version.encode()).hexdigest()[:15], 16), int(info["size"]))


def fetch(path: str | os.PathLike) -> str:
    """A local path with the contents of ``path``: itself when local, else a cached copy of the remote file."""
    if not is_url(path):
        return os.fspath(path)
    import fsspec

    url = os.fspath(path)
    stamp = file_stamp(url)
    name = hashlib.sha256(f"{url}|{stamp}".encode()).hexdigest()[:20] + "-" + os.path.basename(url)
    folder = os.path.join(tempfile.gettempdir(), "dask-dl-fetched")
    local = os.path.join(folder, name)
    if not os.path.exists(local):
        os.makedirs(folder, exist_ok=True)
        partial = f"{local}.{os.getpid()}.part"
        fs, root = fsspec.core.url_to_fs(url)
        fs.get_file(root, partial)
        os.replace(partial, local)  # atomic: other processes on this machine see the whole file or none
    return local


def exists(path: str | os.PathLike) -> bool:
    """Whether a local path or fsspec URL exists."""
    if not is_url(path):
        return os.path.exists(path)
    import fsspec

    fs, root = fsspec.core.url_to_fs(os.fspath(path))
    return fs.exists(root)


def publish(local: str | os.PathLike, url: str) -> None:
    """Upload the finished local file ``local`` to ``url`` (one PUT: readers see the old object or the new one)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    fs.put_file(os.fspath(local), root)

"""One writer per store: a lease file that two ingests into one store cannot both hold.

The lease is ``_dask_dl/lease.json`` in the store, holding the writer's host, pid, token and the time of its last
heartbeat (a thread renews it while the ingest runs). A second ingest is refused with a message naming the holder,
unless the lease is stale: its process is gone (same host) or its heartbeat is older than
``dask-dl.ingest.lease-stale`` seconds (another host). Local leases are created with ``O_EXCL``, so of two
processes that race for a free store exactly one wins; for the instant between that create and the write of its
record the file is empty, and a lease that cannot be read is held (it is being written) until it is older than
``lease-stale`` seconds (its writer died in that instant).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from dask_dl import config
from dask_dl.data import store as contract
from dask_dl.data.store import StoreFiles
from dask_dl.errors import StoreError

__all__ = ["StoreLease"]

logger = logging.getLogger(__name__)


class StoreLease:
    """The right to write one store, held from :meth:`acquire` to :meth:`release` (or as a context manager)."""

    def __init__(self, url: str, *, stale_after: float | None = None) -> None:
        self.files = StoreFiles(url)
        self.url = url
        self.stale_after = float(config.get("ingest.lease-stale", stale_after))
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- holding --------------------------------------------------------------------------------------------

    def _record(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "token": self.token, "heartbeat": time.time()}

    def _create(self) -> bool:
        """Write the lease if there is none; False when another is there."""
        data = json.dumps(self._record()).encode()
        if not self.files.local:  # object stores: no exclusive create; write, then read back who won
            if self.files.get(contract.LEASE_KEY) is not None:
                return False
            self.files.put(contract.LEASE_KEY, data)
            return self._holder() is not None and self._holder().get("token") == self.token
        path = self.files.path(contract.LEASE_KEY)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def _holder(self) -> dict[str, Any] | None:
        data = self.files.get(contract.LEASE_KEY)
        if data is None:
            return None
        try:
            record = json.loads(data)
            return record if isinstance(record, dict) else {}
        except ValueError:  # being written (empty for an instant after its create), or cut short by a crash
            return {}

    def _stale(self, holder: dict[str, Any]) -> str | None:
        """Why the lease of ``holder`` (``{}``: a lease that cannot be read) no longer holds, or None while it does."""
        if not holder:
            return self._unreadable_stale()
        age = time.time() - float(holder.get("heartbeat", 0) or 0)
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            if not _alive(holder["pid"]):
                return f"its process {holder['pid']} on this host is gone"
            return None
        if age > self.stale_after:
            return f"its last heartbeat is {age:.0f} s old (dask-dl.ingest.lease-stale is {self.stale_after:g} s)"
        return None

    def _unreadable_stale(self) -> str | None:
        """A local lease that cannot be read is being written by the ingest that just created it, unless it is old."""
        why = "it cannot be read"
        if not self.files.local:  # object-store puts are whole: an unreadable lease is damaged
            return why
        try:
            age = time.time() - os.path.getmtime(self.files.path(contract.LEASE_KEY))
        except FileNotFoundError:  # given back in the meantime: free
            return why
        if age <= self.stale_after:
            return None
        return f"{why} and is {age:.0f} s old (dask-dl.ingest.lease-stale is {self.stale_after:g} s)"

    def acquire(self) -> StoreLease:
        """Take the lease, or raise a StoreError naming the ingest that holds it."""
        for _ in range(3):  # a stale lease removed by us may be taken by a third process in between
            if self._create():
                self._start_heartbeat()
                return self
            holder = self._holder()
            if holder is None:
                continue
            why = self._stale(holder)
            if why is None:
                raise self._held(holder)
            logger.warning("taking over the stale lease of %r: %s", self.url, why)
            self.files.delete(contract.LEASE_KEY)
        raise StoreError(f"could not take the lease of {self.url!r}: other ingests keep taking it; run one at a time")

    def _held(self, holder: dict[str, Any]) -> StoreError:
        if not holder:  # created an instant ago, its record not written yet
            return StoreError(
                f"another ingest is writing {self.url!r} (it is taking the lease at this moment); wait for it to "
                "finish, then run this one again (it resumes). If no ingest is running, delete "
                f"{contract.LEASE_KEY} in the store"
            )
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("heartbeat", 0))))
        return StoreError(
            f"another ingest is writing {self.url!r} (host {holder.get('host')}, pid {holder.get('pid')}, "
            f"alive at {since}); wait for it to finish, then run this one again (it resumes). If that "
            f"process is gone, delete {contract.LEASE_KEY} in the store"
        )

    def refuse_if_held(self) -> None:
        """Raise the StoreError of :meth:`acquire` when a live lease is there, without taking it.

        Checked before looking at the store: a store another ingest is creating looks half-made.
        """
        holder = self._holder()
        if holder is not None and self._stale(holder) is None:
            raise self._held(holder)

    def _beat(self) -> None:
        holder = self._holder()
        if holder is not None and holder.get("token") == self.token:
            self.files.put(contract.LEASE_KEY, json.dumps(self._record()).encode())

    def _start_heartbeat(self) -> None:
        interval = max(0.5, self.stale_after / 4)

        def run() -> None:
            while not self._stop.wait(interval):
                try:
                    self._beat()
                except OSError as exc:  # a storage hiccup: the next beat tries again
                    logger.warning("renewing the lease of %r failed: %s", self.url, exc)

        self._thread = threading.Thread(target=run, name="dask-dl-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        holder = self._holder()
        if holder is not None and holder.get("token") == self.token:
            self.files.delete(contract.LEASE_KEY)

    def __enter__(self) -> StoreLease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True

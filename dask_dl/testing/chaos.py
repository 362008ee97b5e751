"""A worker killer for chaos tests and benchmarks: SIGKILL a random worker of a local cluster, again and again.

distributed's own :class:`distributed.chaos.KillWorker` is a worker plugin: each worker ends itself at a random
time, by ``sys.exit`` or a segfault, once. A test of recovery needs more say than that: which workers may die (a
run's trainers), how often, how many times in all, and a record of each kill to compare with what the run
reports. :class:`WorkerKiller` is that, from the outside: it asks the scheduler for the workers' process ids and
sends ``SIGKILL`` (no goodbye to the scheduler, no teardown, what an out-of-memory killer or a lost VM does).
The workers' nannies start replacements, so the cluster heals while the work goes on.

It kills only processes this process started (a ``LocalCluster(processes=True)`` of its own), never a worker of
a remote or shared cluster.

    with WorkerKiller(client, every=1.0, max_kills=10) as killer:
        dask_dl.ingest(catalog, store, client=client)
    print(len(killer.kills), "kills survived")
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    import pandas as pd
    from distributed import Client

__all__ = [
    "Kill",
    "WorkerKiller",
    "large_images",
    "pause_workers_above",
    "paused_workers",
    "store_differences",
    "worker_states",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kill:
    """One ``SIGKILL``: the worker's address and process id, and the wall time (``time.time()``) it was sent."""

    address: str
    pid: int
    at: float


class WorkerKiller:
    """SIGKILL a random worker of ``client``'s local cluster every ``every`` seconds, on a thread of its own.

    The thread stops by itself after ``max_kills`` kills or ``max_seconds`` seconds, whichever comes first, or at
    :meth:`stop` (or the end of a ``with`` block). :meth:`kill` kills one worker now, for tests that choose the
    moment themselves (a trainer once per epoch).

    Parameters
    ----------
    client
        Client of a cluster whose worker processes this process started (``LocalCluster(processes=True)``, with
        nannies so that the killed workers come back).
    every
        Seconds between kills; the first comes ``every`` seconds after :meth:`start`.
    max_kills, max_seconds
        Bounds of the thread: it stops after that many kills or that long after :meth:`start`.
    among
        A function returning the addresses that may be killed (say ``lambda: run.workers``); default every
        worker of the cluster.
    keep
        Never kill while only this many workers (of those ``among`` allows) are up, so that some work goes on
        between the nannies' restarts; a tick with none to spare kills nothing.
    min_age
        Never kill while a restart is under way: while fewer workers are up than the most seen, or one of them
        joined the scheduler less than this many seconds ago. A worker SIGKILLed while another nanny's restart
        was under way was, now and then, never started again (its nanny logged "Restarting worker" and started no
        process): a failure of the harness, not of the work under test.
    seed
        Seed of the choice of victims.

    Attributes
    ----------
    kills : list of Kill
        Every kill so far, in order.
    """

    def __init__(
        self,
        client: Client,
        *,
        every: float = 2.0,
        max_kills: int = 10,
        max_seconds: float = 120.0,
        among: Callable[[], Sequence[str]] | None = None,
        keep: int = 1,
        min_age: float = 2.0,
        seed: int = 0,
    ) -> None:
        if not every > 0 or max_kills < 0 or not max_seconds > 0 or keep < 0 or min_age < 0:
            raise ValueError(
                f"every={every!r}, max_seconds={max_seconds!r} must be positive and max_kills={max_kills!r}, "
                f"keep={keep!r}, min_age={min_age!r} at least 0"
            )
        self.client = client
        self.every, self.max_kills, self.max_seconds = every, max_kills, max_seconds
        self.among, self.keep, self.min_age = among, keep, min_age
        self.kills: list[Kill] = []
        self._most = 0  # the most workers seen up at once
        self._random = random.Random(seed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ---- one kill ------------------------------------------------------------------------------------------

    def kill(self, among: Sequence[str] | None = None) -> Kill | None:
        """SIGKILL one random running worker (of ``among``, default :attr:`among`'s); None when none is to spare or
        a restart is under way.

        Raises
        ------
        RuntimeError
            The chosen worker's process is not one this process started: it is not a local cluster's.
        """
        workers = self.client.run_on_scheduler(_running_workers)
        dead = {kill.pid for kill in self.kills}
        # a killed worker stays on the scheduler's list until its nanny notices: never count (or kill) it twice
        alive = {address: w for address, w in workers.items() if w["pid"] not in dead}
        self._most = max(self._most, len(alive))
        if len(alive) < self._most or any(w["age"] < self.min_age for w in alive.values()):
            return None  # a restart is under way
        allowed = set(among if among is not None else self.among() if self.among is not None else alive)
        up = sorted(address for address in alive if address in allowed)
        if len(up) <= self.keep:
            return None
        address = self._random.choice(up)
        pid = int(alive[address]["pid"])
        if not _ours(pid, address):
            return None  # gone since the scheduler listed it
        os.kill(pid, signal.SIGKILL)
        kill = Kill(address=address, pid=pid, at=time.time())
        self.kills.append(kill)
        logger.info("chaos: SIGKILLed worker %s (pid %d), kill %d", address, pid, len(self.kills))
        return kill

    # ---- the thread ----------------------------------------------------------------------------------------

    def start(self) -> WorkerKiller:
        """Start killing on a thread of its own; returns self."""
        if self._thread is not None:
            raise RuntimeError("this WorkerKiller was started already: make a new one")
        self._thread = threading.Thread(target=self._loop, name="dask-dl-chaos", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> WorkerKiller:
        """Stop the thread and wait for it; raises what the thread raised, if anything. Returns self."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self

    @property
    def running(self) -> bool:
        """Whether the thread still kills (False once it reached a bound or was stopped)."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> WorkerKiller:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _loop(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        try:
            while len(self.kills) < self.max_kills:
                if self._stop.wait(min(self.every, max(0.0, deadline - time.monotonic()))):
                    return
                if time.monotonic() >= deadline:
                    return
                self.kill()
        except BaseException as exc:  # handed to stop(): a killer that fails must fail the test that uses it
            self._error = exc


def _running_workers(dask_scheduler: Any) -> dict[str, dict[str, float]]:
    """On the scheduler: the process id of each worker whose status is running, and seconds since it joined."""
    from distributed.core import Status

    now = time.time()
    joined = {}
    for address, ws in dask_scheduler.workers.items():
        if ws.status == Status.running:
            added = [t for t, event in dask_scheduler.get_events(address) if event.get("action") == "add-worker"]
            joined[address] = {"pid": ws.pid, "age": now - max(added, default=0.0)}
    return joined


def _ours(pid: int, address: str) -> bool:
    """Whether ``pid`` still runs (False if it has ended); refuse a process that is not a descendant of this one
    (a remote or shared cluster's worker)."""
    import psutil

    try:
        ancestors = {parent.pid for parent in psutil.Process(pid).parents()}
    except psutil.NoSuchProcess:
        return False
    if os.getpid() not in ancestors:
        raise RuntimeError(
            f"worker {address} runs as pid {pid}, which this process did not start: WorkerKiller kills only the "
            "workers of a LocalCluster(processes=True) made in this process"
        )
    return True


def paused_workers(client: Client) -> dict[str, int]:
    """How many times each worker paused (memory above ``distributed.worker.memory.pause``), from the scheduler's
    ``worker-status-change`` events; workers that never paused are left out."""
    paused = {"action": "worker-status-change", "status": "paused"}
    counts: dict[str, int] = {}
    for topic, events in client.get_events().items():
        for _, event in events:
            if isinstance(event, dict) and all(event.get(key) == value for key, value in paused.items()):
                counts[topic] = counts.get(topic, 0) + 1
    return counts


def pause_workers_above(client: Client, extra_bytes: int) -> dict[str, int]:
    """Set each worker's memory pause threshold to its memory now plus ``extra_bytes``; return the thresholds.

    What ``distributed.worker.memory.pause`` sets, as a fraction of the worker's ``memory_limit``, measured on the
    worker itself: a fixed fraction would pause an idle worker on one machine and never pause on another.
    """
    return client.run(_pause_above, extra_bytes=extra_bytes)


def worker_states(client: Client) -> dict[str, tuple[str, int]]:
    """Each worker's status (``running``, ``paused``, ...) and process memory in bytes.

    A function of this module, so that the workers import nothing else to run it (a test module's own function
    would make them import the test module, and all it imports, and move their memory by that much).
    """
    return client.run(_state)


def _state(dask_worker: Any) -> tuple[str, int]:
    import psutil

    return dask_worker.status.name, psutil.Process().memory_info().rss


def _pause_above(dask_worker: Any, extra_bytes: int) -> int:
    import psutil

    threshold = psutil.Process().memory_info().rss + extra_bytes
    dask_worker.memory_manager.memory_pause_fraction = threshold / dask_worker.memory_manager.memory_limit
    return threshold


def large_images(root: str | Path, n: int, *, side: int = 7000) -> pd.DataFrame:
    """``n`` distinct ``side`` x ``side`` grey PNGs under ``root`` and their catalog (one label, ``a``).

    Gradients of a slope per image: a 7000 px image is 49 MB decoded and a few hundred kB on disk, written in a
    fraction of a second, so a test can push a worker's memory with a handful of them.
    """
    from pathlib import Path

    import numpy as np
    import pandas as pd
    from PIL import Image

    from dask_dl.data.schema import make_catalog

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    ramp = np.arange(side, dtype=np.uint8)
    rows = []
    for i in range(n):
        path = root / f"{i:04d}.png"
        Image.fromarray(np.add.outer(ramp * np.uint8(i % 250 + 1), ramp * np.uint8(3))).save(path, compress_level=1)
        rows.append(dict(image_id=path.name, path=str(path), patient_id=f"p{i}", site="A", split="train", a=i % 2))
    return make_catalog(pd.DataFrame(rows).astype({"a": "uint8"}), ["a"])


def store_differences(first: str, second: str) -> list[str]:
    """What differs between two ingested stores: ``image``, ``valid``, ``rejects``; empty when they are equal."""
    import numpy as np
    import zarr

    from dask_dl.data.ingest import read_rejects

    a, b = zarr.open_group(first, mode="r"), zarr.open_group(second, mode="r")
    differ = [name for name in ("image", "valid") if not np.array_equal(a[name][:], b[name][:])]
    if not read_rejects(first).equals(read_rejects(second)):
        differ.append("rejects")
    return differ

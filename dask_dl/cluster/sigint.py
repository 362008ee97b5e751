"""Worker preload of the clusters dask_dl starts on this machine: their worker processes leave Ctrl-C to the driver.

Ctrl-C in a terminal sends SIGINT to every process of the foreground job: the ``dask-dl`` command (or the user's
script) and the worker processes of the local cluster it started, which are its children. Left alone, each worker
process ends at once (asyncio's handler cancels its main task): its trainers and tasks are lost, the terminal fills
with their tracebacks, and the driver, which got the same Ctrl-C and would have stopped the run within a few steps
and kept what it did, finds its workers gone (a training run then fails instead of stopping). With this preload the
worker processes ignore SIGINT: the driver handles Ctrl-C, and ends the workers when it closes the cluster.

:func:`dask_dl.cluster.make` adds it to the ``local`` and ``cuda`` kinds (:func:`with_preload`). Workers started
any other way (``dask worker``, a batch system, a gateway) run outside the terminal's job and get no Ctrl-C.
A notebook's interrupt goes to the kernel alone and never needed it.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import dask.config

__all__ = ["EXPECTED_AT_CLOSE", "PRELOAD", "ExpectedAtClose", "dask_setup", "with_preload"]

PRELOAD = __name__


#: what distributed logs from a worker that closes about what the close itself ends: (logger, end of the message)
EXPECTED_AT_CLOSE = (
    # a task still running (e.g. a read from a hung network mount) is cancelled
    ("distributed.worker.state_machine", "ended with CancelledError"),
    # the scheduler closed first: a heartbeat due before the worker's own close stops its heartbeats finds it gone
    ("distributed.worker", "Failed to communicate with scheduler during heartbeat."),
)


def dask_setup(worker: Any) -> None:
    """Ignore SIGINT in this worker process (only in a process of its own: never in a driver's thread)."""
    if threading.current_thread() is threading.main_thread():  # a worker in its own process runs its loop there
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for name, ending in EXPECTED_AT_CLOSE:
            logging.getLogger(name).addFilter(ExpectedAtClose(worker, ending))


class ExpectedAtClose(logging.Filter):
    """Drops a record ending with ``ending`` while ``worker`` closes: after Ctrl-C, the driver told the user.

    A second Ctrl-C leaves tasks still running, and closing the cluster then cancels them (distributed logs each
    one, "Async instruction for <Task ...> ended with CancelledError") while the scheduler, closed first, is gone
    for the heartbeats the worker sends until its close stops them (logged with a traceback). Any other record,
    and these from a worker not closing, pass.
    """

    def __init__(self, worker: Any, ending: str) -> None:
        super().__init__()
        self.worker, self.ending = worker, ending

    def filter(self, record: logging.LogRecord) -> bool:
        from distributed.core import Status

        closing = getattr(self.worker, "status", None) in (Status.closing, Status.closed)
        return not (closing and record.getMessage().endswith(self.ending))


def with_preload(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for ``LocalCluster`` with this preload added to the worker preloads already asked for.

    Those are ``options["preload"]``, or else ``distributed.worker.preload`` from dask.config (which an explicit
    ``preload`` would otherwise replace). A ``preload_argv`` given per preload (a list of lists) gets an empty one
    for this preload, so that the two lists stay aligned.
    """
    preload = options.get("preload") or dask.config.get("distributed.worker.preload")
    preload = [preload] if isinstance(preload, str) else list(preload)
    if PRELOAD in preload:
        return dict(options)
    argv = options.get("preload_argv") or dask.config.get("distributed.worker.preload-argv")
    merged = {**options, "preload": [*preload, PRELOAD]}
    if argv and not isinstance(argv[0], str):  # one list per preload
        merged["preload_argv"] = [*argv, []]
    return merged

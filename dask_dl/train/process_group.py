"""Which trainer owns this worker process's torch.distributed group, and the worker's fast exit.

A worker process holds at most one default process group. The trainer that joins one records itself as its owner
(:func:`own_group`); the next trainer on the worker claims the process (:func:`claim_process_group`) and refuses
while a live run holds it, or destroys a group that a failed run left behind (:func:`reset_process_group`). A
worker process that ran a gloo group also leaves without the interpreter's finalization
(:func:`exit_without_finalization`).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
import weakref
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from dask_dl.errors import ClusterError

logger = logging.getLogger("dask_dl.train")

_GROUP_OWNER: weakref.ref | None = None  # the trainer whose process group this worker process is in
#: how long setup waits for a failed run's trainer to leave its group before judging it stale
CLAIM_WAIT_S = 10.0


RENDEZVOUS_MIN_S = 60.0  # the least time ranks wait for each other to arrive: see rendezvous


def rendezvous(init_method: str, *, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The group's key-value store at ``init_method`` (``tcp://host:port``, hosted by rank 0).

    Ranks arrive seconds apart on a busy cluster (a worker still importing torch, a restart's new worker), so they
    wait for each other at least ``RENDEZVOUS_MIN_S``, however short ``dask-dl.train.timeout`` is set to notice a
    hung collective. A rank that never arrives because its worker died is noticed by the driver, which shuts this
    wait with the group's other connections (:func:`dask_dl.train.abort.shut_group_sockets`).
    """
    address = urlparse(init_method)
    return dist.TCPStore(
        address.hostname,
        address.port,
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=max(float(timeout_s), RENDEZVOUS_MIN_S)),
    )


def own_group(trainer: Any) -> None:
    """Record ``trainer`` as the owner of the group this process is about to join."""
    global _GROUP_OWNER
    _GROUP_OWNER = weakref.ref(trainer)


def owns_group(trainer: Any) -> bool:
    """True while ``trainer`` is the owner of this process's group."""
    return _GROUP_OWNER is not None and _GROUP_OWNER() is trainer


def claim_process_group(worker: Any, *, wait_s: float) -> None:
    """Make this worker process free to join a new process group, or raise when a live run holds it.

    A group whose actor is no longer on the worker (its run failed and was released while the trainer hung) is
    stale: it is destroyed. torch's group counter, which a failed rendezvous advances without a group to
    destroy, is reset, so every rank of the next run names its group alike.
    """
    deadline = time.monotonic() + wait_s
    while dist.is_available() and dist.is_initialized():
        owner = _GROUP_OWNER() if _GROUP_OWNER is not None else None
        wanted = owner is not None and registered(worker, owner)
        if wanted and getattr(owner, "_ready", False):
            raise ClusterError(
                f"worker {worker.address} is already in a torch.distributed process group (another fit is "
                "running on it); wait for that run or stop it (run.stop()), or train on other workers"
            )
        if not wanted or time.monotonic() > deadline:  # released, or its teardown never ends: stale
            logger.warning("worker %s: leaving a process group a failed run left behind", worker.address)
            if owner is not None:
                owner.let_go_of_allocator()  # its teardown will not come either
            break
        time.sleep(0.2)  # its trainer is leaving the group (a failed run's teardown)
    reset_process_group()


def registered(worker: Any, actor: Any) -> bool:
    """True while ``actor`` is one of the worker's actors (the scheduler has not forgotten it)."""
    for _ in range(10):
        try:  # the worker's event loop changes the dict while this thread reads it
            return any(a is actor for a in list(worker.state.actors.values()))
        except RuntimeError:
            time.sleep(0.01)
    return True  # cannot tell: assume still wanted


def reset_process_group() -> None:
    """Destroy this process's default group, if any, and reset torch's group counter."""
    global _GROUP_OWNER
    from torch.distributed import distributed_c10d

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a group broken by a dead peer: forget it all the same
            logger.warning("destroying the process group failed: %s: %s", type(exc).__name__, exc)
    world = getattr(distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized():
        world.group_count = 0
    _GROUP_OWNER = None


_fast_exit_installed = False


def exit_without_finalization() -> None:
    """Make this worker process end right after its ``atexit`` handlers, skipping the interpreter's finalization.

    Measured on 2 loaded cores: a worker process that imported torch.distributed and ran a gloo group spends
    4 s and more in interpreter finalization (module teardown and C++ static destructors, after the last
    ``atexit`` handler), longer than the nanny's grace period, so every ``cluster.close()`` after a fit logged
    "Worker process still alive after 4.0 seconds, killing"; gloo's threads (``pt_gloo_runloop``,
    ``gloo_tcp_loop``, rank 0's ``pt_tcpstore_uv``) also outlive ``destroy_process_group``. Flushing the logs
    and standard streams and leaving with ``os._exit`` from the first ``atexit`` handler that runs (the last
    registered) cut the close from 4.2 s to 0.1-0.4 s. The worker has closed by then (its executors, comms
    and the nanny's queues are done), so nothing is lost but the finalization. The exit status is 0: a process
    that gets this far exits normally (crashes and kills do not run ``atexit`` handlers).
    """
    global _fast_exit_installed
    if _fast_exit_installed:
        return
    _fast_exit_installed = True

    def exit_now() -> None:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                try:
                    stream.flush()
                except (OSError, ValueError) as exc:  # a closed or broken stream: nothing more to flush into it
                    logging.getLogger("dask_dl.train").debug("could not flush %s at exit: %s", stream, exc)
        os._exit(0)

    atexit.register(exit_now)

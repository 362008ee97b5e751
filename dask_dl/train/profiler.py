"""The worker's sampling profiler, paused on a worker while it holds a trainer.

distributed samples the stack of every thread that runs a task or an actor call, every
``distributed.worker.profile.interval`` (10 ms), from the worker's event loop, reading the frames of a thread
while that thread runs. A trainer's thread runs one actor call for the whole run, mostly inside torch's C++:
its profile says "run_epochs, backward" and no more, and each sample costs the event loop a walk of some 50
frames. Worse, on CPython 3.11 such a read sometimes catches a frame being torn down, and the worker logs
``AttributeError: 'tuple' object has no attribute 'f_code'`` with a traceback from ``Worker.trigger_profile``
(seen in a 2-trainer ``dask-dl train`` run; distributed#1451 and #8163 are the same race).

So a trainer pauses its worker's profiler from :func:`pause` (its setup) to :func:`resume` (its teardown); the
dashboard's profile page covers the rest of the worker's life. Both hand the change to the worker's event loop,
where tornado's periodic callbacks must be started and stopped.
"""

from __future__ import annotations

from typing import Any

__all__ = ["pause", "resume"]

_PAUSED = "_dask_dl_profile_paused"  # set on the worker while a trainer holds its profiler


def pause(worker: Any) -> bool:
    """Stop ``worker``'s sampling profiler (if it has one running); True when it was stopped."""
    callback = getattr(worker, "periodic_callbacks", {}).get("profile")
    if callback is None or getattr(worker, _PAUSED, False):
        return False
    setattr(worker, _PAUSED, True)
    worker.loop.add_callback(callback.stop)
    return True


def resume(worker: Any) -> bool:
    """Start again the profiler :func:`pause` stopped on ``worker``; True when it did."""
    callback = getattr(worker, "periodic_callbacks", {}).get("profile")
    if callback is None or not getattr(worker, _PAUSED, False):
        return False
    setattr(worker, _PAUSED, False)
    worker.loop.add_callback(callback.start)
    return True

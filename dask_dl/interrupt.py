"""Ctrl-C while the driver waits for a run: noted by the signal handler, raised by the wait loop.

Python's default SIGINT handler raises KeyboardInterrupt in whatever Python code the main thread runs next. In a
loop that allocates as it waits (the CLI's, which prints each new row of a run's history), that can be a finalizer:
the allocation makes the collector free garbage and run its ``__del__`` methods and weakref callbacks right there,
and an exception raised in one is printed as "Exception ignored in ..." and lost; the run goes on as if the user had
not pressed Ctrl-C. A handler that only notes the press cannot be lost that way: the loop raises KeyboardInterrupt
itself at its next check.

A job that Ctrl-C stops part way (an ingest, a synthesis, the demo) raises :class:`Interrupted`, whose message says
what it kept and how to go on; ``dask-dl`` prints that message and exits with status 130.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a dask_dl job; the message says what it kept and how to go on (``dask-dl`` prints it alone).

    A KeyboardInterrupt, so that whatever stops on Ctrl-C stops on it too, and ``except Exception`` does not catch it.
    """


class Interrupt:
    """Whether Ctrl-C was pressed since :func:`caught_interrupt` began; :meth:`check` raises it in the loop."""

    def __init__(self) -> None:
        self.pressed = False

    def _note(self, signum: int, frame: Any) -> None:
        self.pressed = True  # nothing here can raise: this runs inside whatever the main thread was doing

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C was pressed (once per press)."""
        if self.pressed:
            self.pressed = False
            raise KeyboardInterrupt


@contextlib.contextmanager
def caught_interrupt() -> Iterator[Interrupt]:
    """Within the block, SIGINT only notes a press; the caller's loop calls ``check()`` to raise it.

    Only in the main thread (signals go there) and only while Python's own handler is installed: a handler of
    the user's, or a notebook kernel's, is left in place, and then ``check()`` never raises (their handler
    decides). The previous handler is back when the block ends, with a press not yet checked raised then.
    """
    interrupt = Interrupt()
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield interrupt
        return
    signal.signal(signal.SIGINT, interrupt._note)
    try:
        yield interrupt
    finally:
        if signal.getsignal(signal.SIGINT) == interrupt._note:  # unless someone installed theirs meanwhile
            signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt.check()


def wait_for(event: threading.Event, timeout: float | None = None) -> bool:
    """Block until ``event`` is set or ``timeout`` seconds pass; return whether it is set.

    Ctrl-C raises KeyboardInterrupt here, never lost (:func:`caught_interrupt`). The event is polled in short
    waits, not one long wait or ``Thread.join``: a KeyboardInterrupt inside ``join()`` marks a running thread as
    finished on Python 3.11 (bpo-45274's fix), and short waits let Ctrl-C in on every platform.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    with caught_interrupt() as interrupt:
        while not event.wait(0.2):
            interrupt.check()
            if deadline is not None and time.monotonic() >= deadline:
                return False
    return True

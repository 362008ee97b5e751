"""Ctrl-C at the worst moment: while the main thread runs a finalizer inside a wait (see dask_dl.interrupt).

A driver waiting for a run spends its time in a short loop, and the main thread's allocations there now and then
make the garbage collector free objects and run their finalizers in the middle of it. Python's default SIGINT
handler raises KeyboardInterrupt in whatever runs next, and raised inside a finalizer it is printed and lost.
:func:`ctrl_c_in_a_finalizer` makes that happen on purpose, every time.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType


class _Press:
    """Shared by the garbage, the presser thread and the context manager."""

    def __init__(self, inside: str, when: Callable[[FrameType], bool] | None) -> None:
        self.inside, self.when = inside, when
        self.entered = threading.Event()  # a finalizer runs in the main thread, beneath `inside`
        self.sent = threading.Event()  # SIGINT was sent
        self.over = False  # no more garbage

    def due(self) -> bool:
        if self.over or self.entered.is_set() or threading.current_thread() is not threading.main_thread():
            return False
        frame = sys._getframe(2)  # whoever allocated when the collector ran
        while frame is not None:
            if frame.f_code.co_name == self.inside and frame.f_code.co_filename != threading.__file__:
                return self.when is None or self.when(frame)  # (not threading's own Event.wait and Condition.wait)
            frame = frame.f_back
        return False


class _Garbage:
    """A reference cycle, so that only the collector frees it, with a finalizer that lasts past the press."""

    def __init__(self, press: _Press) -> None:
        self.press = press
        self.cycle = self

    def __del__(self) -> None:
        press = self.press
        if not press.due():
            if not press.over and not press.entered.is_set():
                _Garbage(press)  # garbage again, until the main thread's collection beneath `inside` frees it
            return
        press.entered.set()
        press.sent.wait(30)
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # Python code for the signal handler to run in (a loop checks it)
            pass


@contextlib.contextmanager
def ctrl_c_in_a_finalizer(
    inside: str, *, when: Callable[[FrameType], bool] | None = None, within: float = 30.0
) -> Iterator[None]:
    """Send SIGINT to this process while the main thread runs a finalizer beneath a function named ``inside``.

    ``inside`` is a function of the code under test (threading's own ``wait`` functions do not count) that a
    waiting loop calls, and which allocates, so that the collector runs in the main thread there: the first
    finalizer run beneath it gets the press, or the first for which ``when(frame)`` (the frame of ``inside``) is
    true. ``when`` runs inside the collector, in the middle of whatever the main thread does, so it must not take
    a lock (a run's ``history`` takes one: read the loop's own variables instead).

    The collector runs after every allocation of any thread while the block runs (``gc.set_threshold(1)``);
    thresholds are restored after. Raises AssertionError if no finalizer ran there: when the block ends first, or
    after ``within`` seconds (then a plain SIGINT was sent, so that the block could end).

    Examples
    --------
    Press Ctrl-C once a loop that prints a run's rows with ``echo(run, shown)`` has printed one:

    >>> with ctrl_c_in_a_finalizer("echo", when=lambda frame: frame.f_locals["shown"] > 0):  # doctest: +SKIP
    ...     follow(run, echo)
    """
    press = _Press(inside, when)

    def presser() -> None:
        deadline = time.monotonic() + within
        while not press.entered.wait(0.05) and not press.over and time.monotonic() < deadline:
            pass
        if press.over:  # the block ended first (the code under test returned, or failed): no press to send
            return
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C (or a notebook's interrupt) sends
        press.sent.set()

    thresholds = gc.get_threshold()
    thread = threading.Thread(target=presser, name="ctrl-c-in-a-finalizer", daemon=True)
    thread.start()
    _Garbage(press)
    gc.set_threshold(1, 1_000_000, 1_000_000)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        press.over = True
        thread.join()
        gc.collect()
        if not press.entered.is_set():
            raise AssertionError(f"the main thread ran no finalizer beneath {inside}() in the block (or {within} s)")

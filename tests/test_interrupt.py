"""Ctrl-C while the driver waits (dask_dl.interrupt): never lost in a finalizer, others' handlers left alone.

Real signals to this process (pytest runs tests in the main thread); the runs' own waits are tested end to end in
tests/train/test_fit.py and tests/sites/test_fit_sites.py.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from dask_dl.interrupt import caught_interrupt, wait_for
from dask_dl.testing.interrupt import ctrl_c_in_a_finalizer


def wait(seconds: float, interrupt=None) -> float:
    """The shape of a run's wait: short blocking waits, allocating as they go; returns the seconds it waited."""
    start = time.monotonic()
    while time.monotonic() < start + seconds:
        threading.Event().wait(0.05)
        if interrupt is not None:
            interrupt.check()
    return time.monotonic() - start


@pytest.mark.slow
def test_pythons_own_handler_loses_a_ctrl_c_pressed_in_a_finalizer(monkeypatch):
    # the reference: what made a run go on after Ctrl-C, now and then, in a long test session
    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: lost.append(unraisable.exc_type))
    with ctrl_c_in_a_finalizer("wait"):
        waited = wait(2.0)
    assert waited >= 2.0
    assert lost == [KeyboardInterrupt]


def test_a_ctrl_c_pressed_in_a_finalizer_is_raised_by_the_wait(monkeypatch):
    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: lost.append(unraisable.exc_type))
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt), ctrl_c_in_a_finalizer("wait"), caught_interrupt() as interrupt:
        wait(20.0, interrupt)
    assert time.monotonic() - start < 10
    assert lost == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_press_the_loop_did_not_check_is_raised_when_the_block_ends():
    with pytest.raises(KeyboardInterrupt), caught_interrupt():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler runs; nothing checks within the block
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_handler_of_the_users_stays_theirs():
    presses = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: presses.append(signum))
    try:
        with caught_interrupt() as interrupt:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            interrupt.check()  # their handler decides what a press does: nothing is raised here
        assert presses == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_other_threads_wait_as_before():
    # signals go to the main thread only: another thread's wait keeps Python's handler and never raises
    seen = []

    def other() -> None:
        with caught_interrupt() as interrupt:
            seen.append(signal.getsignal(signal.SIGINT))
            interrupt.check()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


def test_wait_for_an_event_times_out_ends_when_set_and_raises_a_press():
    event = threading.Event()
    assert wait_for(event, 0.3) is False
    threading.Timer(0.2, event.set).start()
    assert wait_for(event, 10) is True
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        wait_for(threading.Event(), 10)
    assert time.monotonic() - start < 5
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

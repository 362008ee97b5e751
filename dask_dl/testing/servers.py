"""What a test does when a server or tool it needs is missing: skip it, except under CI, where that is a failure.

CI (``CI=true``, as ``.ci/run`` runs) installs and starts everything the suite needs: a dask-gateway server, a
single-node SLURM, an S3 server, Chromium. There, a server that does not start is a broken setup, and a skip would
let the run pass with the cluster tests not run. On a developer's machine it stays a skip that says why.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import NoReturn

__all__ = ["free_port", "in_ci", "stop_server", "unavailable", "wait_for_http"]


def in_ci() -> bool:
    """Whether this run is CI's: ``CI`` set to ``true`` (or ``1``, ``yes``), as CI services and ``.ci/run`` set it."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    """Skip the calling test (or fixture) because ``reason``; under CI fail it instead, with the same words."""
    import pytest

    if in_ci():
        pytest.fail(f"{reason} (CI=true: everything the suite needs must be there; see .ci/run)", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, proc: subprocess.Popen, *, timeout: float, log: Path) -> None:
    """Wait until ``url`` answers; a RuntimeError with the end of ``log`` when ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:g} s:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen, *, group: bool = False) -> None:
    """Stop a server we started, by its pid (with ``group``, its whole process group): SIGTERM, then SIGKILL
    after 15 s."""
    if proc.poll() is not None:
        return
    kill = os.killpg if group else os.kill
    kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        kill(proc.pid, signal.SIGKILL)
        proc.wait(5)

"""A real ``mlflow server`` on 127.0.0.1 for tests and benchmarks, started in a folder and stopped by its pid."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["free_port", "mlflow_server"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def mlflow_server(root: str | os.PathLike, *, timeout: float = 180) -> Iterator[str]:
    """Run ``mlflow server`` with an SQLite backend and served artifacts under ``root``; yield its URI.

    Raises
    ------
    RuntimeError
        The server exited or did not answer ``/health`` within ``timeout`` seconds (with the end of its log).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    exe = shutil.which("mlflow") or str(Path(sys.executable).parent / "mlflow")
    port = free_port()
    args = [
        exe, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"), "--serve-artifacts",
    ]  # fmt: skip
    log = root / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, cwd=root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        _wait_for_health(uri, proc, timeout=timeout, log=log)
        yield uri
    finally:
        _stop(proc)


def _wait_for_health(uri: str, proc: subprocess.Popen, *, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"mlflow server at {uri} did not answer within {timeout:g} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (uvicorn's worker with it), SIGKILL after 15 s; by the pid we started."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)

"""A real ``mlflow server`` on 127.0.0.1 for tests and benchmarks, started in a folder and stopped by its pid."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dask_dl.testing.servers import free_port, stop_server, wait_for_http

__all__ = ["mlflow_server"]


@contextmanager
def mlflow_server(root: str | os.PathLike, *, timeout: float = 180) -> Iterator[str]:
    """Run ``mlflow server`` with an SQLite backend and served artifacts under ``root``; yield its URI.

    The server's job runner (MLflow 3's background jobs: six ``huey`` consumers, each importing mlflow, about 35 s
    of CPU at start) is switched off: dask_dl logs runs, metrics and models, none of which needs it.

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
        exe,
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
        "--serve-artifacts",
    ]
    log = root / "server.log"
    with open(log, "wb") as out:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        proc = subprocess.Popen(args, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{uri}/health", proc, timeout=timeout, log=log)
        yield uri
    finally:
        stop_server(proc, group=True)  # uvicorn's worker with it

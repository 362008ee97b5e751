"""The servers the cluster tests run against, started once per session and stopped by pid.

dask-gateway-server (UnsafeLocalBackend, simple auth, free ports on 127.0.0.1, the config shipped in
docs/gateway/), a single-node SLURM (munge, slurmctld, slurmd; set up by .ci/run or started here) and an
S3-compatible server (moto). A fixture whose server cannot start skips its tests and says why; under CI
(``CI=true``) it fails them (:func:`dask_dl.testing.servers.unavailable`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dask_dl.testing.servers import free_port, stop_server, unavailable, wait_for_http

REPO = Path(__file__).resolve().parents[2]
GATEWAY_CONFIG = REPO / "docs" / "gateway" / "dask_gateway_config.py"


@pytest.fixture(scope="session")
def gateway_server(tmp_path_factory):
    """A real dask-gateway-server on free 127.0.0.1 ports; yields its connection settings."""
    if importlib.util.find_spec("sqlalchemy") is None:
        unavailable("dask-gateway-server's backends need SQLAlchemy: pip install 'dask-gateway-server[local]'")
    exe = shutil.which("dask-gateway-server") or str(Path(sys.executable).parent / "dask-gateway-server")
    if not os.path.exists(exe):
        unavailable("dask-gateway-server is not installed: pip install 'dask-gateway-server[local]'")
    root = tmp_path_factory.mktemp("gateway")
    port, proxy = free_port(), free_port()
    env = dict(os.environ)
    env |= {
        "DASK_GATEWAY_PASSWORD": "dask-dl-test",
        "DASK_GATEWAY_ADDRESS": f"127.0.0.1:{port}",
        "DASK_GATEWAY_PROXY_ADDRESS": f"127.0.0.1:{proxy}",
        "DASK_GATEWAY_CLUSTERS_DIRECTORY": str(root / "clusters"),
    }
    log = root / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([exe, "-f", str(GATEWAY_CONFIG)], cwd=root, env=env, stdout=out, stderr=out)
    try:
        wait_for_http(f"http://127.0.0.1:{proxy}/api/health", proc, timeout=60, log=log)
    except RuntimeError as exc:
        stop_server(proc)
        unavailable(f"dask-gateway-server did not start: {exc}")
    try:
        # users talk to the proxy (HTTP API and scheduler traffic on one port); ``port`` is the private API
        yield {"address": f"http://127.0.0.1:{proxy}", "password": "dask-dl-test", "log": log}
    finally:
        stop_server(proc)


SLURM_SCRIPT = REPO / ".ci" / "slurm"


def _slurm(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SLURM_SCRIPT), command], capture_output=True, text=True, timeout=120)


class SlurmNode:
    """The single-node SLURM the tests submit to, and what it holds."""

    def jobs(self, name: str = "dask-worker") -> list[dict[str, str]]:
        """Jobs called ``name`` that SLURM still holds (pending, running, completing)."""
        out = subprocess.run(
            ["squeue", "-h", "-n", name, "-o", "%i|%P|%b|%T"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        rows = [line.split("|") for line in out.splitlines() if line.strip()]
        return [dict(zip(("id", "partition", "gres", "state"), row, strict=True)) for row in rows]

    def wait_until_gone(self, name: str = "dask-worker", timeout: float = 60) -> list[dict[str, str]]:
        """Wait for the jobs called ``name`` to leave the queue; return those still there after ``timeout``."""
        deadline = time.monotonic() + timeout
        while (jobs := self.jobs(name)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return jobs


def _use_our_slurm() -> None:
    """Point sbatch, squeue and sinfo (of this process and those it starts) at .ci/slurm's configuration."""
    line = _slurm("env").stdout.strip()  # export SLURM_CONF=/run/dask-dl-slurm/etc/slurm.conf
    os.environ["SLURM_CONF"] = line.partition("=")[2]


@pytest.fixture(scope="session")
def slurm():
    """A running single-node SLURM: the one .ci/run started, else one started here (and stopped after)."""
    _use_our_slurm()
    if _slurm("status").returncode == 0:
        yield SlurmNode()
        return
    if shutil.which("slurmctld") is None or shutil.which("sbatch") is None:
        unavailable(
            "SLURM is not installed (Debian: .ci/slurm install, or apt-get install slurmctld slurmd slurm-client munge)"
        )
    if os.geteuid() != 0:
        unavailable("SLURM is not running and starting its daemons needs root (.ci/slurm start)")
    started = _slurm("start")
    if started.returncode != 0:
        unavailable(f"SLURM could not start: {(started.stdout + started.stderr)[-2000:]}")
    try:
        yield SlurmNode()
    finally:
        _slurm("stop")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (moto) on a free 127.0.0.1 port; yields the s3fs storage options."""
    for module, package in (("moto.server", "'moto[server]'"), ("s3fs", "s3fs")):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            unavailable(f"the S3 tests need {module}: pip install {package}")
    port = free_port()
    log = tmp_path_factory.mktemp("s3") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out
        )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/moto-api/", proc, timeout=60, log=log)
    except RuntimeError as exc:
        stop_server(proc)
        unavailable(f"the S3 server (moto) did not start: {exc}")
    try:
        yield {
            "endpoint_url": f"http://127.0.0.1:{port}",
            "key": "dask-dl-test",
            "secret": "dask-dl-test",
            "client_kwargs": {"region_name": "eu-west-1"},  # moto refuses us-east-1 as a bucket location
        }
    finally:
        stop_server(proc)

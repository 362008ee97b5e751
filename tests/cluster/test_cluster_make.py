"""dask_dl.cluster.make: kinds, settings from arguments then dask.config, pass-through, errors that teach."""

from __future__ import annotations

import logging

import dask.config
import pytest
from distributed import Client

from dask_dl import ClusterError, ConfigurationError, StoreNotFoundError
from dask_dl.cluster import (
    KINDS,
    check_visible,
    connect,
    cpu_workers,
    gpu_workers,
    make,
    security_from,
    set_storage_options,
    tls_files,
    workers_for,
)
from dask_dl.cluster.cuda import gpu_count
from dask_dl.cluster.sigint import EXPECTED_AT_CLOSE
from dask_dl.cluster.workers import scheduler_workers


def test_kinds_are_listed_in_the_error_for_an_unknown_kind():
    assert KINDS.names() == ["local", "cuda", "gateway", "slurm"]
    with pytest.raises(ConfigurationError, match=r"unknown cluster kind 'k8s': the cluster kinds are local, cuda"):
        make("k8s")


def test_local_settings_come_from_arguments_then_config_and_unknown_kwargs_pass_through():
    with (
        dask.config.set({"dask-dl.cluster.n-workers": 1, "dask-dl.cluster.kind": "local"}),
        make(name="dask-dl-made", threads_per_worker=2) as cluster,
        Client(cluster) as client,
    ):
        assert cluster.name == "dask-dl-made"  # LocalCluster's own keyword, passed through
        workers = scheduler_workers(client).values()
        assert [w["nthreads"] for w in workers] == [2]  # argument
        # safe defaults: the scheduler and the dashboard listen on 127.0.0.1 only
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
        assert cluster.dashboard_link.startswith("http://127.0.0.1:")
        assert cpu_workers(client) is None and gpu_workers(client) == []  # one kind: anywhere
        assert workers_for(client, "cpu") is None and workers_for(client, "any") is None
        with pytest.raises(
            ClusterError,
            match=r"scoring was asked to run on the GPU workers \(on='gpu'\), and none "
            r"of the cluster's 1 workers advertises a 'GPU' resource; pass on='cpu'",
        ):
            workers_for(client, "gpu", purpose="scoring")
        with pytest.raises(ConfigurationError, match=r"unknown on 'tpu': use one of cpu, gpu, any"):
            workers_for(client, "tpu")


def test_cuda_without_a_gpu_says_so_and_what_to_use():
    if gpu_count():
        pytest.skip("this machine has a GPU: make('cuda') is tested in test_cluster_gpu.py")
    with pytest.raises(ClusterError, match=r"needs NVIDIA GPUs, and this machine has none.*make\('local'"):
        make("cuda", cpu_workers=1)


def test_bad_arguments_are_configuration_errors():
    with pytest.raises(ConfigurationError, match="n_workers must be a positive integer, got 0"):
        make("local", n_workers=0)
    with pytest.raises(ConfigurationError, match="tagged_workers must be a positive integer, got -1"):
        make("local", tagged_workers=-1)
    with pytest.raises(ConfigurationError, match="security must be True"):
        security_from("yes")
    with pytest.raises(ConfigurationError, match=r"--tls-ca '/nonexistent/ca.pem' is not a file"):
        tls_files(ca="/nonexistent/ca.pem", cert="/nonexistent/me.pem")
    with pytest.raises(ConfigurationError, match="needs the gateway's address"):
        make("gateway")
    with pytest.raises(ConfigurationError, match="must map a protocol to its options"):
        set_storage_options(None, {"endpoint_url": "http://127.0.0.1:1"})


def test_tagged_stand_in_workers_and_check_visible(tmp_path):
    """A stand-in for a GPU box: CPU workers advertising a GPU resource next to plain CPU workers."""
    with connect(kind="local", n_workers=1, tagged_workers=1) as client:
        workers = scheduler_workers(client)
        tagged = [a for a, w in workers.items() if w["resources"] == {"GPU": 1}]
        plain = [a for a, w in workers.items() if w["resources"] == {}]
        assert gpu_workers(client) == tagged and len(tagged) == 1
        assert cpu_workers(client) == plain and len(plain) == 1
        # the CPU workers of a GPU box never see a GPU
        assert client.run(lambda: __import__("os").environ.get("CUDA_VISIBLE_DEVICES"), workers=plain) == {plain[0]: ""}
        check_visible(client, tmp_path)
        missing = tmp_path / "not-here.zarr"
        with pytest.raises(StoreNotFoundError, match=rf"worker {plain[0]} cannot see '{missing}' \(does not exist"):
            check_visible(client, missing)


USER_PRELOAD = """
def dask_setup(worker):
    worker.user_preload_ran = True
"""


def _close_filters():
    """In a worker: the (logger, ending) of every :class:`ExpectedAtClose` filter its preload installed."""
    import logging

    from dask_dl.cluster.sigint import EXPECTED_AT_CLOSE, ExpectedAtClose

    loggers = {name for name, _ in EXPECTED_AT_CLOSE}
    return sorted(
        (name, f.ending) for name in loggers for f in logging.getLogger(name).filters if isinstance(f, ExpectedAtClose)
    )


def test_local_worker_processes_leave_ctrl_c_to_the_driver(tmp_path):
    """A terminal's Ctrl-C reaches the worker processes of the local cluster too: they ignore it, and live on."""
    import os
    import signal
    import threading
    import time

    from dask_dl.cluster.sigint import dask_setup

    (tmp_path / "user_preload.py").write_text(USER_PRELOAD)
    with (
        dask.config.set({"distributed.worker.preload": [str(tmp_path / "user_preload.py")]}),  # kept, not replaced
        connect(kind="local", n_workers=1, tagged_workers=1) as client,  # the tagged ones and the added CPU one
    ):
        pids = client.run(os.getpid)
        assert len(pids) == 2
        seen = client.run(
            lambda dask_worker: (signal.getsignal(signal.SIGINT) == signal.SIG_IGN, dask_worker.user_preload_ran)
        )
        assert seen == {address: (True, True) for address in pids}
        assert client.run(_close_filters) == {address: sorted(EXPECTED_AT_CLOSE) for address in pids}
        for pid in pids.values():
            os.kill(pid, signal.SIGINT)  # what Ctrl-C in the terminal sends to the whole job
        time.sleep(1.0)
        assert client.run(os.getpid) == pids  # the same processes: none ended (a nanny restart changes the pid)
    # the driver keeps Python's handler, also when a worker in one of its threads runs the preload
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    in_a_thread = threading.Thread(target=dask_setup, args=(None,))
    in_a_thread.start()
    in_a_thread.join()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_closing_worker_drops_only_what_its_close_ends():
    """After Ctrl-C the driver closes the cluster: a task it cancels and a heartbeat to the scheduler it closed first
    are expected then, and dropped; the same records from a worker that is not closing, and others, pass."""
    from types import SimpleNamespace

    from distributed.core import Status

    from dask_dl.cluster.sigint import ExpectedAtClose

    def passes(status, logger, message):
        record = logging.LogRecord(logger, logging.ERROR, __file__, 1, message, None, None)
        return ExpectedAtClose(SimpleNamespace(status=status), dict(EXPECTED_AT_CLOSE)[logger]).filter(record)

    heartbeat = "Failed to communicate with scheduler during heartbeat."
    cancelled = "Async instruction for <Task cancelled name='execute(x)'> ended with CancelledError"
    for status in (Status.closing, Status.closed):
        assert not passes(status, "distributed.worker", heartbeat)
        assert not passes(status, "distributed.worker.state_machine", cancelled)
        assert passes(status, "distributed.worker", "Unexpected exception during heartbeat. Closing worker.")
    for status in (Status.running, Status.paused, None):
        assert passes(status, "distributed.worker", heartbeat)
        assert passes(status, "distributed.worker.state_machine", cancelled)


def test_the_ctrl_c_preload_keeps_the_preloads_and_their_arguments_aligned():
    from dask_dl.cluster.sigint import PRELOAD, with_preload

    assert with_preload({"preload": "mine", "preload_argv": [["--x"]], "n": 1}) == {
        "preload": ["mine", PRELOAD],
        "preload_argv": [["--x"], []],
        "n": 1,
    }
    assert with_preload({"preload": ["a", "b"], "preload_argv": ["--y"]})["preload_argv"] == ["--y"]  # one for all
    with dask.config.set({"distributed.worker.preload": ["cfg"], "distributed.worker.preload-argv": [["--z"]]}):
        assert with_preload({}) == {"preload": ["cfg", PRELOAD], "preload_argv": [["--z"], []]}
    once = with_preload({})
    assert with_preload(once) == once


def test_importing_jobqueue_keeps_the_ctrl_c_handler():
    """dask_jobqueue.runner sets SIGINT to sys.exit on import; make('slurm') imports it without that effect."""
    import subprocess
    import sys

    probe = (
        "import signal; before = signal.getsignal(signal.SIGINT); {imp}; "
        "print(signal.getsignal(signal.SIGINT) is before)"
    )
    plain = probe.format(imp="import dask_jobqueue")
    ours = probe.format(imp="from dask_dl.cluster.slurm import _import_jobqueue; _import_jobqueue()")
    out = [subprocess.run([sys.executable, "-c", c], capture_output=True, text=True, check=True) for c in (plain, ours)]
    assert [o.stdout.strip() for o in out] == ["False", "True"]  # the plain import does replace it

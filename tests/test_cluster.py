"""dask_dl.cluster.connect closes what it opened and nothing else."""

from __future__ import annotations

import os
import signal

import dask.array as da
import pytest
from distributed import Client, LocalCluster, default_client

from dask_dl.cluster import connect


def test_connect_starts_and_closes_a_local_cluster():
    with connect(n_workers=1) as client:
        cluster = client.cluster
        assert client.submit(lambda x: x + 1, 1).result() == 2
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
    assert client.status == "closed"
    assert cluster.status.name == "closed"


def test_connect_leaves_a_passed_client_and_closes_its_own_connection():
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as mine:
        with connect(mine) as client:
            assert client is mine
        assert mine.status == "running"
        with connect(scheduler=cluster.scheduler_address) as client:
            assert client is not mine
            assert client.submit(lambda: 3).result() == 3
            # the block's client is the current one, though `mine` was current before: what it persisted is
            # computed through it (through `mine`, a graph can overtake the persist and lose its dependencies)
            assert default_client() is client
            persisted = client.persist(da.arange(10, chunks=5))
            assert int(persisted.sum().compute()) == 45
        assert default_client() is mine  # the caller's current client is back
        assert client.status == "closed"  # our connection is closed ...
        assert cluster.status.name == "running"  # ... the cluster someone else started is not
        assert mine.submit(lambda: 4).result() == 4


def test_sigterm_closes_the_cluster_connect_started():
    """``scancel`` of a batch script sends SIGTERM: the cluster (and a batch system's jobs) must still be closed."""
    with pytest.raises(KeyboardInterrupt), connect(n_workers=1) as client:
        cluster = client.cluster
        os.kill(os.getpid(), signal.SIGTERM)
    assert cluster.status.name == "closed"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler lived only as long as the cluster


def test_closing_a_cluster_keeps_distributeds_info_records_off_the_console_but_shows_warnings():
    import io
    import logging

    from distributed.utils import silence_logging_cmgr

    from dask_dl.cluster.client import _console_shows_warnings_only

    console = io.StringIO()  # a console handler of distributed's, as its logging config installs on stderr
    handler = logging.StreamHandler(console)
    logging.getLogger("distributed").addHandler(handler)
    batched = logging.getLogger("distributed.batched")
    try:
        with _console_shows_warnings_only():
            # a cluster silences the console while it runs and restores the handlers' level as it closes: the
            # filter must outlast that restoring, when a late "Batched Comm Closed" arrives
            with silence_logging_cmgr("error"):
                pass
            try:
                raise OSError("stream closed")
            except OSError:
                batched.info("Batched Comm Closed <TCP (closed)>", exc_info=True)
            batched.warning("a warning while closing")
        batched.info("an info record after the close")
    finally:
        logging.getLogger("distributed").removeHandler(handler)
    shown = console.getvalue()
    assert "Batched Comm Closed" not in shown and "Traceback" not in shown
    assert "a warning while closing" in shown
    assert "an info record after the close" in shown  # the filter is gone once the cluster is closed

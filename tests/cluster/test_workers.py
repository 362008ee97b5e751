"""dask_dl.cluster.workers.ask_workers: a question to the workers that survives losing one of them."""

from __future__ import annotations

import operator
import os
import time

import pytest
from distributed import Client, LocalCluster

from dask_dl.cluster.workers import ask_workers, scheduler_workers


def _address_unless(victim: str, dask_worker=None) -> str:
    """On a worker: its address, or, on ``victim``, the end of its process before it answers."""
    if dask_worker.address == victim:
        os._exit(1)
    return dask_worker.address


@pytest.mark.slow  # a cluster whose worker dies
def test_a_worker_lost_while_asked_is_left_out_and_other_failures_raise():
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        first, second = sorted(scheduler_workers(client))
        # the same loss fails the caller of a plain client.run
        with pytest.raises(OSError):
            client.run(_address_unless, first, workers=[first, second])
        deadline = time.monotonic() + 60  # the scheduler forgets the lost worker; its nanny starts another
        while len(workers := scheduler_workers(client)) != 2 or first in workers:
            assert time.monotonic() < deadline, f"no second worker in place of {first}: {sorted(workers)}"
            time.sleep(0.1)
        first, second = sorted(workers)
        assert ask_workers(client, _address_unless, first) == {second: second}
        # a failure of the function itself is raised, not taken for a lost worker
        with pytest.raises(ZeroDivisionError):
            ask_workers(client, operator.truediv, 1, 0, workers=[second])
        assert ask_workers(client, operator.add, 1, 2, workers=[second]) == {second: 3}

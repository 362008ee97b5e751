"""The site guard on a real shared cluster: site workers as Nanny processes, a scheduler plugin, a worker plugin.

Four workers, two advertising ``site-A`` and two ``site-B`` (in a large amount, so the resource never limits
concurrency). Each negative control runs twice: under an auditing-only guard, where Dask alone moves a site's key
and the audit shows it as a violation (so the check can fail), and under the enforcing guard, where the same
request is refused or kept on site and the audit shows the refusal and no violation.
"""

from __future__ import annotations

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, Nanny, Scheduler, SpecCluster, futures_of, wait

from dask_dl import open_dataset
from dask_dl.errors import ClusterError, ConfigurationError, CrossSiteError
from dask_dl.sites.audit import Arrival, Audit
from dask_dl.sites.guard import SiteGuardPlugin, guard_sites, site_workers
from dask_dl.testing.data import row_pattern, write_store

SITES = {"A": "site-A", "B": "site-B"}
SIZE = 8


def _site_cluster(**workers: str) -> SpecCluster:
    """A cluster of Nanny worker processes, one thread each; ``workers`` maps a worker name to its site resource."""
    spec = {
        name: {"cls": Nanny, "options": {"nthreads": 1, "resources": {resource: 1e6}}}
        for name, resource in workers.items()
    }
    # no periodic active memory manager: its ReduceReplicas would drop the replicas the tests count (retiring a
    # worker still runs one of its own, which the guard narrows as well)
    with dask.config.set({"distributed.scheduler.active-memory-manager.start": False}):
        return SpecCluster(
            workers=spec, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}}, silence_logs=40
        )


@pytest.fixture(scope="module")
def site_client():
    with _site_cluster(a0="site-A", a1="site-A", b0="site-B", b1="site-B") as cluster, Client(cluster) as client:
        client.wait_for_workers(4)
        yield client


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """One store per site (images of site A are rows 0-23, of site B rows 0-15 of the same pattern)."""
    root = tmp_path_factory.mktemp("sites")
    return {
        "A": write_store(root / "a.zarr", n=24, size=SIZE, chunk=4, site="A"),
        "B": write_store(root / "b.zarr", n=16, size=SIZE, chunk=4, site="B"),
    }


def _holders(client: Client, futures) -> set[str]:
    return {address for holders in client.who_has(futures).values() for address in holders}


def _active_shuffles(dask_scheduler) -> int:
    return len(dask_scheduler.extensions["shuffle"].active_shuffles)


async def _ask_for_p2p_run(dask_worker) -> dict:
    return await dask_worker.scheduler.shuffle_get_or_create(
        shuffle_id="guard-test", key=("transfer", 0), worker=dask_worker.address
    )


def _expected(n: int) -> np.ndarray:
    return np.stack([row_pattern(i, SIZE) for i in range(n)])


@pytest.mark.slow
def test_site_local_computation_stays_on_site(site_client, stores):
    a_workers, b_workers = site_workers(site_client, "site-A"), site_workers(site_client, "site-B")
    with guard_sites(site_client, SITES) as guard:
        images = {
            site: site_client.persist(open_dataset(store).image.data, resources={SITES[site]: 1})
            for site, store in stores.items()
        }
        # derived work carries no restriction: the guard pins it to the site of its inputs
        means = {site: site_client.persist(x.astype("f8").mean(axis=(1, 2))) for site, x in images.items()}
        totals = {site: x.sum().compute() for site, x in images.items()}
        site_client.replicate(futures_of(images["A"]))
        audit = guard.audit()

    for site, n in (("A", 24), ("B", 16)):
        expected = _expected(n)
        np.testing.assert_allclose(means[site].compute(), expected.astype("f8").mean(axis=(1, 2)))
        assert totals[site] == expected.sum()
    assert _holders(site_client, means["A"]) <= set(a_workers)
    assert _holders(site_client, means["B"]) <= set(b_workers)
    assert _holders(site_client, images["A"]) == set(a_workers)  # replicated, within site A only
    assert audit.violations == ()
    assert audit.refusals == ()
    within = [record for record in audit.records if record.key_site == "A"]
    assert any(record.how == "gather" for record in within)  # the replicate, recorded
    assert all(record.worker_site == record.key_site for record in audit.records)
    assert audit.workers == {**dict.fromkeys(a_workers, "A"), **dict.fromkeys(b_workers, "B")}


def test_task_pinned_to_the_wrong_site_is_seen_then_refused(site_client):
    a_workers, b_workers = site_workers(site_client, "site-A"), site_workers(site_client, "site-B")
    with guard_sites(site_client, SITES, enforce=False) as guard:
        data = site_client.submit(np.arange, 6, workers=a_workers[:1], key="wrong-site-data-1")
        pulled = site_client.submit(np.sum, data, workers=b_workers, key="wrong-site-sum-1")
        assert pulled.result() == 15
        seen = guard.audit().violations
    assert [(r.key, r.worker_site, r.key_site, r.how) for r in seen] == [("wrong-site-data-1", "B", "A", "fetch")]
    assert seen[0].worker in b_workers and seen[0].source == a_workers[0]

    with guard_sites(site_client, SITES) as guard:
        data = site_client.submit(np.arange, 6, workers=a_workers[:1], key="wrong-site-data-2")
        pulled = site_client.submit(np.sum, data, workers=b_workers, key="wrong-site-sum-2")
        with pytest.raises(CrossSiteError, match=r"'wrong-site-sum-2' is restricted to site 'B' but its inputs "):
            pulled.result()
        audit = guard.audit()
    assert audit.violations == ()
    assert [(r.what, r.keys) for r in audit.refusals] == [("task", ("wrong-site-sum-2",))]
    assert _holders(site_client, [data]) == {a_workers[0]}


def test_replicate_is_seen_then_kept_on_site(site_client):
    a_workers, b_workers = site_workers(site_client, "site-A"), site_workers(site_client, "site-B")
    with guard_sites(site_client, SITES, enforce=False) as guard:
        data = site_client.submit(np.arange, 7, workers=a_workers[:1], key="replicated-1")
        data.result()
        site_client.replicate([data])
        seen = guard.audit().violations
    assert {(r.worker, r.how) for r in seen} == {(worker, "gather") for worker in b_workers}

    with guard_sites(site_client, SITES) as guard:
        data = site_client.submit(np.arange, 7, workers=a_workers[:1], key="replicated-2")
        data.result()
        site_client.replicate([data])  # site-safe: onto site A's other worker only
        assert _holders(site_client, [data]) == set(a_workers)
        with pytest.raises(CrossSiteError, match=r"replicate would copy site 'A''s keys 'replicated-2' to workers"):
            site_client.replicate([data], workers=b_workers)
        site_client.rebalance()  # among the workers of one site at a time
        audit = guard.audit()
    assert _holders(site_client, [data]) == set(a_workers)
    assert audit.violations == ()
    assert [(r.what, r.keys) for r in audit.refusals] == [("replicate", ("replicated-2",))]
    assert [(r.key, r.worker, r.how) for r in audit.records if r.key == "replicated-2"] == [
        ("replicated-2", a_workers[1], "gather")
    ]


def test_mixing_sites_is_refused_but_weights_cross(site_client):
    a_workers, b_workers = site_workers(site_client, "site-A"), site_workers(site_client, "site-B")
    with guard_sites(site_client, SITES) as guard:
        a = site_client.submit(np.arange, 4, workers=a_workers, key="mix-a")
        b = site_client.submit(np.arange, 4, workers=b_workers, key="mix-b")
        mixed = site_client.submit(np.add, a, b, key="mix-ab")
        mixing = r"'mix-ab' mixes data of site 'A' \('mix-a'\) and site 'B' \('mix-b'\)"
        with pytest.raises(CrossSiteError, match=mixing):
            mixed.result()
        mixed.retry()  # refused again, not left waiting for a worker
        with pytest.raises(CrossSiteError, match=mixing):
            mixed.result()
        ones_a = site_client.persist(da.ones(8, chunks=4), resources={"site-A": 1})
        twos_b = site_client.persist(da.ones(8, chunks=4) * 2, resources={"site-B": 1})
        with pytest.raises(CrossSiteError, match="mixes data of site 'A'"):
            (ones_a + twos_b).sum().compute()
        weights = site_client.submit(np.full, 4, 10, workers=b_workers, key="dask-dl-weights-round-1")
        updated = site_client.submit(np.add, a, weights, key="update-a")
        assert updated.result().tolist() == [10, 11, 12, 13]
        audit = guard.audit()
    assert _holders(site_client, [updated]) <= set(a_workers)  # pinned to site A by its data, weights crossed
    crossed = [r for r in audit.records if r.key == "dask-dl-weights-round-1"]
    assert [(r.worker_site, r.key_site, r.weights, r.crossed) for r in crossed] == [("A", "B", True, False)]
    assert audit.violations == ()
    assert {r.keys[0] for r in audit.refusals if r.what == "task"} >= {"mix-ab"}


@pytest.mark.slow
def test_p2p_is_task_based_or_refused_and_close_restores(site_client):
    from distributed.active_memory_manager import ActiveMemoryManagerExtension

    a_workers, b_workers = site_workers(site_client, "site-A"), site_workers(site_client, "site-B")
    method = "array.rechunk.method"
    before = dask.config.get(method, None), site_client.run(dask.config.get, method, None)
    find_recipient = ActiveMemoryManagerExtension._find_recipient
    x = np.arange(16 * 16, dtype="f8").reshape(16, 16)
    with guard_sites(site_client, SITES) as guard:
        assert dask.config.get(method) == "tasks"
        assert set(site_client.run(dask.config.get, method).values()) == {"tasks"}
        on_a = site_client.persist(da.from_array(x, chunks=4), resources={"site-A": 1})
        columns = on_a.rechunk((16, 1))  # task-based while the guard is active
        assert not any("transfer" in str(key) for key in dict(columns.__dask_graph__()))
        np.testing.assert_array_equal(columns.compute(), x)
        with pytest.raises(CrossSiteError, match="is a P2P rechunk or shuffle"):
            on_a.rechunk((16, 1), method="p2p").sum().compute()
        assert site_client.run_on_scheduler(_active_shuffles) == 0  # refused before any P2P run started
        frame = dd.from_pandas(pd.DataFrame({"x": np.arange(40) % 7, "y": np.arange(40)}), npartitions=4)
        on_b = site_client.persist(frame, resources={"site-B": 1})
        assert dask.config.get("dataframe.shuffle.method") == "tasks"
        assert on_b.shuffle("x").y.sum().compute() == 780  # task-based, on site B
        with pytest.raises(CrossSiteError, match="is a P2P rechunk or shuffle"):
            on_b.shuffle("x", shuffle_method="p2p").y.sum().compute()
        # the backstop: a transfer task that asks the scheduler for a P2P run gets an error, not the run
        reply = site_client.run(_ask_for_p2p_run, workers=a_workers[:1])[a_workers[0]]
        assert reply["status"] == "error" and "starts a P2P rechunk or shuffle" in reply["exception_text"]
        audit = guard.audit()
    assert audit.violations == ()
    assert {r.what for r in audit.refusals} == {"p2p"}
    assert (dask.config.get(method, None), site_client.run(dask.config.get, method, None)) == before
    assert ActiveMemoryManagerExtension._find_recipient is find_recipient
    installed = site_client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
    assert SiteGuardPlugin.name not in installed
    assert guard.audit() is guard.close() and guard.closed
    # with the guard gone, replicate is Dask's own again: a site-A key reaches site B
    data = site_client.submit(np.arange, 3, workers=a_workers[:1], key="after-close")
    data.result()
    site_client.replicate([data])
    assert _holders(site_client, [data]) == set(a_workers) | set(b_workers)


@pytest.mark.slow
def test_retiring_a_site_worker():
    with _site_cluster(a0="site-A", a1="site-A", b0="site-B") as cluster, Client(cluster) as client:
        client.wait_for_workers(3)
        a_workers, (b_worker,) = site_workers(client, "site-A"), site_workers(client, "site-B")
        with guard_sites(client, SITES) as guard:
            data = client.persist(da.arange(12, chunks=3) + 1, workers=a_workers[:1])
            wait(data)
            assert _holders(client, data) == {a_workers[0]}
            assert a_workers[0] in client.retire_workers([a_workers[0]])
            assert _holders(client, data) == {a_workers[1]}  # moved within site A
            assert client.retire_workers([a_workers[1]]) == {}  # the last of site A: kept, keys stay
            assert _holders(client, data) == {a_workers[1]}
            audit = guard.audit()
        assert audit.violations == ()
        moved = {(r.worker, r.how) for r in audit.records}
        assert moved == {(a_workers[1], "acquire-replicas")}
        assert {r.what for r in audit.refusals} == {"replica"}

        with guard_sites(client, SITES, enforce=False) as guard:
            assert a_workers[1] in client.retire_workers([a_workers[1]])
            seen = guard.audit().violations
        assert _holders(client, data) == {b_worker}
        assert {(r.worker, r.worker_site, r.key_site, r.how) for r in seen} == {
            (b_worker, "B", "A", "acquire-replicas")
        }
        assert len(seen) == 4
        np.testing.assert_array_equal(data.compute(), np.arange(12) + 1)


def test_arguments_and_cluster_are_checked(site_client):
    assert len(site_workers(site_client, "site-A")) == 2
    with pytest.raises(ClusterError, match=r"no worker advertises the resource 'site-C'.*--resources site-C=1e6"):
        site_workers(site_client, "site-C")
    for bad in ({}, ["site-A"], {"A": 1}):
        with pytest.raises(ConfigurationError, match="sites must map"):
            guard_sites(site_client, bad)
    with pytest.raises(ConfigurationError, match=r"resource\(s\) \['site-A'\] for more than one site"):
        guard_sites(site_client, {"A": "site-A", "A2": "site-A"})
    with pytest.raises(ClusterError, match=r"site\(s\) \['C'\] have no worker"):
        guard_sites(site_client, {**SITES, "C": "site-C"})
    with guard_sites(site_client, SITES), pytest.raises(ClusterError, match="a site guard is already active"):
        guard_sites(site_client, SITES)


@pytest.mark.slow
def test_audit_counts_crossings_not_weights_or_keys_of_no_site():
    records = (
        Arrival("x", "w-b", "B", "A", "fetch"),
        Arrival(("dask-dl-weights-A", 0), "w-b", "B", "A", "fetch"),
        Arrival("y", "w-b", "B", None, "scatter"),
        Arrival("z", "w-c", None, "A", "gather"),
        Arrival("v", "w-a", "A", "A", "fetch"),
    )
    audit = Audit(records=records, sites=SITES, workers={"w-a": "A", "w-b": "B", "w-c": None})
    assert [r.key for r in audit.violations] == ["x", "z"]
    assert audit.to_frame()["crossed"].tolist() == [True, False, False, True, False]
    assert str(audit) == (
        "site audit of 3 workers (A, B): 5 transfers, 3 within a site or of weights, 2 across sites, 0 refused"
    )

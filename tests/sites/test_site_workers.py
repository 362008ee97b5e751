"""A shared cluster whose workers belong to sites: trainers stay on their site's workers, under the site guard.

The guard (``dask_dl.sites.guard``) is built on its own branch; these tests run once it is there.
"""

from __future__ import annotations

import pytest
from distributed import Client, Nanny, Scheduler, SpecCluster

import dask_dl
from dask_dl.sites import guard
from dask_dl.testing.train import squares_collection

OPTIONS = dict(model="small_cnn", model_kwargs={"width": 8}, batch_size=8, lr=0.05, optimizer="sgd", seed=0)


@pytest.fixture(scope="module")
def site_cluster(tmp_path_factory):
    """One worker per site (resource ``site-A`` / ``site-B``) and one plain worker, as Nanny processes."""
    workers = {
        name: {"cls": Nanny, "options": {"nthreads": 1, "resources": resources}}
        for name, resources in (("a", {"site-A": 1e9}), ("b", {"site-B": 1e9}), ("plain", {}))
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    tmp = tmp_path_factory.mktemp("guarded")
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        stores = {}
        for i, name in enumerate("AB"):
            stores[name] = str(tmp / f"{name}.zarr")
            catalog = squares_collection(tmp / name, n_train=32, n_val=16, seed=i)
            dask_dl.ingest(catalog, stores[name], size=32, chunk=8, shard=2, client=client, progress=False)
        yield client, stores


@pytest.mark.slow
def test_cyclic_on_site_workers_is_audited_clean(site_cluster):
    client, stores = site_cluster
    sites = {n: {"dataset": dask_dl.open_dataset(s), "resource": f"site-{n}"} for n, s in stores.items()}
    run = dask_dl.fit_sites(sites, protocol="cyclic", rounds=2, client=client, **OPTIONS)
    assert run.status == "finished" and run.history["auroc_mean"].notna().all()
    assert run.audit is not None and list(run.audit.violations) == []
    # every visit trained on its own site's worker only (never the plain worker, never the other site's)
    h = run.history
    for name in "AB":
        assert set(h[h["site"] == name]["workers"]) == {" ".join(guard.site_workers(client, f"site-{name}"))}

"""What a site is, and the coordinator's connection to it.

A site of :func:`dask_dl.fit_sites` is one of:

- **a cluster of its own** (one cluster per site, what hospitals run): ``{"scheduler": "tls://...", "security":
  ..., "store": "/data/cxr.zarr"}``, or ``{"cluster": cluster_or_client, "store": ...}``; the store path is
  the one the site's workers see, the coordinator never opens it;
- **workers of a shared cluster**: ``{"dataset": open_dataset(store), "resource": "site-A"}``, the resource
  marking that site's workers (the site guard keeps every site's data on them);
- **a dataset alone** (a simulation on one cluster, no guard): ``open_dataset(store)``.

:func:`connect_sites` turns these into :class:`Connected` sites: a client, the workers to train on, and the
site's *manifest* (the sample numbers and splits ``fit`` needs; for a site of its own, made by a task on the site).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dask_dl.errors import ClusterError, ConfigurationError, DatasetError

if TYPE_CHECKING:  # pragma: no cover
    import xarray as xr
    from distributed import Client

    from dask_dl.sites.transfers import Transfers

__all__ = ["Connected", "Site", "as_site", "connect_sites"]

_KEYS = ("dataset", "resource", "store", "scheduler", "security", "cluster")


@dataclass(frozen=True)
class Site:
    """Where one site's data and workers are (see the module docstring for the three forms).

    Parameters
    ----------
    dataset
        Shared cluster: the site's ``open_dataset(store)``.
    resource
        Shared cluster: the worker resource of the site's workers (``dask worker --resources site-A=1e9``).
    store
        A cluster of its own: the site's store, as a path or URL its workers see.
    scheduler, security
        A cluster of its own: its scheduler address (``tcp://`` or ``tls://``) and TLS settings.
    cluster
        A cluster of its own: a cluster object (LocalCluster, a gateway or SLURM cluster) or a Client of it.
    """

    dataset: Any = None
    resource: str | None = None
    store: str | None = None
    scheduler: str | None = None
    security: Any = None
    cluster: Any = None

    @property
    def own_cluster(self) -> bool:
        """True for a site with a cluster of its own (topology 1)."""
        return self.scheduler is not None or self.cluster is not None


def as_site(name: str, value: Any) -> Site:
    """Turn one value of ``fit_sites``'s ``sites`` mapping into a :class:`Site`, or say what is wrong.

    Raises
    ------
    ConfigurationError
        Unknown keys, a site with neither a dataset nor a cluster, or a cluster without a store.
    """
    if isinstance(value, Site):
        site = value
    elif hasattr(value, "data_vars"):
        site = Site(dataset=value)
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ConfigurationError(f"site {name!r} has unknown keys {unknown}; a site takes {list(_KEYS)}")
        site = Site(**dict(value))
    else:
        raise ConfigurationError(
            f"site {name!r} is a {type(value).__name__}; pass open_dataset(store), {{'dataset': ds, 'resource': "
            "'site-A'}} or {'scheduler': 'tls://host:8786', 'store': '/data/cxr.zarr'}"
        )
    if site.own_cluster:
        if site.store is None:
            raise ConfigurationError(
                f"site {name!r} has a cluster of its own but no store; add 'store': the path its workers see"
            )
        if site.dataset is not None:
            raise ConfigurationError(
                f"site {name!r} has both a cluster of its own and a dataset; its data stays there: give 'store'"
            )
    elif site.dataset is None:
        raise ConfigurationError(
            f"site {name!r} has neither a dataset nor a cluster; pass {{'dataset': open_dataset(store)}} or "
            "{'scheduler': ADDRESS, 'store': PATH}"
        )
    return site


@dataclass
class Connected:
    """A site as the coordinator holds it while a run lasts."""

    name: str
    client: Client
    dataset: xr.Dataset  #: the site's manifest (shared cluster: the dataset itself)
    workers: list[str] | None  #: the workers the site may train and evaluate on (None: any of its cluster)
    resource: str | None = None
    owns_client: bool = False
    lost: str | None = None  #: why the site went away, once it did
    train_samples: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    val_samples: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def store(self) -> str:
        return str(self.dataset.encoding["source"])

    @property
    def n_train(self) -> int:
        return len(self.train_samples)

    def close(self) -> None:
        """Close the client this run opened to the site (never the site's cluster, never a client passed in)."""
        if self.owns_client:
            self.client.close()


def connect_sites(sites: Mapping[str, Any], *, client: Client | None, transfers: Transfers) -> list[Connected]:
    """Connect to every site and fetch its manifest; close what was opened when one fails.

    Raises
    ------
    ConfigurationError
        Fewer than one site, a bad site, or sites whose labels, task or image size differ.
    DatasetError
        A site without ``train`` or ``val`` samples.
    """
    if not isinstance(sites, Mapping) or not sites:
        raise ConfigurationError(
            f"sites must be a non-empty mapping of site names to sites, got {sites!r}; e.g. "
            "{'A': open_dataset('a.zarr'), 'B': open_dataset('b.zarr')}"
        )
    checked = {str(name): as_site(str(name), value) for name, value in sites.items()}
    connected: list[Connected] = []
    try:
        for name, site in checked.items():
            connected.append(_connect(name, site, client=client, transfers=transfers))
    except BaseException:
        for site in connected:
            site.close()
        raise
    _check_alike(connected)
    return connected


def _connect(name: str, site: Site, *, client: Client | None, transfers: Transfers) -> Connected:
    from dask_dl.cluster import get_client

    if site.own_cluster:
        owns = False
        if site.cluster is not None:
            own = site.cluster if hasattr(site.cluster, "submit") else None
            if own is None:
                from distributed import Client as DaskClient

                own, owns = DaskClient(site.cluster, set_as_default=False), True
        else:
            try:
                own, owns = get_client(scheduler=site.scheduler, security=site.security), True
            except ClusterError as exc:  # which site's scheduler, as the plan names it
                raise ClusterError(f"site {name!r}: {exc}") from None
        try:
            workers = _resource_workers(own, site.resource) if site.resource else None
            future = own.submit(manifest, site.store, key=f"dask-dl-manifest-{name}", pure=False, workers=workers)
            dataset = transfers.receive(name, "manifest", future.result())
        except BaseException:
            if owns:
                own.close()
            raise
        return _with_samples(Connected(name, own, dataset, workers, site.resource, owns_client=owns))
    shared = get_client(client)
    workers = _resource_workers(shared, site.resource) if site.resource else None
    return _with_samples(Connected(name, shared, site.dataset, workers, site.resource))


def _resource_workers(client: Client, resource: str) -> list[str]:
    from dask_dl.sites.guard import site_workers  # the shared cluster's guard lists a site's workers

    return list(site_workers(client, resource))


def manifest(store: str) -> xr.Dataset:
    """Run on a site: what ``fit`` needs of its store, and nothing more (no pixels, labels or ids).

    Returns the store's attributes and ``encoding["source"]``, and the ``sample`` and ``split`` coordinates of
    its valid rows.
    """
    import dask
    import xarray as xr

    from dask_dl.data.dataset import open_dataset

    with dask.config.set(scheduler="sync"):  # small coordinate arrays, read in this task: no tasks from a task
        ds = open_dataset(store)
    attrs = dict(ds.attrs)
    # a grey store's layout may not say its channels: fit would read them from `image`, which stays here
    attrs["dask_dl"] = {**attrs["dask_dl"], "channels": int(ds["image"].sizes.get("channel", 1))}
    out = xr.Dataset(
        coords={"sample": ds["sample"].values, "split": ("sample", np.asarray(ds["split"].values).astype(str))},
        attrs=attrs,
    )
    out.encoding["source"] = ds.encoding["source"]
    return out


def _with_samples(site: Connected) -> Connected:
    from dask_dl.train.options import check_dataset

    try:
        data = check_dataset(site.dataset)
    except DatasetError as exc:
        raise DatasetError(f"site {site.name!r}: {exc}") from exc
    site.train_samples, site.val_samples = data["train_samples"], data["val_samples"]
    return site


def _check_alike(sites: list[Connected]) -> None:
    def what(site: Connected) -> tuple:
        meta = site.dataset.attrs["dask_dl"]
        channels = meta.get("channels") or site.dataset["image"].sizes.get("channel", 1)
        return tuple(meta.get("labels") or ()), meta.get("task", "multilabel"), meta.get("size"), int(channels)

    first = what(sites[0])
    for site in sites[1:]:
        if what(site) != first:
            raise ConfigurationError(
                f"site {site.name!r} has labels, task, size and channels {what(site)}, site {sites[0].name!r} "
                f"{first}: one model needs them alike everywhere; ingest every site alike"
            )

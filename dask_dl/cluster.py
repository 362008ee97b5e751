"""Making or connecting to the Dask cluster that dask_dl runs on.

Every dask_dl function that computes takes ``client=None``; :func:`get_client` turns that into a client: the one
passed, else the current default client (``distributed.Client()`` made earlier in a notebook), else a new client
of a :class:`distributed.LocalCluster` with processes. The CLI's ``--scheduler ADDRESS`` connects to a running
scheduler (TLS addresses included, with the security settings of ``distributed.comm.tls`` in dask.config).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_dl import config

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client


def get_client(client: Client | None = None, *, scheduler: str | None = None, n_workers: int | None = None) -> Client:
    """Return a Dask client to run on.

    Parameters
    ----------
    client
        Use this client as it is.
    scheduler
        Address of a running scheduler to connect to (``tcp://...``, ``tls://...``).
    n_workers
        Workers of the local cluster started when there is neither a client nor a scheduler address;
        default ``dask-dl.cluster.n-workers``.

    Returns
    -------
    distributed.Client
        A client whose cluster is closed with the client when dask_dl started it.
    """
    from distributed import Client, LocalCluster

    if client is not None:
        return client
    if scheduler is not None:
        return Client(scheduler)
    try:
        from distributed import default_client

        return default_client()
    except ValueError:
        pass
    cluster = LocalCluster(
        n_workers=config.get("cluster.n-workers", n_workers),
        threads_per_worker=config.get("cluster.threads-per-worker"),
        memory_limit=config.get("cluster.memory-limit"),
        processes=True,
        dashboard_address=":0",
    )
    client = Client(cluster)
    client._dask_dl_owns_cluster = True  # closed by close_client
    return client


def close_client(client: Client) -> None:
    """Close ``client``, and its cluster too when :func:`get_client` started that cluster."""
    if getattr(client, "_dask_dl_owns_cluster", False):
        cluster = client.cluster
        client.close()
        cluster.close()

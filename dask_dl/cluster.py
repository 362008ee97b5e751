"""Making or connecting to the Dask cluster that dask_dl runs on.

Every dask_dl function that computes takes ``client=None``; :func:`get_client` turns that into a client: the one
passed, else the current default client (``distributed.Client()`` made earlier in a notebook), else a new client
of a :class:`distributed.LocalCluster` with processes. The CLI's ``--scheduler ADDRESS`` connects to a running
scheduler (TLS addresses included, with the security settings of ``distributed.comm.tls`` in dask.config).

:func:`connect` is the one way dask_dl code opens a cluster for a piece of work: it yields a client and, on the way
out, closes exactly what it opened (the client first, then the cluster) and nothing the caller brought.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dask_dl import config

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

__all__ = ["close_client", "connect", "get_client"]


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
        client = Client(scheduler)
        client._dask_dl_owns_client = True  # our connection to someone else's cluster: closed, cluster left
        return client
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
        dashboard_address="127.0.0.1:0",  # nothing listens on all interfaces unless asked
    )
    client = Client(cluster)
    client._dask_dl_owns_cluster = True  # closed by close_client
    return client


def close_client(client: Client) -> None:
    """Close what :func:`get_client` opened for ``client``: the client, then its cluster when dask_dl started it.

    A client that was passed in or was the default client is left open.
    """
    owns_cluster = getattr(client, "_dask_dl_owns_cluster", False)
    if not (owns_cluster or getattr(client, "_dask_dl_owns_client", False)):
        return
    cluster = client.cluster if owns_cluster else None
    client.close()  # first: a client outliving its scheduler retries the lost connection and logs about it
    if cluster is not None:
        cluster.close()


@contextlib.contextmanager
def connect(
    client: Client | None = None, *, scheduler: str | None = None, n_workers: int | None = None
) -> Iterator[Client]:
    """Yield a client to work on, and close on exit only what this call opened.

    Takes the same arguments as :func:`get_client`: a client passed in (or the current default client) is yielded
    as it is and stays open; a ``scheduler`` address gets a connection that is closed on exit; otherwise a local
    cluster is started and closed on exit, client first.

    Examples
    --------
    >>> with connect(n_workers=2) as client:  # doctest: +SKIP
    ...     ingest(catalog, "cxr.zarr", client=client)
    """
    client = get_client(client, scheduler=scheduler, n_workers=n_workers)
    try:
        yield client
    finally:
        close_client(client)

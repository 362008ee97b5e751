"""``make("gateway")``: a cluster of a dask-gateway server (Kubernetes, Hadoop, HPC or local backends).

The gateway starts the scheduler and the workers; dask_dl asks for them through *cluster options*, which the
server defines in its options handler. dask_dl uses four: ``worker_cores``, ``worker_memory``, ``gpus`` (becomes
the workers' ``GPU`` resource, so trainers go there) and ``environment``. A server config that offers them ships
in ``docs/gateway/dask_gateway_config.py`` (see the clusters how-to). Connections to a gateway cluster are always
TLS with certificates the gateway makes per cluster.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import TYPE_CHECKING, Any

from dask_dl import config
from dask_dl.checks import positive_int
from dask_dl.errors import ClusterError, ConfigurationError, missing_dependency

if TYPE_CHECKING:  # pragma: no cover
    from distributed.security import Security

__all__ = ["make_gateway"]

_DOCS = "docs/gateway/dask_gateway_config.py (see the clusters how-to)"


def _server_options(gateway_class: Any, connection: dict[str, Any]) -> Any:
    """The cluster options the server offers, with its defaults.

    Asked through an asynchronous ``Gateway`` on a thread of its own: a synchronous one logs a traceback when it is
    garbage-collected after ``close()`` (dask-gateway 2026.3), and a notebook's thread already runs an event loop.
    """

    async def ask() -> Any:
        async with gateway_class(**connection, asynchronous=True) as gateway:
            return await gateway.cluster_options(use_local_defaults=False)

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dask-dl-gateway") as pool:
        try:
            return pool.submit(asyncio.run, ask()).result()
        except Exception as exc:
            problem = _unreachable(connection["address"], exc)
            if problem is None:
                raise
            raise ClusterError(problem) from exc


def _unreachable(address: str, exc: Exception) -> str | None:
    """What a user must fix when the gateway at ``address`` did not answer its first request, or None.

    dask-gateway passes the HTTP client's errors through as they are: a 401 for a wrong password, a refused
    connection, a URL without a scheme.
    """
    import aiohttp

    reason = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ClientResponseError) and exc.status in (401, 403):
        return (
            f"the gateway at {address} refused this user ({exc.status} {exc.message}): give the credentials its "
            "authenticator wants, with auth= (e.g. dask_gateway.BasicAuth('alice', password)) or in dask-gateway's "
            "config, e.g. DASK_GATEWAY__AUTH__TYPE=basic DASK_GATEWAY__AUTH__KWARGS__PASSWORD=... in the environment"
        )
    if isinstance(exc, (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError)):
        return f"the gateway address {address!r} is not an http(s) URL ({reason}); write it as http://host:port"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return (
            f"cannot reach the gateway at {address} ({reason}): check that the server runs and that this is its "
            "address (the proxy's HTTP address, e.g. http://gateway:8000)"
        )
    if isinstance(exc, (aiohttp.ClientError, ValueError)):  # dask-gateway raises a 404's text as a ValueError
        return (
            f"the server at {address} did not answer as a dask-gateway server ({reason}); check that this is the "
            "gateway's address (the proxy's HTTP address, e.g. http://gateway:8000)"
        )
    return None


def _closing_cluster_class(base: type) -> type:
    """``GatewayCluster`` whose ``close()`` leaves nothing for garbage collection to trip over.

    dask-gateway 2026.3's ``Gateway.__del__`` calls ``close()`` again, which raises (and prints a traceback) once
    the first ``close()`` has stopped its event loop; after closing, the cluster's gateway forgets its loop runner so
    that ``__del__`` has nothing left to do.
    """

    class DaskDLGatewayCluster(base):
        def close(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().close(*args, **kwargs)
            finally:
                gateway = getattr(self, "gateway", None)
                if gateway is not None and not getattr(gateway, "asynchronous", True):
                    gateway.__dict__.pop("_loop_runner", None)

    DaskDLGatewayCluster.__name__ = DaskDLGatewayCluster.__qualname__ = base.__name__
    return DaskDLGatewayCluster


def make_gateway(
    *,
    address: str | None = None,
    auth: Any = None,
    n_workers: int | None = None,
    workers: int | None = None,
    gpus: int | None = None,
    worker_cores: int | None = None,
    worker_memory: float | None = None,
    environment: dict[str, str] | None = None,
    security: Security | bool | None = None,
    proxy_address: str | None = None,
    public_address: str | None = None,
    **kwargs: Any,
) -> Any:
    """A new cluster of the dask-gateway server at ``address``, scaled to ``workers`` workers.

    Parameters
    ----------
    address, auth, proxy_address, public_address
        Of the gateway server (``dask_gateway.Gateway``); default ``dask-dl.cluster.gateway.*``, then dask-gateway's
        own config (``gateway.address``, ``gateway.auth.type``). ``auth`` is a name (``"basic"``, ``"kerberos"``,
        ``"jupyterhub"``) or a ``dask_gateway.auth`` object.
    n_workers, workers
        Workers to scale to (``workers`` is the gateway-style name of the same thing); default
        ``dask-dl.cluster.gateway.workers``.
    gpus
        GPUs per worker: the workers advertise a ``GPU`` resource of this size (default
        ``dask-dl.cluster.gateway.gpus``, 0).
    worker_cores, worker_memory, environment
        Cluster options of the same names (cores, GiB, environment variables of the workers).
    security
        Not used: the gateway makes the cluster's TLS certificates itself.
    **kwargs
        Further cluster options of your gateway (``image="..."`` on Kubernetes, ``queue=...`` on HPC).

    Returns
    -------
    dask_gateway.GatewayCluster
        ``cluster.close()`` shuts the gateway cluster down.

    Raises
    ------
    ClusterError
        The server does not offer an option dask_dl was asked to set; the message lists the ones it offers.
    ConfigurationError
        No gateway address (argument or config), or ``security`` was passed.
    MissingDependencyError
        dask-gateway is not installed.
    """
    try:
        from dask_gateway import Gateway, GatewayCluster
    except ImportError:
        raise missing_dependency("dask-gateway", "gateway", "make('gateway')") from None
    import dask.config

    if security not in (None, False):
        raise ConfigurationError(
            "make('gateway') takes no security=: every gateway cluster is TLS already, with "
            "certificates the gateway makes for it"
        )
    address = config.get("cluster.gateway.address", address) or dask.config.get("gateway.address", None)
    if not address:
        raise ConfigurationError(
            "make('gateway') needs the gateway's address: pass address='http://gateway:8000', or set it once with "
            "dask.config.set({'dask-dl.cluster.gateway.address': 'http://gateway:8000'}), in a dask yaml, or in the "
            "environment: DASK_GATEWAY__ADDRESS=http://gateway:8000 (dask-gateway's own setting)"
        )
    n = workers if workers is not None else n_workers
    n = positive_int("workers", config.get("cluster.gateway.workers", n))
    wanted = {
        "gpus": config.get("cluster.gateway.gpus", gpus),
        "worker_cores": config.get("cluster.gateway.worker-cores", worker_cores),
        "worker_memory": config.get("cluster.gateway.worker-memory", worker_memory),
        "environment": environment,
    } | kwargs
    wanted = {k: v for k, v in wanted.items() if v is not None and not (k == "gpus" and v == 0)}
    connection = {
        "address": address,
        "auth": config.get("cluster.gateway.auth", auth),
        "proxy_address": config.get("cluster.gateway.proxy-address", proxy_address),
        "public_address": config.get("cluster.gateway.public-address", public_address),
    }
    options = _server_options(Gateway, connection)
    missing = sorted(set(wanted) - set(options))
    if missing:
        raise ClusterError(
            f"the gateway at {address} offers no cluster option {', '.join(map(repr, missing))} (it offers "
            f"{', '.join(options) or 'none'}); add them to the server's options handler, as in {_DOCS}"
        )
    for name, value in wanted.items():
        options[name] = value
    cluster = _closing_cluster_class(GatewayCluster)(cluster_options=options, **connection)
    try:
        cluster.scale(n)
    except BaseException:
        cluster.close()
        raise
    cluster._dask_dl_workers = n
    return cluster

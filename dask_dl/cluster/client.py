"""Turning ``client=None`` into a client, and closing exactly what was opened for it.

Every dask_dl function that computes takes ``client=None``; :func:`get_client` turns that into a client: the one
passed, else a cluster of the ``kind`` asked for (:func:`dask_dl.cluster.make`), else a connection to a running
``scheduler`` address, else the current default client (``distributed.Client()`` made earlier in a notebook), else
a new client of a local cluster. :func:`connect` is the one way dask_dl code opens a cluster for a piece of work: it
yields a client and, on the way out, closes exactly what it opened (the client first, then the cluster, which for
a batch system cancels its jobs) and nothing the caller brought, on success, on error and on Ctrl-C alike.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dask_dl.cluster.tls import security_from
from dask_dl.errors import ClusterError, ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client
    from distributed.security import Security

__all__ = ["close_client", "connect", "get_client"]

logger = logging.getLogger(__name__)


def get_client(
    client: Client | None = None,
    *,
    scheduler: str | None = None,
    n_workers: int | None = None,
    kind: str | None = None,
    security: Security | bool | None = None,
    **kwargs: Any,
) -> Client:
    """Return a Dask client to run on.

    Parameters
    ----------
    client
        Use this client as it is.
    scheduler
        Address of a running scheduler to connect to (``tcp://...``, ``tls://...``).
    n_workers
        Workers of the cluster started when there is neither a client nor a scheduler address; default
        ``dask-dl.cluster.n-workers`` (for ``kind="slurm"``: jobs, ``"gateway"``: workers).
    kind
        Make a cluster of this kind (``local``, ``cuda``, ``gateway``, ``slurm``) with :func:`dask_dl.cluster.make`
        instead of using the default client; ``kwargs`` go to it.
    security
        TLS settings: a :class:`distributed.security.Security`, or True for throw-away certificates of a local
        cluster (:func:`dask_dl.cluster.tls.security_from`).

    Returns
    -------
    distributed.Client
        A client whose cluster is closed with the client (:func:`close_client`) when dask_dl started it.

    Raises
    ------
    ConfigurationError
        A ``tls://`` scheduler address without any certificates (argument or dask.config), or a bad option of the
        cluster kind.
    ClusterError
        The workers of a cluster made here did not come (``dask-dl.cluster.wait-timeout``).
    """
    import dask.config
    from distributed import Client
    from distributed.security import Security

    if client is not None:
        return client
    security = security_from(security)
    if scheduler is not None:
        if security is None and str(scheduler).startswith("tls://"):
            _check_tls_config(scheduler)
        client = _connect_to(scheduler, security)
        client._dask_dl_owns_client = True  # our connection to someone else's cluster: closed, cluster left
        return client
    if kind is None and security is None and not kwargs:
        try:
            from distributed import default_client

            return default_client()
        except ValueError:
            pass
    from dask_dl.cluster.make import make, wait_for_workers

    if security is None and dask.config.get("distributed.comm.require-encryption", False):
        security = Security()  # the certificate files of dask.config (dask-dl --tls-ca/--tls-cert/--tls-key)

    cluster = make(kind, n_workers=n_workers, security=security, **kwargs)
    try:
        client = Client(cluster)  # takes the cluster's security
        client._dask_dl_owns_cluster = True  # closed by close_client
        wait_for_workers(client, cluster)
    except BaseException:  # Ctrl-C while a batch queue holds the jobs back included: cancel them
        _close(locals().get("client"), cluster)
        raise
    return client


def _connect_to(scheduler: str, security: Security | None) -> Client:
    """A client of the running scheduler at ``scheduler``, or a ClusterError that says why it cannot be one."""
    from distributed import Client
    from distributed.comm.core import CommClosedError

    # A Client that failed to connect is finalized by its __del__, which stops its event loop and waits for it. Run
    # by the garbage collector inside the thread that starts the next Client's event loop, that wait never ends,
    # and the next Client fails after 10 s with a bare AssertionError (seen with distributed 2026.7). Collecting
    # here, before and after an attempt, finalizes such clients in this thread, where waiting is safe.
    gc.collect()
    try:
        return Client(scheduler, security=security)
    except OSError as exc:  # distributed's CommClosedError and its connect timeout are OSErrors
        reason = f"{type(exc).__name__}: {exc}"
        if "SSL" in reason or "TLS certificate" in reason:
            hint = (
                "the TLS handshake failed: the scheduler and this client do not trust each other's certificates; "
                "pass the CA and the certificate that the scheduler's authority issued (--tls-ca, --tls-cert, "
                "--tls-key; Python: security=dask_dl.cluster.tls_files(...))"
            )
        elif str(scheduler).startswith("tcp://") and isinstance(exc, ConnectionError | CommClosedError):
            hint = "the scheduler closed the connection: if it uses TLS, its address starts with tls://"
        else:
            hint = (
                "check that the scheduler runs, that this is its address (host:port, as `dask scheduler` prints "
                "it), and that this machine can reach that port"
            )
        message = f"cannot connect to the scheduler at {scheduler} ({reason}): {hint}"
    gc.collect()  # the failed Client, still held by the exception's frames until now
    raise ClusterError(message) from None


def _check_tls_config(scheduler: str) -> None:
    """A ``tls://`` address with no certificates anywhere fails deep in ssl: say what to pass instead."""
    from distributed.security import Security

    configured = Security()
    if configured.tls_ca_file is None and configured.tls_client_cert is None:
        raise ConfigurationError(
            f"the scheduler {scheduler} uses TLS, and no certificates were given: pass --tls-ca CA.pem --tls-cert "
            "CERT.pem --tls-key KEY.pem (Python: security=dask_dl.cluster.tls_files(ca=..., cert=..., key=...)), "
            "or set distributed.comm.tls.* in dask.config"
        )


def close_client(client: Client) -> None:
    """Close what :func:`get_client` opened for ``client``: the client, then its cluster when dask_dl started it.

    A client that was passed in or was the default client is left open.
    """
    owns_cluster = getattr(client, "_dask_dl_owns_cluster", False)
    if not (owns_cluster or getattr(client, "_dask_dl_owns_client", False)):
        return
    _close(client, client.cluster if owns_cluster else None)


def _close(client: Client | None, cluster: Any) -> None:
    if client is not None:
        client.close()  # first: a client outliving its scheduler retries the lost connection and logs about it
    if cluster is not None:
        logger.info("closing %s", type(cluster).__name__)
        with _console_shows_warnings_only():
            cluster.close()


class _WarningsAndErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


@contextlib.contextmanager
def _console_shows_warnings_only() -> Iterator[None]:
    """While a cluster dask_dl started closes, distributed's INFO records stay off the console; warnings still show.

    A cluster keeps distributed's console quiet while it runs (LocalCluster below WARNING, dask-jobqueue below
    ERROR) but gives the console its level back before its event loop has stopped: the scheduler's stream to a
    worker that the close has just ended can then report ``Batched Comm Closed`` with a traceback, at INFO, on the
    terminal of a command that ended as it should. A filter, not a level: the cluster's own restoring of handler
    levels on close would undo a level.
    """
    handlers = [h for h in logging.getLogger("distributed").handlers if isinstance(h, logging.StreamHandler)]
    quiet = _WarningsAndErrors()
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)


@contextlib.contextmanager
def connect(
    client: Client | None = None,
    *,
    scheduler: str | None = None,
    n_workers: int | None = None,
    kind: str | None = None,
    security: Security | bool | None = None,
    **kwargs: Any,
) -> Iterator[Client]:
    """Yield a client to work on, and close on exit only what this call opened.

    Takes the same arguments as :func:`get_client`: a client passed in (or the current default client) is yielded
    as it is and stays open; a ``scheduler`` address gets a connection that is closed on exit; a ``kind`` gets a
    new cluster of that kind (a SLURM cluster's jobs are cancelled on exit, also on error and Ctrl-C); otherwise a
    local cluster is started and closed on exit, client first. Inside the block the yielded client is the current
    one, so that what it persisted is computed through it even where another client was current before.

    Examples
    --------
    >>> with connect(n_workers=2) as client:  # doctest: +SKIP
    ...     ingest(catalog, "cxr.zarr", client=client)
    >>> with connect(kind="slurm", n_workers=4, gpus_per_job=1, cpu_jobs=2) as client:  # doctest: +SKIP
    ...     fit(dataset, trainers=4, client=client)
    """
    client = get_client(client, scheduler=scheduler, n_workers=n_workers, kind=kind, security=security, **kwargs)
    try:
        with _sigterm_interrupts(getattr(client, "_dask_dl_owns_cluster", False)), client.as_current():
            yield client
    finally:
        close_client(client)


@contextlib.contextmanager
def _sigterm_interrupts(active: bool) -> Iterator[None]:
    """While a cluster we made is open, SIGTERM raises KeyboardInterrupt, so that the way out still closes it.

    ``scancel`` of a batch script, a gateway culling a notebook and ``kill`` send SIGTERM; by default Python dies
    on it at once, leaving the cluster's jobs to their walltime. Only in the main thread (signals go there), and
    only when nobody else installed a handler.
    """
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        logger.warning("SIGTERM: closing the cluster dask_dl started (cancelling its jobs) before exiting")
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

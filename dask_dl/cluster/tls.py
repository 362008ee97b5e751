"""TLS settings for any kind of cluster: throw-away certificates locally, certificate files elsewhere.

A :class:`distributed.security.Security` carries the certificates of the scheduler, the workers and the client;
with it every Dask connection of the cluster is ``tls://`` and a client without a certificate signed by the same
authority is refused. Locally :meth:`Security.temporary` makes a fresh authority per cluster; for external workers
(a batch system, a site's scheduler) the certificate files come from the site: ``--tls-ca/--tls-cert/--tls-key``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dask_dl.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from distributed.security import Security

__all__ = ["security_from", "tls_files"]


def security_from(security: Security | bool | None) -> Security | None:
    """Return the ``Security`` that ``security`` asks for.

    Parameters
    ----------
    security
        None: no TLS of dask_dl's making (dask.config's ``distributed.comm.tls`` still applies to ``tls://``
        addresses); True: :meth:`Security.temporary` (a fresh certificate authority, for local clusters); a
        ``Security``: used as it is.

    Raises
    ------
    ConfigurationError
        Anything else.
    """
    if security is None or security is False:
        return None
    from distributed.security import Security

    if security is True:
        return Security.temporary()
    if isinstance(security, Security):
        return security
    raise ConfigurationError(
        f"security must be True (throw-away TLS certificates), a distributed.security.Security or None, got "
        f"{security!r}; for certificate files use dask_dl.cluster.tls_files(ca=..., cert=..., key=...)"
    )


def tls_files(*, ca: str | os.PathLike, cert: str | os.PathLike, key: str | os.PathLike | None = None) -> Security:
    """A ``Security`` from PEM files, used for the client, the scheduler and the workers alike.

    Parameters
    ----------
    ca
        The certificate authority that signed every certificate of the cluster.
    cert
        This process's certificate (it may hold the private key too, then ``key`` is not needed).
    key
        The private key of ``cert`` when it is in a file of its own.

    Returns
    -------
    distributed.security.Security
        With ``require_encryption=True``: a plain ``tcp://`` address is refused rather than used unencrypted.

    Raises
    ------
    ConfigurationError
        A file does not exist.

    Examples
    --------
    >>> security = tls_files(ca="ca.pem", cert="me.pem", key="me.key")  # doctest: +SKIP
    >>> client = Client("tls://scheduler:8786", security=security)  # doctest: +SKIP
    """
    from distributed.security import Security

    files = {"--tls-ca": ca, "--tls-cert": cert, "--tls-key": key}
    for option, path in files.items():
        if path is not None and not os.path.isfile(path):
            raise ConfigurationError(
                f"{option} {os.fspath(path)!r} is not a file; pass the PEM files your site's certificate "
                f"authority issued (e.g. {option} /etc/dask/{option[6:]}.pem)"
            )
    ca, cert = os.fspath(ca), os.fspath(cert)
    key = os.fspath(key) if key is not None else None
    return Security(
        tls_ca_file=ca,
        tls_client_cert=cert,
        tls_client_key=key,
        tls_scheduler_cert=cert,
        tls_scheduler_key=key,
        tls_worker_cert=cert,
        tls_worker_key=key,
        require_encryption=True,
    )

"""Options and parameter types that several commands share: the cluster to run on, models and registries by name,
local paths or fsspec URLs."""

from __future__ import annotations

from typing import Any

import click

from dask_dl.models import MODELS
from dask_dl.registry import Registry


def scheduler_option(f):
    """``--scheduler``/``--workers`` options shared by every command that runs on a cluster (with cluster_options)."""
    f = cluster_options(f)
    f = click.option(
        "--workers",
        "-w",
        "--jobs",
        "workers",
        type=int,
        default=None,
        help="Workers of the cluster started when no --scheduler is given, or jobs of --cluster slurm "
        "(default from config).",
    )(f)
    return click.option(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="Address of a running Dask scheduler (tcp://host:8786, tls://...). Default: start a local cluster.",
    )(f)


def _set_config(key: str | tuple[str, ...]):
    """Click callback: put an option's value into dask.config for the command's duration (dask_dl reads it there)."""

    def callback(ctx: click.Context, param: click.Parameter, value):
        if value is not None:
            import dask.config

            keys = {key: value} if isinstance(key, str) else {k: value for k in key}
            if param.name.startswith("tls"):
                keys["distributed.comm.require-encryption"] = True
            ctx.with_resource(dask.config.set(keys))
        return value

    return callback


def cluster_options(f):
    """``--cluster KIND`` and ``--tls-ca/--tls-cert/--tls-key``, applied through dask.config (no parameters).

    ``--cluster`` sets ``dask-dl.cluster.kind`` (the kind :func:`dask_dl.cluster.make` makes when no
    ``--scheduler`` is given); the TLS files set ``distributed.comm.tls.*``, which a ``tls://`` scheduler address
    and the clusters dask_dl makes both use.
    """
    from dask_dl.cluster.make import KINDS

    tls = [
        (
            "--tls-key",
            (
                "distributed.comm.tls.client.key",
                "distributed.comm.tls.scheduler.key",
                "distributed.comm.tls.worker.key",
            ),
            "Private key of --tls-cert, when it is a file of its own.",
        ),
        (
            "--tls-cert",
            (
                "distributed.comm.tls.client.cert",
                "distributed.comm.tls.scheduler.cert",
                "distributed.comm.tls.worker.cert",
            ),
            "Certificate (PEM) of this client, and of the scheduler and workers of a cluster dask-dl starts.",
        ),
        ("--tls-ca", ("distributed.comm.tls.ca-file",), "Certificate authority (PEM) of a TLS cluster."),
    ]
    for name, keys, text in tls:
        f = click.option(
            name,
            type=click.Path(exists=True, dir_okay=False),
            default=None,
            expose_value=False,
            is_eager=True,
            callback=_set_config(keys),
            help=text,
        )(f)
    return click.option(
        "--cluster",
        type=click.Choice(KINDS.names()),
        default=None,
        expose_value=False,
        is_eager=True,
        callback=_set_config("dask-dl.cluster.kind"),
        help="Kind of cluster to start when no --scheduler is given: "
        + "; ".join(f"{k}: {v}" for k, v in KINDS.help().items())
        + " (default: dask-dl.cluster.kind, local).",
    )(f)


class PathOrURL(click.Path):
    """An existing local path (``click.Path``), or an fsspec URL (``s3://...``) that exists, looked up with fsspec.

    The URL is looked up with this process's fsspec settings (``FSSPEC_S3_ENDPOINT_URL``, ...), as the command
    will read it.
    """

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from dask_dl.cluster.storage import exists, is_url

        if not (isinstance(value, str) and is_url(value)):
            return super().convert(value, param, ctx)
        try:
            found = exists(value)
        except Exception as exc:  # credentials, endpoint, no such protocol: fsspec's own words
            self.fail(f"cannot look up {value!r}: {type(exc).__name__}: {exc}", param, ctx)
        if not found:
            self.fail(f"{value!r} does not exist.", param, ctx)
        return value


class ModelName(click.Choice):
    """A registry model (the choices, completed by the shell), or ``torchvision:NAME``, ``timm:NAME`` or the
    import path ``module:function`` of the user's own (checked by ``fit``, which says what is wrong)."""

    def get_metavar(self, param, *args, **kwargs):
        return "[" + "|".join(self.choices) + "|torchvision:NAME|timm:NAME|MODULE:FUNCTION]"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and ":" in value:
            return value
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            self.fail(
                f"{value!r} is no model: name one of {', '.join(self.choices)}, or give torchvision:NAME, timm:NAME "
                "or the import path module:function of a function returning your network",
                param,
                ctx,
            )


def model_option(*names: str):
    """``--model``: the registry's names and help lines, plus the other forms ``fit(model=...)`` takes by name."""
    return registry_option(
        *names,
        registry=MODELS,
        what="Model",
        type=ModelName(MODELS.names()),
        more=" Or torchvision:NAME, timm:NAME, or module:function: a function of yours returning the network (it"
        " gets num_outputs and in_channels when it takes them), importable from the current folder or PYTHONPATH.",
    )


quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bar: log lines only (batch jobs).")


def registry_option(
    *names: str,
    registry: Registry,
    what: str,
    default: str | None = None,
    type: click.Choice | None = None,
    more: str = "",
):
    """An option whose choices and help are the names and help lines of ``registry`` (not a copied list).

    ``type`` replaces the plain choice of those names (a choice that also takes other forms, said in ``more``).
    """
    lines = "; ".join(f"{name}: {text}" if text else name for name, text in registry.help().items())
    default_text = f" Default: {default}." if default is not None else " Default from config."
    return click.option(
        *names,
        type=type or click.Choice(registry.names()),
        default=default,
        help=f"{what} ({lines}).{more}{default_text}",
    )

"""The ``dask-dl`` command (also ``dask dl`` through Dask's ``dask_cli`` entry point).

Every sub-command is a thin layer over the Python API: it parses options, connects to a cluster (a local one by
default, ``--scheduler ADDRESS`` for a running one) and calls the function of the same name. Heavy imports stay
inside the commands so that ``dask-dl --help`` is fast. Errors that dask_dl raises on purpose are printed as one
readable message, without a traceback.
"""

from __future__ import annotations

import importlib.util
import sys

import click

from dask_dl.errors import DaskDLError


class _Group(click.Group):
    """A click group that turns :class:`DaskDLError` into a one-line message and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DaskDLError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="dask-dl", prog_name="dask-dl")
def cli() -> None:
    """Dask-native deep learning on big image collections: ingest, train, export, predict."""


def scheduler_option(f):
    """``--scheduler``/``--workers`` options shared by every command that runs on a cluster."""
    f = click.option(
        "--workers",
        "-w",
        type=int,
        default=None,
        help="Workers of the local cluster started when no --scheduler is given (default from config).",
    )(f)
    return click.option(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="Address of a running Dask scheduler (tcp://host:8786, tls://...). Default: start a local cluster.",
    )(f)


quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bar: log lines only (batch jobs).")


# ---- commands ---------------------------------------------------------------------------------------------
# Each room adds its commands in its own section below, above the end marker.


@cli.command()
def info() -> None:
    """Show the dask_dl version, the settings in force and which optional extras are installed."""
    import dask.config
    import yaml

    from dask_dl import __version__

    click.echo(f"dask-dl {__version__}")
    for extra, module in [
        ("gpu", "dask_cuda"),
        ("gateway", "dask_gateway"),
        ("hpc", "dask_jobqueue"),
        ("dicom", "pydicom"),
    ]:
        found = importlib.util.find_spec(module) is not None
        click.echo(f"  extra {extra:8s} {'installed' if found else 'not installed'} ({module})")
    click.echo(yaml.safe_dump({"dask-dl": dask.config.get("dask-dl")}, sort_keys=False).rstrip())


# ---- end of commands --------------------------------------------------------------------------------------

main = cli
# ``dask dl ...``: Dask's CLI loads click commands from the ``dask_cli`` entry point.
dask_cli = _Group(name="dl", commands=cli.commands, help=cli.help)

if __name__ == "__main__":  # pragma: no cover
    cli()

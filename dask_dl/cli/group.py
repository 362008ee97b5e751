"""The root ``dask-dl`` group: the one place where expected errors and Ctrl-C become messages and exit statuses."""

from __future__ import annotations

import logging
import os
import sys

import click

from dask_dl.errors import DaskDLError
from dask_dl.interrupt import Interrupted


class Group(click.Group):
    """A click group that turns :class:`DaskDLError` into a one-line message and exit status 1.

    Ctrl-C ends a command with status 130, as shells report it, and with the message of an
    :class:`~dask_dl.interrupt.Interrupted` (what was kept, how to go on) instead of click's "Aborted!". Any
    other exception is a bug and keeps its traceback; ``--debug`` shows the traceback of every error.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            click.echo(str(exc) if isinstance(exc, Interrupted) else "stopped by Ctrl-C", err=True)
            sys.exit(130)
        except DaskDLError as exc:
            if ctx.params.get("debug"):
                raise
            message = " ".join(str(exc).split("\n")) or type(exc).__name__
            click.secho(f"error: {message}", fg="red", err=True)
            sys.exit(1)
        finally:
            logging.getLogger("asyncio").addFilter(_unclosed_at_exit)


def _unclosed_at_exit(record: logging.LogRecord) -> bool:
    """Once a command has finished: drop aiohttp's reports of sessions it finds unclosed at interpreter exit.

    zarr reads object stores (``s3://``) through asynchronous fsspec filesystems that nobody closes, and s3fs's own
    finalizer fails to close its synchronous ones (fsspec/s3fs#943); their aiohttp sessions report themselves as
    they are collected at exit, about connections the ending process closes anyway.
    """
    return not str(record.msg).startswith(("Unclosed client session", "Unclosed connector"))


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="dask-dl", prog_name="dask-dl")
@click.option("--debug", is_flag=True, default=False, help="Show the full traceback of every error, expected or not.")
def cli(debug: bool) -> None:
    """Dask-native deep learning on big image collections: ingest, train, export, predict."""
    here = os.getcwd()
    if not {"", here} & set(sys.path):
        # your models (--model module:function, and checkpoints of them) import from the current folder, as with
        # `python -m`; appended, so that nothing installed is shadowed; a local cluster's workers get this path
        sys.path.append(here)

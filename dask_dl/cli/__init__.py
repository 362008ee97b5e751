"""The ``dask-dl`` command (also ``dask dl`` through Dask's ``dask_cli`` entry point).

Every sub-command is a thin layer over the Python API: it parses options, connects to a cluster (a local one by
default, ``--scheduler ADDRESS`` for a running one) and calls the function of the same name. Heavy imports stay
inside the commands so that ``dask-dl --help`` is fast. Errors that dask_dl raises on purpose are printed as one
readable message, without a traceback.

One module per command group, each adding its commands to the root group :data:`cli` (``group.py``):
``data`` (catalog, synth, ingest, summary, check), ``train`` (train, demo), ``models`` (export, predict, explain,
report), ``sites`` (xsite) and ``info``. A command of another module joins with ``cli.add_command(command)``.
"""

from __future__ import annotations

from dask_dl.cli import data, info, models, sites, train  # noqa: F401  (each adds its commands to cli)
from dask_dl.cli.group import Group, cli
from dask_dl.sweeps.command import sweep_command

cli.add_command(sweep_command)

__all__ = ["cli", "dask_cli", "main"]

main = cli
# ``dask dl ...``: Dask's CLI loads click commands from the ``dask_cli`` entry point. It shares cli's dict of
# commands, so a command added to cli later is also a command of ``dask dl``.
dask_cli = Group(name="dl", commands=cli.commands, help=cli.help)

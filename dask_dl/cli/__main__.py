"""``python -m dask_dl.cli``: the ``dask-dl`` command."""

from dask_dl.cli import cli

cli()

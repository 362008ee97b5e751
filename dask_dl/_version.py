"""The version of dask_dl, in a module of its own so that no module needs the package ``__init__`` for it."""

__version__ = "0.1.0"

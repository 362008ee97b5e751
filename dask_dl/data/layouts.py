"""The registry of catalog layouts: each reader registers itself at the bottom of its module.

:func:`dask_dl.data.catalog.read_catalog` dispatches through :data:`LAYOUTS`, and the CLI's ``--layout`` choices
come from it. Importing :mod:`dask_dl.data.catalog` imports every built-in reader, which fills the registry.
"""

from __future__ import annotations

from dask_dl.registry import Registry

__all__ = ["LAYOUTS"]

#: Catalog layouts: name -> reader ``reader(source, **options) -> catalog``.
LAYOUTS = Registry("layout", argument="layout")

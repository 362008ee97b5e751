"""Scheduler preload that makes the dask_dl page part of the dashboard from the scheduler's start.

Start a long-lived scheduler with it::

    dask scheduler --preload dask_dl.dashboard.preload

(or list it under ``distributed.scheduler.preload`` in dask.config). Importing this module adds ``/dask-dl``,
``/dask-dl-sweeps`` and their ``/individual-...`` forms to distributed's table of dashboard applications
(``distributed.dashboard.scheduler.applications``) before the scheduler builds its dashboard, so distributed's
own Bokeh server serves them, the dashboard's "More..." menu lists the pages, and ``/individual-plots.json``
lists ``individual-dask-dl`` and ``individual-dask-dl-sweeps``, which is where JupyterLab's Dask panel finds
pages. :func:`dask_setup` then adds the :class:`~dask_dl.dashboard.plugin.DashboardPlugin`, which keeps the runs
and sweeps and serves ``/dask-dl/runs.json`` and ``/dask-dl/sweeps.json``.

Without the preload, :func:`dask_dl.fit` still adds the page to a running scheduler, but JupyterLab's panel
does not list it: distributed builds that list from its own Bokeh server only.
"""

from __future__ import annotations

import logging
from typing import Any

from dask_dl.dashboard.plugin import DashboardPlugin
from dask_dl.dashboard.plugin import applications as dask_dl_applications

logger = logging.getLogger("dask_dl.dashboard")


def register_applications() -> None:
    """Add the page to the applications every scheduler started from now on in this process serves."""
    try:
        from distributed.dashboard.scheduler import applications
    except ImportError as exc:  # no bokeh: the scheduler serves no dashboard, /dask-dl/runs.json still works
        logger.info("dask_dl dashboard page not added: the Dask dashboard is unavailable (%s)", exc)
        return

    for path, doc in dask_dl_applications().items():
        applications.setdefault(path, doc)


def dask_setup(scheduler: Any) -> None:
    """Preload hook: add the dask_dl plugin to ``scheduler`` before it starts its plugins."""
    scheduler.add_plugin(DashboardPlugin(), name=DashboardPlugin.name, idempotent=True)


register_applications()  # at import: the scheduler imports its preloads before it builds its dashboard

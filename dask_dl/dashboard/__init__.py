"""The dask_dl page on the Dask dashboard: running and finished training runs, their curves side by side.

Runs report through the scheduler's event log with :func:`publish` (topic ``dask-dl-runs``), so the page works
for any client connected to the scheduler and keeps finished runs for as long as the scheduler keeps its events.
:func:`install` (called by :func:`dask_dl.fit`) serves the page on a running scheduler at ``/dask-dl``, in the
dashboard's "More..." menu; a scheduler started with ``--preload dask_dl.dashboard.preload`` serves it from the
start and lists it for JupyterLab's Dask panel too. ``/dask-dl/runs.json`` serves the same data as JSON.

Modules: :mod:`~dask_dl.dashboard.events` (publishing and checking runs, no Bokeh),
:mod:`~dask_dl.dashboard.page` (the Bokeh document), :mod:`~dask_dl.dashboard.plugin` (the routes),
:mod:`~dask_dl.dashboard.preload` (the scheduler preload).
"""

from __future__ import annotations

from dask_dl.dashboard.events import TOPIC, RunStore, check_run, publish, runs_from_events
from dask_dl.dashboard.plugin import DashboardPlugin, install, runs_json

__all__ = [
    "TOPIC",
    "DashboardPlugin",
    "RunStore",
    "check_run",
    "install",
    "publish",
    "runs_from_events",
    "runs_json",
]

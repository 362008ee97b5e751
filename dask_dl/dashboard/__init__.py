"""The dask_dl page on the Dask dashboard: running and finished training runs, their curves side by side.

Runs report through the scheduler's event log with :func:`publish` (topic ``dask-dl-runs``), so the page works
for any client connected to the scheduler and keeps finished runs for as long as the scheduler keeps its events.
:func:`install` (called by :func:`dask_dl.fit`) serves the page on a running scheduler at ``/dask-dl``, in the
dashboard's "More..." menu; a scheduler started with ``--preload dask_dl.dashboard.preload`` serves it from the
start and lists it for JupyterLab's Dask panel too. ``/dask-dl/runs.json`` serves the same data as JSON.
Sweeps (:func:`dask_dl.sweep`) publish on topic ``dask-dl-sweeps`` with :func:`publish_sweep`, and
``/dask-dl-sweeps`` (and ``/dask-dl/sweeps.json``) show their trials.

Modules: :mod:`~dask_dl.dashboard.events` (publishing and checking runs, no Bokeh),
:mod:`~dask_dl.dashboard.page` and :mod:`~dask_dl.dashboard.sweep_page` (the Bokeh documents),
:mod:`~dask_dl.dashboard.plugin` (the routes),
:mod:`~dask_dl.dashboard.preload` (the scheduler preload).
"""

from __future__ import annotations

from dask_dl.dashboard.events import (
    SWEEP_TOPIC,
    TOPIC,
    RunStore,
    check_run,
    check_sweep,
    publish,
    publish_sweep,
    runs_from_events,
)
from dask_dl.dashboard.plugin import DashboardPlugin, install, runs_json

__all__ = [
    "SWEEP_TOPIC",
    "TOPIC",
    "DashboardPlugin",
    "RunStore",
    "check_run",
    "check_sweep",
    "install",
    "publish",
    "publish_sweep",
    "runs_from_events",
    "runs_json",
]

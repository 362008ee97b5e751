"""Serving the dask_dl page on a running scheduler's dashboard.

:func:`install` (which :func:`dask_dl.fit` calls) registers :class:`DashboardPlugin` on the scheduler. The plugin
folds every run event into a :class:`~dask_dl.dashboard.events.RunStore` as it arrives and, on start, adds to the
scheduler's HTTP server:

- ``/dask-dl``: the page, a Bokeh document served like the dashboard's own pages and listed in the dashboard's
  "More..." menu for pages opened from then on (when the scheduler was started with the preload
  :mod:`dask_dl.dashboard.preload`, distributed's own Bokeh server serves it);
- ``/dask-dl/runs.json``: every run's latest state as JSON, ``{run_id: {"status", "history", ..., "problems"}}``
  (``problems`` only for a malformed run);
- ``/dask-dl-sweeps``: the sweeps page (every sweep's trials, their states and curves), in the same menu, and
  ``/dask-dl/sweeps.json``, every sweep's latest state as JSON;
- ``/dask-dl/`` redirects to ``/dask-dl``, so the page's relative links to the dashboard work;
- ``/individual-dask-dl``, the page alone, and ``/individual-plots.json`` listing it beside distributed's own
  pages: that list is where JupyterLab's Dask panel (dask-labextension) finds the panels it offers, and
  distributed builds it from its own Bokeh server only (which serves the page when the scheduler was preloaded).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from dask_dl.dashboard.events import (
    PLUGIN_NAME,
    SWEEP_TOPIC,
    TOPIC,
    RunStore,
    check_run,
    check_sweep,
    jsonable,
    scheduler_runs,
    scheduler_sweeps,
)

logger = logging.getLogger("dask_dl.dashboard")

PAGE = "dask-dl"
INDIVIDUAL_PAGE = "individual-dask-dl"
MENU_NAME = "dask_dl Training Runs"
SWEEPS_PAGE = "dask-dl-sweeps"
INDIVIDUAL_SWEEPS_PAGE = "individual-dask-dl-sweeps"
SWEEPS_MENU_NAME = "dask_dl Sweeps"


def applications() -> dict[str, Any]:
    """The Bokeh documents of the dask_dl pages, by path: the runs and the sweeps, each full and alone."""
    from dask_dl.dashboard.page import dashboard_doc, individual_doc
    from dask_dl.dashboard.sweep_page import individual_sweeps_doc, sweeps_doc

    return {
        f"/{PAGE}": dashboard_doc,
        f"/{INDIVIDUAL_PAGE}": individual_doc,
        f"/{SWEEPS_PAGE}": sweeps_doc,
        f"/{INDIVIDUAL_SWEEPS_PAGE}": individual_sweeps_doc,
    }


class DashboardPlugin(SchedulerPlugin):
    """Scheduler plugin that keeps the runs' latest states and serves the dask_dl page on the dashboard server."""

    name = PLUGIN_NAME
    idempotent = True  # registering again (every fit) keeps the plugin already there

    def __init__(self) -> None:
        self.store: RunStore | None = None
        self.sweeps: RunStore | None = None

    async def start(self, scheduler: Any) -> None:
        """Fold the run and sweep events logged so far, and add the pages' routes to ``scheduler``'s HTTP server."""
        self.store = RunStore()
        self.sweeps = RunStore(key="sweep_id")
        for topic, store in ((TOPIC, self.store), (SWEEP_TOPIC, self.sweeps)):
            for _, msg in scheduler.get_events(topic):
                store.fold(msg)
        if getattr(scheduler, "http_application", None) is not None:
            serve(scheduler)

    def log_event(self, topic: str, msg: Any) -> None:
        """Fold each run or sweep event as it arrives (the event log forgets old ones; the stores keep them)."""
        store = {TOPIC: self.store, SWEEP_TOPIC: self.sweeps}.get(topic)
        if store is not None:
            store.fold(msg)


def install(client: Any) -> str | None:
    """Serve the dask_dl page on ``client``'s scheduler and return its address.

    Registering again is harmless: the plugin already there is kept.

    Parameters
    ----------
    client
        A :class:`distributed.Client`.

    Returns
    -------
    str or None
        The page's URL next to the dashboard's ``/status``, or None when the scheduler serves no Bokeh dashboard
        (started with ``dashboard=False`` or without bokeh).
    """
    client.register_plugin(DashboardPlugin(), name=DashboardPlugin.name)
    link = client.dashboard_link
    if not link or not client.run_on_scheduler(page_served):
        return None  # no Bokeh dashboard on that scheduler: runs.json only, on its HTTP server if it has one
    return link.replace("/status", f"/{PAGE}")


def page_served(dask_scheduler: Any) -> bool:
    """Whether ``dask_scheduler``'s dashboard serves the page (run on the scheduler by :func:`install`)."""
    http = getattr(dask_scheduler, "http_application", None)
    return http is not None and any(f"/{PAGE}" in app.app_paths for app in _bokeh_servers(http))


def serve(scheduler: Any) -> None:
    """Add the page, its JSON and its menu entry to ``scheduler``'s HTTP server (in the scheduler's loop)."""
    from distributed.http.utils import RequestHandler
    from tornado import web

    http = scheduler.http_application
    bokeh = _bokeh_server(http)
    prefix = bokeh.prefix if bokeh is not None else "/"
    prefix = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"

    class Runs(RequestHandler):
        def get(self) -> None:
            self.set_header("Content-Type", "application/json")
            self.write(json.dumps(runs_json(scheduler_runs(scheduler)[1])))

    class Sweeps(RequestHandler):
        def get(self) -> None:
            self.set_header("Content-Type", "application/json")
            self.write(json.dumps(runs_json(scheduler_sweeps(scheduler)[1], check=check_sweep)))

    class ToPage(web.RequestHandler):
        def get(self) -> None:
            self.redirect(f"../{PAGE}")  # relative: right behind any proxy that moves the dashboard

    http.add_handlers(
        ".*$",
        [
            (rf"{prefix}{PAGE}/runs\.json", Runs, {"dask_server": scheduler}),
            (rf"{prefix}{PAGE}/sweeps\.json", Sweeps, {"dask_server": scheduler}),
            (rf"{prefix}{PAGE}/", ToPage),
        ],
    )
    if bokeh is None:
        logger.info("dask_dl dashboard: the scheduler serves no Bokeh dashboard; only /%s/runs.json is served", PAGE)
        return
    if not any(f"/{PAGE}" in app.app_paths for app in _bokeh_servers(http)):
        # not preloaded, not served yet: a Bokeh server of our own, made as distributed makes its own
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
        from tornado.ioloop import IOLoop

        variables = template_variables(scheduler)
        ours = BokehApplication(applications(), scheduler, prefix=prefix, template_variables=variables)
        http.add_application(ours)
        ours.initialize(IOLoop.current())
        ours.start()
        _add_to_panels(scheduler, prefix)
    _add_to_menu(scheduler)


def _add_to_panels(scheduler: Any, prefix: str) -> None:
    """List the pages alone in ``/individual-plots.json``, the panels JupyterLab's Dask extension offers.

    Routes added to the scheduler's HTTP server come before distributed's own, so this answer replaces
    distributed's: its list (its own Bokeh server's pages and static plots) with ours added, named as it names
    each page.
    """
    from distributed.http.scheduler.info import IndividualPlots

    class Panels(IndividualPlots):
        def write(self, chunk: Any) -> None:
            if isinstance(chunk, dict):
                ours = (INDIVIDUAL_PAGE, INDIVIDUAL_SWEEPS_PAGE)
                chunk = {**chunk, **{page.replace("-", " ").title(): f"/{page}" for page in ours}}
            super().write(chunk)

    route = (rf"{prefix}individual-plots\.json", Panels, {"dask_server": scheduler})
    scheduler.http_application.add_handlers(".*$", [route])


def runs_json(runs: dict[str, dict[str, Any]], *, check: Any = check_run) -> dict[str, dict[str, Any]]:
    """Return the runs' states as ``/dask-dl/runs.json`` serves them (the sweeps' as ``/dask-dl/sweeps.json``).

    Parameters
    ----------
    runs
        ``{run_id: state}`` as :class:`~dask_dl.dashboard.events.RunStore` keeps them.
    check
        What finds a state's problems: :func:`~dask_dl.dashboard.events.check_run`, or ``check_sweep`` for sweeps.

    Returns
    -------
    dict
        The same, JSON-able (NaN as None, tuples as lists), with ``"problems"`` (:func:`check_run`'s lines) added
        to each malformed run.
    """
    out = {}
    for run_id, run in runs.items():
        out[run_id] = jsonable(run)
        problems = check(run)
        if problems:
            out[run_id]["problems"] = problems
    return out


def _bokeh_servers(http: Any) -> list[Any]:
    """The Bokeh servers on the scheduler's HTTP server, distributed's first; none without bokeh or dashboard."""
    try:
        from bokeh.server.tornado import BokehTornado
    except ImportError:
        return []
    return [app for app in http.applications if isinstance(app, BokehTornado)]


def _bokeh_server(http: Any) -> Any:
    """The dashboard's Bokeh server (distributed's), or None when bokeh is missing or the dashboard is off."""
    return next(iter(_bokeh_servers(http)), None)


def _add_to_menu(scheduler: Any) -> None:
    """Add the pages to the dashboard's "More..." menu.

    Every dashboard page renders its menu from the list ``template_variables(scheduler)["plots"]``, one list per
    scheduler that distributed builds once; pages opened after this call show the entry.
    """
    from distributed.dashboard.scheduler import template_variables

    plots = template_variables(scheduler)["plots"]
    for url, name in ((PAGE, MENU_NAME), (SWEEPS_PAGE, SWEEPS_MENU_NAME)):
        if not any(plot.get("url") == url for plot in plots):
            plots.append({"url": url, "name": name})
    plots.sort(key=lambda plot: plot["name"])

"""A dask_dl page on the Dask dashboard: running and finished training runs with their curves.

:func:`install` registers :class:`DashboardPlugin` on the scheduler; the plugin adds two routes to the
scheduler's HTTP server, next to the task stream:

``/dask-dl/``            an HTML page listing the runs (status, epoch, loss, AUROC, images/s, bytes sent) with
                         loss and AUROC curves, refreshing itself every two seconds;
``/dask-dl/runs.json``   the same data as JSON: ``{run_id: {"status", "model", "compression", "trainers",
                         "history": [row, ...], ...}}``.

Runs report through the scheduler's event log (topic ``dask-dl-runs``) with :func:`publish`, so the page works
for any client connected to the scheduler and keeps finished runs for as long as the scheduler keeps its events.
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

TOPIC = "dask-dl-runs"


def publish(client, run_id: str, info: dict[str, Any]) -> None:
    """Send the current state of run ``run_id`` to the scheduler's event log (``info`` must be JSON-able)."""
    client.log_event(TOPIC, {"run_id": run_id, **_jsonable(info)})


def runs_from_events(events) -> dict[str, dict[str, Any]]:
    """Fold the scheduler's ``dask-dl-runs`` events into the latest state of each run, in start order."""
    runs: dict[str, dict[str, Any]] = {}
    for _, msg in events:
        if isinstance(msg, dict) and "run_id" in msg:
            runs.setdefault(msg["run_id"], {}).update(msg)
    return runs


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _polyline(values: list[float | None], width: int, height: int, lo: float, hi: float) -> str:
    points = []
    n = max(len(values) - 1, 1)
    for i, v in enumerate(values):
        if v is None:
            continue
        x = 4 + (width - 8) * i / n
        y = height - 4 - (height - 8) * ((v - lo) / (hi - lo) if hi > lo else 0.5)
        points.append(f"{x:.1f},{y:.1f}")
    return " ".join(points)


def _chart(history: list[dict], key: str, title: str, *, fixed: tuple[float, float] | None = None) -> str:
    values = [row.get(key) for row in history]
    present = [v for v in values if v is not None]
    if not present:
        return ""
    lo, hi = fixed or (min(present), max(present))
    w, h = 220, 90
    line = _polyline(values, w, h, lo, hi)
    return (
        f"<figure><figcaption>{html.escape(title)} ({present[-1]:.4g})</figcaption>"
        f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img">'
        f'<rect width="{w}" height="{h}" fill="#fafafa" stroke="#ddd"/>'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{line}"/></svg></figure>'
    )


def render_page(runs: dict[str, dict[str, Any]]) -> str:
    """Return the HTML of the dask_dl dashboard page for ``runs`` (see :func:`runs_from_events`)."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>dask_dl runs</title>",
        "<meta http-equiv='refresh' content='2'>",
        "<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}figure{display:inline-block;margin:4px}"
        "figcaption{font-size:80%}section{border-top:1px solid #eee;margin-top:1em}</style></head><body>",
        "<h1>dask_dl training runs</h1>",
    ]
    if not runs:
        parts.append("<p>No runs yet: start one with <code>dask_dl.fit(...)</code>.</p>")
    for run_id, run in reversed(list(runs.items())):
        history = run.get("history") or []
        last = history[-1] if history else {}
        parts.append(f"<section><h2>{html.escape(run_id)} &mdash; {html.escape(str(run.get('status', '?')))}</h2>")
        facts = {k: run.get(k) for k in ("model", "compression", "trainers", "epochs", "step") if k in run}
        parts.append("<p>" + ", ".join(f"{k}: {html.escape(str(v))}" for k, v in facts.items()) + "</p>")
        if last:
            keys = [
                k
                for k in (
                    "epoch",
                    "train_loss",
                    "val_loss",
                    "val_auroc_mean",
                    "images_per_s",
                    "data_wait_s",
                    "bytes_sent",
                    "cost",
                )
                if k in last
            ]
            parts.append("<table><tr>" + "".join(f"<th>{k}</th>" for k in keys) + "</tr><tr>")
            parts.append("".join(f"<td>{_fmt(last[k])}</td>" for k in keys) + "</tr></table>")
        parts.append(_chart(history, "train_loss", "train loss"))
        parts.append(_chart(history, "val_loss", "validation loss"))
        parts.append(_chart(history, "val_auroc_mean", "validation AUROC (mean)", fixed=(0.0, 1.0)))
        parts.append(_chart(history, "images_per_s", "images/s"))
        parts.append("</section>")
    parts.append("</body></html>")
    return "".join(parts)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


class DashboardPlugin(SchedulerPlugin):
    """Scheduler plugin that serves the dask_dl page on the scheduler's dashboard server."""

    name = "dask-dl-dashboard"
    idempotent = True  # registering again (every fit) keeps the plugin already there

    async def start(self, scheduler) -> None:
        from distributed.http.utils import RequestHandler

        def runs() -> dict[str, dict[str, Any]]:
            return runs_from_events(scheduler.get_events(TOPIC))

        class Page(RequestHandler):
            def get(self):
                self.set_header("Content-Type", "text/html; charset=utf-8")
                self.write(render_page(runs()))

        class Runs(RequestHandler):
            def get(self):
                self.set_header("Content-Type", "application/json")
                self.write(json.dumps(runs()))

        app = getattr(scheduler, "http_application", None)
        if app is not None:  # no dashboard server (dashboard=False): nothing to serve
            app.add_handlers(
                ".*$",
                [
                    (r"/dask-dl/?", Page, {"dask_server": scheduler}),
                    (r"/dask-dl/runs\.json", Runs, {"dask_server": scheduler}),
                ],
            )


def install(client) -> str | None:
    """Register the dask_dl page on ``client``'s scheduler (idempotent) and return its URL, if it has one."""
    client.register_plugin(DashboardPlugin(), name=DashboardPlugin.name)
    link = client.dashboard_link
    return link.replace("/status", "/dask-dl/") if link else None

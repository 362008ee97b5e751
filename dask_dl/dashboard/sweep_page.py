"""The Bokeh document of the sweeps page: one panel per sweep, with its trials' table and curves.

A sweep (:func:`dask_dl.sweep`) publishes its state on the scheduler's event log as its trials report
(:func:`~dask_dl.dashboard.events.publish_sweep`); this page reads the sweeps the scheduler keeps once a second
(:func:`~dask_dl.dashboard.events.scheduler_sweeps`) and redraws what changed. Each panel shows the sweep's status,
its trials counted by state, the best trial and its parameters, a table of every trial, and the metric per epoch of
every trial in one figure: pruned trials dashed and ended with an x, failed ones dotted, the best one thick, each
curve labelled with its trial's number. A malformed sweep shows its problems in a red box; the others are drawn as
usual. Each trial is also a training run on the runs page (``/dask-dl``), under the run id the table names.
"""

from __future__ import annotations

import html
import logging
from typing import Any

from bokeh.layouts import column
from bokeh.models import ColumnDataSource, Div, HoverTool
from bokeh.plotting import figure

from dask_dl.dashboard.events import check_sweep, scheduler_sweeps
from dask_dl.dashboard.page import _FIGURE, _STYLE, _error_box, _fmt, _Malformed, _num, fill_document

logger = logging.getLogger("dask_dl.dashboard")

TITLE = "dask_dl sweeps"
#: trial state -> (colour, dash) of its curve, as the notebook's ``Sweep.plot()`` draws it
STATE_STYLES = {
    "complete": ("#1f77b4", "solid"),
    "running": ("#2ca02c", "solid"),
    "pruned": ("#7f7f7f", "dashed"),
    "failed": ("#d62728", "dotted"),
    "stopped": ("#ff7f0e", "dotted"),
}
_SWEEP_COLORS = {"running": "#1f77b4", "done": "#2ca02c", "stopped": "#ff7f0e", "failed": "#d62728"}


def sweeps_doc(scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
    """Fill ``doc`` with the full sweeps page, inside the Dask dashboard's template (its menu on top)."""
    fill_document(doc, SweepsPage(lambda: scheduler_sweeps(scheduler)), TITLE, extra)


def individual_sweeps_doc(scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
    """Fill ``doc`` with the sweeps page alone, for JupyterLab's Dask panel (which adds no menu)."""
    fill_document(doc, SweepsPage(lambda: scheduler_sweeps(scheduler)), TITLE)


class SweepsPage:
    """The page's models, redrawn by :meth:`update` from ``source``, which returns ``(version, {sweep_id: sweep})``."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self._seen: Any = None
        self.panels: dict[str, SweepPanel] = {}
        self.empty = Div(text="<p>No sweeps yet: start one with <code>dask_dl.sweep(...)</code>.</p>")
        self.grid = column()
        header = Div(text=f"{_STYLE}<h2 style='margin:4px 0'>{TITLE}</h2>")
        self.root = column(header, self.empty, self.grid)

    def update(self) -> None:
        """Redraw what changed since the last call (nothing when the version is the same)."""
        version, sweeps = self._source()
        if version == self._seen:
            return
        self._seen = version
        sweeps = dict(sweeps)  # the scheduler's store goes on changing; this call draws one moment of it
        new = [sweep_id for sweep_id in sweeps if sweep_id not in self.panels]
        gone = [sweep_id for sweep_id in self.panels if sweep_id not in sweeps]
        for sweep_id in new:
            self.panels[sweep_id] = SweepPanel(sweep_id)
        for sweep_id in gone:
            del self.panels[sweep_id]
        for sweep_id, sweep in sweeps.items():
            self.panels[sweep_id].update(sweep, check_sweep(sweep))
        self.empty.visible = not sweeps
        if new or gone:  # newest first
            self.grid.children = [self.panels[sweep_id].root for sweep_id in reversed(sweeps)]


class SweepPanel:
    """One sweep: its facts, the table of its trials and the metric per epoch of every trial."""

    def __init__(self, sweep_id: str) -> None:
        self.sweep_id = sweep_id
        self._last: Any = None
        self.facts = Div(text=_heading(sweep_id, "?"))
        self.error = Div(visible=False)
        self.table = Div()
        self.curves = ColumnDataSource(
            {"xs": [], "ys": [], "trial": [], "state": [], "color": [], "dash": [], "width": []}
        )
        self.ends = ColumnDataSource({"x": [], "y": [], "text": [], "marker": [], "color": []})
        self.figure: Any = None  # made when the sweep is first drawn (a malformed sweep needs none)
        self.root = column(self.facts, self.error, self.table, styles={"margin": "0 24px 24px 0"})

    def _make_figure(self, metric: str) -> None:
        fig = figure(
            title=f"{metric} per trial",
            width=660,
            height=300,
            x_axis_label="epochs trained",
            y_axis_label=metric,
            **_FIGURE,
        )
        lines = fig.multi_line(
            "xs", "ys", source=self.curves, line_color="color", line_dash="dash", line_width="width", alpha=0.9
        )
        fig.scatter("x", "y", source=self.ends, marker="marker", color="color", size=9, line_width=2)
        labels = fig.text("x", "y", text="text", source=self.ends, x_offset=6, text_font_size="11px")
        labels.glyph.text_baseline = "middle"
        fig.add_tools(HoverTool(renderers=[lines], tooltips=[("trial", "@trial"), ("state", "@state")]))
        fig.xaxis.ticker.min_interval = 1  # whole epochs
        self.figure = fig
        self.root.children.append(fig)

    def update(self, sweep: dict[str, Any], problems: list[str]) -> None:
        """Draw ``sweep`` (its folded state); with ``problems``, an error box instead of the table and curves."""
        if sweep == self._last:
            return
        self._last = dict(sweep)  # a copy: the scheduler's store updates the sweep in place
        try:
            if problems:
                raise _Malformed(problems)
            if self.figure is None:
                self._make_figure(sweep["metric"])
            self._draw(sweep)
            self.error.visible = False
            self.table.visible = self.figure.visible = True
        except Exception as exc:  # a sweep's problem stays in its panel: the page and the other sweeps go on
            if not isinstance(exc, _Malformed):
                logger.warning("dask_dl dashboard: cannot draw sweep %s", self.sweep_id, exc_info=True)
                problems = [f"{type(exc).__name__}: {exc}"]
            status = sweep.get("status") if isinstance(sweep, dict) and isinstance(sweep.get("status"), str) else "?"
            self.facts.text = _heading(self.sweep_id, status)
            self.error.text = _error_box(self.sweep_id, problems).replace("other runs", "other sweeps")
            self.error.visible = True
            self.table.visible = False
            if self.figure is not None:
                self.figure.visible = False

    def _draw(self, sweep: dict[str, Any]) -> None:
        trials = sorted(sweep["trials"], key=lambda trial: trial["number"])
        best = sweep.get("best_trial")
        self.facts.text = _heading(self.sweep_id, sweep["status"]) + _facts(sweep, trials)
        self.table.text = _trials_table(trials, best)
        drawn = [trial for trial in trials if trial.get("curve")]
        styles = [STATE_STYLES.get(trial["state"], ("#555", "solid")) for trial in drawn]
        self.curves.data = {
            "xs": [list(range(1, len(trial["curve"]) + 1)) for trial in drawn],
            "ys": [[_num(value) for value in trial["curve"]] for trial in drawn],
            "trial": [str(trial["number"]) for trial in drawn],
            "state": [trial["state"] for trial in drawn],
            "color": [color for color, _ in styles],
            "dash": [dash for _, dash in styles],
            "width": [4.0 if trial["number"] == best else 1.5 for trial in drawn],
        }
        self.ends.data = {
            "x": [len(trial["curve"]) for trial in drawn],
            "y": [_num(trial["curve"][-1]) for trial in drawn],
            "text": [f"#{trial['number']}" for trial in drawn],
            "marker": ["x" if trial["state"] == "pruned" else "circle" for trial in drawn],
            "color": [color for color, _ in styles],
        }


# ---- the text parts ------------------------------------------------------------------------------------------


def _heading(sweep_id: str, status: str) -> str:
    color = _SWEEP_COLORS.get(status, "#555")
    return (
        f"<h3 style='margin:4px 0'>{html.escape(sweep_id)} "
        f"<span style='color:{color};font-weight:normal'>{html.escape(status)}</span></h3>"
    )


def _facts(sweep: dict[str, Any], trials: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial["state"]] = counts.get(trial["state"], 0) + 1
    best = next((trial for trial in trials if trial["number"] == sweep.get("best_trial")), None)
    cells = {
        "metric": html.escape(f"{sweep['metric']} ({sweep.get('direction', 'maximize')})"),
        "trials": html.escape(", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none yet"),
        "best trial": "n/a" if best is None else f"#{best['number']}",
        "best": "n/a" if best is None else _fmt(best.get("best"), ".4g"),
        "its params": "n/a" if best is None else _params(best.get("params")),
    }
    return (
        "<table class='ddl-facts'><tr>"
        + "".join(f"<th>{k}</th>" for k in cells)
        + "</tr><tr>"
        + "".join(f"<td>{v}</td>" for v in cells.values())
        + "</tr></table>"
    )


def _trials_table(trials: list[dict[str, Any]], best: Any) -> str:
    head = ("trial", "state", "params", "best", "epochs", "seconds", "run", "error")
    lines = ["<table class='ddl-facts'><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for trial in trials:
        color = STATE_STYLES.get(trial["state"], ("#555", ""))[0]
        cells = [
            f"#{trial['number']}",
            f"<span style='color:{color}'>{html.escape(trial['state'])}</span>",
            _params(trial.get("params")),
            _fmt(trial.get("best"), ".4g"),
            _fmt(trial.get("epochs")),
            _fmt(trial.get("seconds"), ".1f"),
            html.escape(str(trial.get("run_id") or "")),
            html.escape(str(trial.get("error") or "")[:200]),
        ]
        style = " style='font-weight:bold'" if trial["number"] == best else ""
        lines.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "".join(lines) + "</table>"


def _params(params: Any) -> str:
    if not isinstance(params, dict):
        return html.escape("" if params is None else str(params))
    shown = (f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
    return html.escape(", ".join(shown))

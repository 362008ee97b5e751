"""One self-contained HTML page of a model on a split: the per-label table, ROC/PR and calibration, top losses.

Every figure is a PNG inlined as a ``data:`` URL, so the page is a single file to mail or attach to a ticket.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dask_dl.checks import positive_int
from dask_dl.errors import StoreError

if TYPE_CHECKING:  # pragma: no cover
    import xarray as xr
    from distributed import Client
    from matplotlib.figure import Figure

    from dask_dl.interpretation.interpretation import Interpretation

__all__ = ["report", "write_report"]

_STYLE = """body{font-family:sans-serif;margin:24px;max-width:1100px}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}img{max-width:100%;margin:8px 0}.figures{display:flex;flex-wrap:wrap;gap:12px}
.figures img{width:48%}"""


def report(
    ds: xr.Dataset | str | os.PathLike,
    model: Any,
    out: str | os.PathLike,
    *,
    split: str | None = "test",
    top: int = 8,
    explain: bool = True,
    overwrite: bool = False,
    client: Client | None = None,
) -> Path:
    """Score ``ds`` with ``model`` (:func:`~dask_dl.interpret`) and write the HTML report to ``out``.

    Parameters
    ----------
    ds
        A dataset from :func:`~dask_dl.open_dataset`, or the store's path.
    model
        A :class:`~dask_dl.TrainingRun`, a checkpoint (dict, file or directory) or an ``.onnx`` file.
    out
        The ``.html`` file to write.
    split
        The split to report on (None: every image).
    top
        How many of the worst images to show.
    explain
        Lay explanation maps over the worst images (needs the ``explain`` extra: Captum).
    overwrite
        Replace ``out`` if it exists.
    client
        The cluster that scores; default the current client.

    Returns
    -------
    pathlib.Path
        The page written.

    Raises
    ------
    StoreError
        ``out`` exists and ``overwrite`` is False.

    Examples
    --------
    >>> dask_dl.report("cxr.zarr", "cxr.onnx", "report.html")  # doctest: +SKIP
    """
    from dask_dl.interpretation.interpretation import interpret

    out = Path(out)
    if out.exists() and not overwrite:
        raise StoreError(f"{str(out)!r} exists already; pass overwrite=True (dask-dl report --overwrite) to replace it")
    interpretation = interpret(ds, model, split=split, client=client)
    source = ds.encoding.get("source", "") if hasattr(ds, "encoding") else os.fspath(ds)
    title = f"{Path(str(source)).name or 'dataset'} · {split or 'all splits'} · {Path(interpretation.onnx_path).name}"
    return write_report(interpretation, out, top=top, explain=explain, title=title)


def write_report(
    interpretation: Interpretation, out: str | os.PathLike, *, top: int = 8, explain: bool = True, title: str = ""
) -> Path:
    """Write the HTML report of an :class:`~dask_dl.Interpretation` to ``out``; return its path."""
    top = positive_int("top", top)
    table = interpretation.per_label()
    worst = interpretation.top_losses(top)
    labels = ", ".join(interpretation.labels)
    figures = [
        ("ROC per label", interpretation.plot_roc()),
        ("precision-recall per label", interpretation.plot_pr()),
        ("calibration", interpretation.plot_calibration()),
    ]
    parts = [
        f"<h1>dask_dl report</h1><p>{html.escape(title)}</p>",
        f"<p>{len(interpretation.scores)} images, labels: {html.escape(labels)}; written "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC</p>",
        "<h2>Per label</h2>",
        table.to_html(float_format=lambda v: f"{v:.3f}", na_rep="-"),
        "<h2>Curves</h2><div class='figures'>",
        *(_img(fig, alt) for alt, fig in figures),
        "</div>",
        f"<h2>The {len(worst)} images with the highest loss</h2>",
        _img(interpretation.plot_top_losses(top, explain=explain), "top losses"),
        worst.drop(columns=["position"]).to_html(index=False, float_format=lambda v: f"{v:.3f}"),
    ]
    page = f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>dask_dl report</title><style>{_STYLE}</style>"
    page += "</head><body>" + "\n".join(parts) + "</body></html>"
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)  # a reader never sees half a page
    return out


def _img(fig: Figure, alt: str) -> str:
    """The figure as an inlined PNG ``<img>``; the figure is closed (a report draws many)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{data}'>"

"""What :func:`dask_dl.fit`, :func:`dask_dl.fit_sites` and :func:`dask_dl.export_onnx` log to MLflow.

A fit's run holds every option as a param (flattened from the run's options object, whatever its shape), the
store's shape, the model's source when it is the user's code, one metric step per finished epoch (every number of
the history row: losses, AUROC per label, images/s, data wait, bytes sent, ...), and at the end ``history.csv``.
A cross-site run is a parent run (its plan, and per round each site's scores as ``<site>.<column>``) with one
nested run per site and round (that visit's fit). An export of a tracked run uploads the ONNX file, and with
``register=`` makes it a version in the model registry. All of it runs on the client.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from collections.abc import Mapping
from typing import Any

from dask_dl.tracking.tracker import Tracker

__all__ = ["end_run", "log_row", "start_fit", "start_sites", "track_export"]

logger = logging.getLogger("dask_dl.tracking")


def _params(options: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten a dataclass or mapping of options into ``{"dotted.name": value}`` (nested groups joined by dots).

    Sequences of samples count as their length; functions, classes and modules as their import path.
    """
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        items = [(f.name, getattr(options, f.name)) for f in dataclasses.fields(options)]
    elif isinstance(options, Mapping):
        items = list(options.items())
    else:
        return {prefix.rstrip("."): _plain(options)}
    out: dict[str, Any] = {}
    for name, value in items:
        key = f"{prefix}{name}"
        if (dataclasses.is_dataclass(value) and not isinstance(value, type)) or (isinstance(value, Mapping) and value):
            out.update(_params(value, f"{key}."))
        else:
            out[key] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if hasattr(value, "ndim") and hasattr(value, "__len__") and getattr(value, "ndim", 0) >= 1:
        return len(value)  # a sample list
    if isinstance(value, Mapping):
        return dict(value)
    if callable(value) and not isinstance(value, str | bytes):
        target = value if inspect.isroutine(value) or inspect.isclass(value) else type(value)
        return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"
    return value


def _store_params(dataset: Any) -> dict[str, Any]:
    meta = dataset.attrs.get("dask_dl", {})
    out: dict[str, Any] = {
        "store.images": int(dataset.sizes["sample"]),
        "store.size": meta.get("size"),
        "store.channels": meta.get("channels") or 1,
        "store.labels": list(meta.get("labels") or []),
    }
    if "split" in dataset.coords:
        import numpy as np

        names, counts = np.unique(np.asarray(dataset["split"].values).astype(str), return_counts=True)
        out |= {f"store.split.{n}": int(c) for n, c in zip(names, counts, strict=True)}
    return out


def _model_text(source: Any) -> str | None:
    """The Python source of the user's model (class or factory), or its repr; None for a published one by name."""
    if source is None or source.kind in ("torchvision", "timm"):
        return None
    target = source.target
    if source.kind == "module":
        code = _source_of(type(target))
        return f"{code}\n# the module as passed to fit:\n" + "\n".join(f"# {line}" for line in repr(target).split("\n"))
    return _source_of(target) if callable(target) else None


def _source_of(target: Any) -> str:
    try:
        return inspect.getsource(target)
    except (OSError, TypeError):  # defined at a prompt: no file to read it from
        return f"# no source file for {getattr(target, '__qualname__', target)!r}"


def start_fit(tracker: Tracker, run: Any, dataset: Any) -> None:
    """Log what a :class:`~dask_dl.TrainingRun` is: tags, params, the model's source, the epochs it resumed."""
    options = run.options
    tracker.set_tags({"dask_dl.kind": "fit", "dask_dl.run_id": run.run_id, "dask_dl.model": options.model})
    tracker.log_params({**_params(options), **_store_params(dataset), "trainer_workers": list(run.workers)})
    text = _model_text(getattr(options, "model_source", None))
    if text is not None:
        tracker.log_text(text, "model/source.py")
    for row in run.history.to_dict("records"):  # the epochs of the run this one resumed
        log_row(tracker, row)


def log_row(tracker: Tracker, row: Mapping[str, Any]) -> None:
    """One finished epoch's history row as metrics at step ``epoch`` (a stopped epoch's partial row is not one)."""
    if row.get("event") == "stopped" or "epoch" not in row:
        return
    tracker.log_epoch({k: v for k, v in row.items() if k != "epoch"}, step=int(row["epoch"]))


def end_run(tracker: Tracker, history: Any, status: str) -> None:
    """Upload ``history.csv`` and end the run with ``status``."""
    if len(history):
        tracker.log_table(history, "history.csv")
    tracker.finish(status)


def start_sites(tracker: Tracker, run: Any) -> None:
    """Log a :class:`~dask_dl.sites.run.SitesRun`'s plan, training options, model and sites."""
    co = run._co
    tracker.set_tags({"dask_dl.kind": "fit_sites", "dask_dl.run_id": run.run_id, "dask_dl.model": co.model.name})
    sites = {s.name: {"store": s.store, "train": s.n_train, "val": len(s.val_samples)} for s in co.sites}
    tracker.log_params(
        {**_params(run.plan), **_params(co.fit_options), "trainers": co.trainers, **_params({"sites": sites})}
    )


def log_sites_round(tracker: Tracker, rows: list[dict[str, Any]]) -> None:
    """A round's rows of a cross-site run (one per site, and ``test``) as ``<site>.<column>`` metrics."""
    values: dict[str, Any] = {}
    for row in rows:
        values |= {f"{row['site']}.{k}": v for k, v in row.items() if k not in ("round", "site", "split")}
    if rows:
        tracker.log_epoch(values, step=int(rows[0]["round"]))


def track_export(source: Any, path: str | os.PathLike, info: Any, register: str | None) -> Any:
    """Upload an exported ONNX file to the run of ``source`` when it was tracked; register it when asked.

    Returns the registry's ModelVersion, or None.
    """
    tracker = getattr(source, "tracker", None)
    if tracker is None:
        return None
    extra = {"input_size": info.input_size, "in_channels": info.in_channels, "task": info.task}
    if info.model_name:
        extra["model"] = str(info.model_name)
    if register is not None:
        return tracker.register_onnx(
            path, register, labels=list(info.labels), normalization=dict(info.normalization), extra=extra
        )
    tracker.log_artifact(path, "onnx")
    tracker.flush()  # the file may be a temporary one (an export to object storage): uploaded before it goes
    return None

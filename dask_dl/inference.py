"""Scoring image collections with an ONNX model over Dask chunks, and evaluating the scores.

:func:`predict` maps onnxruntime over the chunks of a Dask array: each worker process opens the model once (a
module-level cache keyed by file, modification time, size, providers and threads) and reuses that session for
every chunk it scores. Sessions run one intra-op thread each, because Dask already runs one task per worker
thread: more would oversubscribe the cores (``dask-dl.predict.threads`` changes it, e.g. for one-thread workers
on big machines).

Scoring runs on the CPU workers of a cluster that also has GPU workers (they stay with the trainers), or on the GPU
workers when asked (``on="gpu"``): there the sessions use onnxruntime's CUDA provider when the worker's onnxruntime
has it (``onnxruntime-gpu``), on the worker's own GPU (device 0 of its ``CUDA_VISIBLE_DEVICES``), and the CPU
provider otherwise.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dask
import dask.array as da
import numpy as np
import pandas as pd

from dask_dl import config
from dask_dl.checks import one_of, positive_int
from dask_dl.data.store import COORDS
from dask_dl.errors import ConfigurationError, DatasetError, ExportError, StoreNotFoundError
from dask_dl.metrics import auroc
from dask_dl.normalize import scale
from dask_dl.onnx_info import ModelInfo, read_model_info

if TYPE_CHECKING:  # pragma: no cover
    import dask.dataframe as dd
    import onnxruntime as ort
    import xarray as xr
    from distributed import Client

__all__ = ["evaluate", "predict", "scores_table", "write_scores_zarr"]

PROB_PREFIX = "p_"

logger = logging.getLogger(__name__)

# ---- one session per worker process ------------------------------------------------------------------------

_SESSIONS: dict[tuple, ort.InferenceSession] = {}
_SESSIONS_LOCK = threading.Lock()
#: sessions this process has created; tests read it on each worker with ``client.run``
SESSIONS_CREATED = 0


def _default_providers() -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    # onnxruntime-gpu lists CUDA when built with it; on a machine without a GPU it falls back to the CPU provider
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


_CUDA_LIBRARIES_LOADED = False


def _load_cuda_libraries(ort: Any) -> None:
    """Let onnxruntime-gpu find CUDA and cuDNN in the pip packages torch brought (``nvidia-*``), once per process.

    onnxruntime-gpu (>= 1.21) finds them itself only after ``import torch`` or :func:`onnxruntime.preload_dlls`; a
    worker that scores without having trained has imported neither.
    """
    global _CUDA_LIBRARIES_LOADED
    if _CUDA_LIBRARIES_LOADED or not hasattr(ort, "preload_dlls"):
        return
    _CUDA_LIBRARIES_LOADED = True
    try:
        ort.preload_dlls()
    except Exception as exc:  # the session then looks on the library path, and falls back to the CPU if need be
        logger.info("onnxruntime.preload_dlls() failed (%s): CUDA libraries come from the library path", exc)


def _stamp(path: str) -> tuple[int, int]:
    from dask_dl.cluster.storage import file_stamp  # local files and fsspec URLs (s3://...)

    return file_stamp(path)


def get_session(path: str, stamp: tuple[int, int], providers: Sequence[str] | None, threads: int):
    """Return this process's onnxruntime session of ``path``, creating it on first use.

    ``stamp`` (modification time, size) is what the driver saw: a worker that sees another file (changed,
    or a different file under the same path on another machine) refuses rather than score with other weights.
    """
    global SESSIONS_CREATED
    import onnxruntime as ort

    try:
        seen = _stamp(path)
    except FileNotFoundError:
        raise StoreNotFoundError(
            f"the model {path!r} is not visible on this worker; put it on storage every worker can read"
        ) from None
    if seen != tuple(stamp):
        raise ExportError(f"the model {path!r} changed after predict() was called; call predict() again")
    chosen = tuple(providers) if providers else tuple(_default_providers())
    key = (path, tuple(stamp), chosen, threads)
    from dask_dl.cluster.storage import fetch  # onnxruntime reads local files: a model on s3:// is fetched once

    with _SESSIONS_LOCK:
        session = _SESSIONS.get(key)
        if session is None:
            if "CUDAExecutionProvider" in chosen:
                _load_cuda_libraries(ort)
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            try:
                session = ort.InferenceSession(fetch(path), sess_options=options, providers=list(chosen))
            except Exception:
                if providers or chosen == ("CPUExecutionProvider",):
                    raise
                # onnxruntime-gpu on a worker whose GPU is absent or unusable: the CPU still scores
                session = ort.InferenceSession(fetch(path), sess_options=options, providers=["CPUExecutionProvider"])
            # sessions of an older version of the file would only hold memory
            for old in [k for k in _SESSIONS if k[0] == path and k[1] != key[1]]:
                del _SESSIONS[old]
            _SESSIONS[key] = session
            SESSIONS_CREATED += 1
        return session


def _score_block(
    block: np.ndarray,
    *,
    path: str,
    stamp: tuple[int, int],
    providers: tuple[str, ...] | None,
    threads: int,
    batch_size: int,
    info: dict[str, Any],
) -> np.ndarray:
    session = get_session(path, stamp, providers, threads)
    n = block.shape[0]
    shape = (n, info["in_channels"], info["input_size"], info["input_size"])
    images = np.asarray(block).reshape(shape if info["input_rank"] == 4 else shape[:1] + shape[2:])
    out = np.empty((n, len(info["labels"])), np.float32)
    norm = None if info["normalization_in_graph"] else info["normalization"]
    for start in range(0, n, batch_size):
        batch = images[start : start + batch_size].astype(np.float32)
        if norm is not None:
            batch = scale(batch, norm["mean"], norm["std"])
        batch = batch.astype(info["input_dtype"], copy=False)
        result = session.run([info["output_name"]], {info["input_name"]: batch})[0]
        if result.shape != (len(batch), out.shape[1]):
            raise ExportError(
                f"the model returned shape {result.shape} for {len(batch)} images; with labels {info['labels']} "
                f"it should be {(len(batch), out.shape[1])}"
            )
        out[start : start + batch_size] = result
    return out


# ---- predict -----------------------------------------------------------------------------------------------


def _images(data: Any) -> tuple[da.Array, bool]:
    """The ``(n, S, S)`` or ``(n, C, S, S)`` image array of ``data`` as a Dask array (and whether it was lazy)."""
    import xarray as xr

    if isinstance(data, xr.Dataset):
        if "image" not in data:
            raise DatasetError(f"the dataset has no 'image' variable (it has {list(data.data_vars)}); use open_dataset")
        data = data["image"]
    if isinstance(data, xr.DataArray):
        data = data.data
    if isinstance(data, da.Array):
        return data, True
    array = np.asarray(data)
    return da.from_array(array, chunks=(256,) + array.shape[1:]), False


def _check_shape(images: da.Array, info: ModelInfo) -> da.Array:
    if images.dtype.kind not in "uif":
        raise DatasetError(f"images must be uint8 or float pixels 0-255; got dtype {images.dtype}")
    want = info.image_shape
    if images.ndim == 4 and images.shape[-1] in (1, 3, 4) and images.shape[1] == images.shape[2] != images.shape[3]:
        images = images.transpose(0, 3, 1, 2)  # channel-last, as a colour store holds images: the model takes NCHW
    got = tuple(images.shape[1:])
    channels = 1 if images.ndim == 3 else got[0]
    if images.ndim in (3, 4) and channels != info.in_channels:
        raise ExportError(
            f"the model takes {info.in_channels}-channel images of shape {want} (channels, y, x), but the data has "
            f"{channels}-channel images (shape {got}); score a store ingested with channels={info.in_channels}, "
            f"or use a model trained on {channels}-channel images"
        )
    fits = got == want or (info.in_channels == 1 and got == want[1:])
    if images.ndim not in (3, 4) or not fits:
        raise ExportError(
            f"the model takes images of shape {want} (channels, y, x) but the data has images of shape {got}; "
            f"ingest the collection at size={info.input_size} or use a model exported for "
            f"{got[-1] if got else '?'} px images"
        )
    # a block must hold whole images
    return images.rechunk({i: -1 for i in range(1, images.ndim)})


def predict(
    data: Any,
    model_path: str | os.PathLike,
    *,
    batch_size: int | None = None,
    providers: Sequence[str] | None = None,
    client: Client | None = None,
    input_size: int | None = None,
    labels: Sequence[str] | None = None,
    normalization: dict[str, float] | None = None,
    on: str | None = None,
) -> da.Array:
    """Score images with an ONNX model, chunk by chunk on a Dask cluster.

    Parameters
    ----------
    data
        An :func:`~dask_dl.open_dataset` dataset (its ``image``), or a Dask/NumPy array of pixels 0-255, uint8
        or float, shape ``(n, S, S)`` or ``(n, 1, S, S)`` for a grey model, ``(n, S, S, C)`` (a colour store's
        layout) or ``(n, C, S, S)`` for a model of ``C`` channels. NumPy arrays are cut into chunks of 256 images.
    model_path
        An ONNX file from :func:`~dask_dl.export_onnx`, on storage every worker can read.
    batch_size
        Images per onnxruntime call inside a chunk; default ``dask-dl.predict.batch-size``.
    providers
        onnxruntime execution providers; default CUDA when the worker's onnxruntime has it, else CPU.
    client
        When given, the scores are computed on its cluster at once (``client.persist``, on the workers ``on``
        names) and the returned array holds the futures; without it (and without ``on``) the array is lazy,
        computed by whichever scheduler computes it.
    input_size, labels, normalization
        Describe an ONNX model without dask_dl metadata (see :func:`dask_dl.onnx_info.read_model_info`).
    on : {"cpu", "gpu", "any"}, optional
        Which workers score (:func:`dask_dl.cluster.workers_for`): ``"cpu"``, the CPU workers when the cluster also
        has GPU workers (default ``dask-dl.predict.workers``); ``"gpu"``, the workers with a ``GPU`` resource, where
        onnxruntime uses its CUDA provider when it has one; ``"any"``, every worker. Passing ``on`` without
        ``client`` computes on the current client's cluster (``distributed.default_client()``).

    Returns
    -------
    dask.array.Array
        float32 ``(n, n_labels)`` probabilities, chunked like ``data`` along its first axis.

    Raises
    ------
    ExportError
        Not an ONNX file, a model without metadata and no ``input_size``/``labels``, external data outside the
        model's folder or missing, or images of another shape or another number of channels than the model takes
        (the message shows both).
    StoreNotFoundError
        No file at ``model_path``.
    ConfigurationError
        ``batch_size`` is not a positive integer; ``on`` is not one of ``"cpu"``, ``"gpu"``, ``"any"``, or is
        given with no client and no current client.
    ClusterError
        ``on="gpu"`` on a cluster without GPU workers.

    Examples
    --------
    On a store and a model of yours (not run as a doctest: they need the files and a cluster):

    >>> ds = dask_dl.open_dataset("cxr.zarr", split="test")  # doctest: +SKIP
    >>> probs = dask_dl.predict(ds, "cxr.onnx")  # doctest: +SKIP
    >>> probs.to_zarr("scores.zarr")  # doctest: +SKIP
    >>> probs = dask_dl.predict(ds, "cxr.onnx", client=client, on="gpu")  # on the GPU workers  # doctest: +SKIP
    """
    from dask_dl.cluster.storage import is_url
    from dask_dl.cluster.workers import WORKER_KINDS

    if on is not None:
        one_of("on", on, WORKER_KINDS)
        client = client if client is not None else _current_client(on)
    path = os.fspath(model_path) if is_url(model_path) else str(Path(model_path).resolve())
    info = read_model_info(path, input_size=input_size, labels=labels, normalization=normalization)
    batch_size = positive_int("batch_size", config.get("predict.batch-size", batch_size))
    images, _ = _images(data)
    images = _check_shape(images, info)
    spec = {
        "labels": list(info.labels),
        "input_size": info.input_size,
        "in_channels": info.in_channels,
        "input_rank": info.input_rank,
        "input_name": info.input_name,
        "output_name": info.output_name,
        "input_dtype": info.input_dtype,
        "normalization": info.normalization,
        "normalization_in_graph": info.normalization_in_graph,
    }
    probs = da.map_blocks(
        _score_block,
        images,
        path=path,
        stamp=_stamp(path),
        providers=tuple(providers) if providers else None,
        threads=int(config.get("predict.threads")),
        batch_size=int(batch_size),
        info=spec,
        drop_axis=list(range(2, images.ndim)),
        chunks=(images.chunks[0], (len(info.labels),)),
        dtype=np.float32,
        meta=np.empty((0, 0), np.float32),
        token="predict",
    )
    if client is not None:
        from dask_dl.cluster.storage import check_visible
        from dask_dl.cluster.workers import workers_for

        # by default GPU workers stay with the trainers
        workers = workers_for(client, config.get("predict.workers", on), purpose="scoring")
        check_visible(client, path, workers=workers)  # before any work: which worker cannot read the model
        probs = client.persist(probs, workers=workers)
    return probs


def _current_client(on: str) -> Client:
    from distributed import default_client

    try:
        return default_client()
    except ValueError:
        raise ConfigurationError(
            f"predict(..., on={on!r}) picks workers of a cluster, and there is no client: pass client=..., or make "
            "one first (distributed.Client(...), dask_dl.cluster.make(...))"
        ) from None


# ---- tables ------------------------------------------------------------------------------------------------


def scores_table(
    ds: xr.Dataset, probs: Any, *, labels: Sequence[str] | None = None, backend: str | None = None
) -> pd.DataFrame | dd.DataFrame:
    """Join predictions to the dataset's coordinates and true labels.

    Parameters
    ----------
    ds
        The dataset that was scored (from :func:`~dask_dl.open_dataset`).
    probs
        ``(n, k)`` scores of its images, e.g. from :func:`predict` (computed here when lazy).
    labels
        Names of the ``k`` score columns; default the dataset's labels (``finding``).
    backend : {"pandas", "cudf"}, optional
        Return a Dask DataFrame with partitions of this kind (:func:`dask_dl.data.frames.to_dask_dataframe`):
        ``"cudf"`` puts the table on the GPU (the ``gpu`` extra; where a GPU is visible). Default: a
        ``pandas.DataFrame``.

    Returns
    -------
    pandas.DataFrame or dask.dataframe.DataFrame
        One row per image: ``sample`` (row in the store), ``image_id``, ``patient_id``, ``split``, ``site``, a
        float32 column ``p_<label>`` per label, and the true labels (uint8 columns named like the labels) when the
        dataset has them. ``table.attrs["labels"]`` lists the scored labels.

    Raises
    ------
    DatasetError
        ``probs`` of another shape than the dataset's images and labels.
    MissingDependencyError
        ``backend="cudf"`` without cudf: ``pip install 'dask-dl[gpu]'``.
    """
    if backend is not None:
        from dask_dl.data.frames import check_backend, to_dask_dataframe

        check_backend(backend)  # before the scores are computed
        return to_dask_dataframe(scores_table(ds, probs, labels=labels), backend=backend)
    if labels is None and "finding" not in ds.coords:
        raise DatasetError("the dataset has no 'finding' coordinate naming the labels; pass labels=[...]")
    labels = [str(v) for v in (labels if labels is not None else ds["finding"].values)]
    if getattr(probs, "ndim", None) != 2 or probs.shape != (ds.sizes["sample"], len(labels)):
        raise DatasetError(
            f"probs has shape {getattr(probs, 'shape', None)}; for this dataset of {ds.sizes['sample']} images and "
            f"{len(labels)} labels it must be {(ds.sizes['sample'], len(labels))}: pass labels= naming its columns"
        )
    truth = ds["label"].data if "label" in ds and "finding" in ds.coords else None
    probs, truth = dask.compute(probs, truth)
    table = pd.DataFrame({"sample": np.asarray(ds["sample"].values, dtype=np.int64)})
    for name in COORDS:
        if name in ds.coords:
            table[name] = np.asarray(ds[name].values).astype(str)
    probs = np.asarray(probs, dtype=np.float32)
    for j, label in enumerate(labels):
        table[PROB_PREFIX + label] = probs[:, j]
    if truth is not None and "finding" in ds.coords:
        findings = [str(v) for v in ds["finding"].values]
        for label in labels:
            if label in findings:
                table[label] = np.asarray(truth[:, findings.index(label)], dtype=np.uint8)
    table.attrs = {"labels": labels}
    return table


def write_scores_zarr(table: pd.DataFrame, labels: Sequence[str], out: str, *, overwrite: bool = False) -> None:
    """Write a :func:`scores_table` as a Zarr store: ``probability(sample, label)``, the id columns as coordinates.

    Parameters
    ----------
    table
        From :func:`scores_table`: a ``p_<label>`` column per label and the columns of
        :data:`dask_dl.data.store.COORDS`.
    labels
        The labels to write, in this order.
    out
        Path or fsspec URL of the store.
    overwrite
        Replace ``out`` if it exists; otherwise an existing ``out`` is an error (zarr's).
    """
    import xarray as xr

    probs = table[[PROB_PREFIX + label for label in labels]].to_numpy()
    # object arrays of str become Zarr 3 variable-length strings (numpy's fixed-width '<U' has no Zarr 3 spec)
    coords = {"sample": table["sample"].to_numpy(), "label": np.array(list(labels), dtype=object)}
    coords |= {c: ("sample", table[c].to_numpy(dtype=object)) for c in COORDS}
    ds = xr.Dataset({"probability": (("sample", "label"), probs)}, coords=coords)
    ds.to_zarr(out, mode="w" if overwrite else "w-", consolidated=False, zarr_format=3)


def evaluate(table: pd.DataFrame, *, labels: Sequence[str] | None = None) -> pd.Series:
    """Per-label AUROC of a :func:`scores_table` (also one read back from Parquet).

    Parameters
    ----------
    table
        With ``p_<label>`` score columns and ``<label>`` truth columns.
    labels
        Labels to evaluate; default every label with both columns.

    Returns
    -------
    pandas.Series
        AUROC per label (index: label, name ``auroc``), NaN where a label has one class only.
    """
    if labels is None:
        labels = [c[len(PROB_PREFIX) :] for c in table.columns if c.startswith(PROB_PREFIX)]
        labels = [label for label in labels if label in table.columns]
    missing = [c for label in labels for c in (PROB_PREFIX + label, label) if c not in table.columns]
    if not labels or missing:
        raise DatasetError(
            f"the table lacks score or truth columns {missing or ['p_<label>', '<label>']}; evaluate needs a "
            "scores_table of a dataset with labels"
        )
    truth = table[list(labels)].to_numpy()
    scores = table[[PROB_PREFIX + label for label in labels]].to_numpy()
    return pd.Series(auroc(truth, scores), index=pd.Index(list(labels), name="label"), name="auroc")

"""Explanation maps over Dask chunks: Grad-CAM and occlusion from Captum, one cached model per worker.

:func:`explain` maps Captum's ``LayerGradCam`` (upsampled to the image) or ``Occlusion`` over the image chunks of a
dataset: each task explains one chunk, in batches, with its worker's cached model (see
:mod:`dask_dl.explanation.sources`), and returns ``(images, findings, y, x)`` maps. Each map is scaled to [0, 1] by
its own maximum after negative evidence is cut (Grad-CAM's ReLU; occlusion's score rises), which is what
thresholding a heatmap into a box (:func:`~dask_dl.localization`) needs, and is kept as float16 or as uint8
(``255 * map``), so a task's memory is bounded by its chunk.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import dask
import dask.array as da
import numpy as np

from dask_dl import config
from dask_dl.checks import one_of, positive_int
from dask_dl.errors import ConfigurationError, DatasetError, missing_dependency
from dask_dl.explanation.sources import ModelSpec, get_model, resolve

if TYPE_CHECKING:  # pragma: no cover
    import xarray as xr
    from distributed import Client

__all__ = ["METHODS", "explain", "write_maps"]

METHODS = ("gradcam", "occlusion")
DTYPES = ("float16", "uint8")
_COORDS = ("image_id", "patient_id", "split", "site")


def explain(
    data: Any,
    model: Any,
    *,
    labels: Sequence[str] | None = None,
    method: str = "gradcam",
    layer: Any = None,
    dtype: str = "float16",
    batch_size: int | None = None,
    window: int | None = None,
    stride: int | None = None,
    device: str | None = None,
    input_size: int | None = None,
    client: Client | None = None,
) -> xr.DataArray:
    """Explanation maps of a model's findings, computed chunk by chunk on the cluster, lazily.

    Parameters
    ----------
    data
        A dataset from :func:`~dask_dl.open_dataset` (any selection), or its ``image`` array, or a Dask/NumPy
        array of pixels 0-255 ``(n, S, S)``.
    model
        A :class:`~dask_dl.TrainingRun`, a checkpoint (dict, ``epoch-NNNN.pt`` file or checkpoint directory), a
        ``torch.nn.Module`` returning logits (with ``labels=``), or an ``.onnx`` file from
        :func:`~dask_dl.export_onnx` (occlusion only: Grad-CAM needs the torch model's gradients).
    labels
        Findings to explain, a subset of the model's; default all of them. For a ``torch.nn.Module``, the names
        of all its outputs, in order.
    method
        ``"gradcam"`` (Captum ``LayerGradCam`` at ``layer``, bilinearly upsampled to the image) or
        ``"occlusion"`` (Captum ``Occlusion``: how much each finding's probability drops when a ``window``
        square is replaced by the image's mean gray).
    layer
        Grad-CAM's layer: a module name as ``model.named_modules()`` spells it, or the module. Default, for the
        registry's models and any other CNN: the last activation map of at least 7 x 7 cells after the first
        convolution (the last stage at 224 px; the stage before the last for ``small_cnn`` at 64 px, whose last
        stage has 4 x 4 cells).
    dtype
        ``"float16"`` (maps in [0, 1]) or ``"uint8"`` (``255 * map``, half the memory).
    batch_size
        Images per Captum call inside a chunk; default ``dask-dl.predict.batch-size``.
    window, stride
        Occlusion's square and step in pixels; default ``S // 8`` and half the window.
    device
        Torch device on the workers; default CUDA where the worker has a GPU, else the CPU.
    input_size
        Image side of a ``torch.nn.Module`` or of an ONNX model without dask_dl metadata.
    client
        When given, the maps are computed on its cluster at once (``client.persist``); without it they stay lazy.

    Returns
    -------
    xarray.DataArray
        ``explanation(sample, finding, y, x)``, chunked like the images along ``sample`` (one chunk over the
        other axes), with the dataset's ``image_id``, ``patient_id``, ``split`` and ``site`` coordinates and
        ``attrs`` naming the method, layer and model.

    Raises
    ------
    ConfigurationError
        An unknown method, dtype or layer; Grad-CAM asked of an ONNX file; labels the model does not have.
    MissingDependencyError
        Captum is not installed (``pip install 'dask-dl[explain]'``).
    DatasetError
        Images of another size than the model takes.

    Examples
    --------
    With a trained run and its test split (not run as a doctest: it needs both and a cluster):

    >>> maps = dask_dl.explain(test, run, labels=["Effusion"], method="gradcam")  # doctest: +SKIP
    >>> dask_dl.explanation.maps.write_maps(maps, "maps.zarr")  # doctest: +SKIP
    """
    import xarray as xr

    from dask_dl.inference import _images

    one_of("method", method, METHODS)
    one_of("dtype", dtype, DTYPES)
    try:
        _captum()  # the workers import it; say here, once, when it is missing
    except ImportError as exc:
        raise missing_dependency("captum", "explain", "dask_dl.explain") from exc
    batch_size = positive_int("batch_size", config.get("predict.batch-size", batch_size))
    if method == "gradcam" and isinstance(model, str | os.PathLike) and os.fspath(model).lower().endswith(".onnx"):
        raise ConfigurationError(
            f"Grad-CAM needs the torch model's gradients, which the ONNX file {os.fspath(model)!r} does not have: "
            "pass the TrainingRun or its checkpoint (file or directory), or use method='occlusion' with the ONNX file"
        )
    spec, payload = resolve(model, labels=labels, input_size=input_size, layer=layer, gradcam=method == "gradcam")
    chosen = _chosen_labels(spec, labels)
    images, _ = _images(data)
    images = _whole_images(images, spec)
    side = int(images.shape[-1])
    options = _occlusion_options(side, window, stride) if method == "occlusion" else {}
    k = len(chosen)
    maps = da.map_blocks(
        _explain_block,
        images,
        dask.delayed(payload, pure=True) if payload is not None else None,
        spec=spec,
        method=method,
        targets=tuple(spec.labels.index(label) for label in chosen),
        dtype_name=dtype,
        batch_size=batch_size,
        device=device,
        options=options,
        new_axis=[1] if images.ndim == 3 else None,  # colour (n, C, S, S): the channel axis becomes `finding`
        chunks=(images.chunks[0], (k,), (side,), (side,)),
        dtype=np.dtype(dtype),
        meta=np.empty((0, 0, 0, 0), np.dtype(dtype)),
        token=f"explain-{method}",
    )
    if client is not None:
        from dask_dl.cluster import check_importable

        check_importable(client, {m: "the model to explain" for m in spec.modules})  # the workers unpickle it
        maps = client.persist(maps)
    return xr.DataArray(
        maps,
        dims=("sample", "finding", "y", "x"),
        coords={"finding": list(chosen), **_sample_coords(data, images.shape[0])},
        name="explanation",
        attrs={
            "method": method,
            "layer": spec.layer if method == "gradcam" else "",
            "model": spec.name,
            "scale": "each map divided by its maximum" + (", times 255" if dtype == "uint8" else ""),
            **({f"occlusion_{k}": v for k, v in options.items()}),
        },
    )


def _chosen_labels(spec: ModelSpec, labels: Sequence[str] | None) -> list[str]:
    if labels is None:
        return list(spec.labels)
    labels = [labels] if isinstance(labels, str) else [str(label) for label in labels]
    unknown = [label for label in labels if label not in spec.labels]
    if unknown or not labels:
        raise ConfigurationError(
            f"the model does not predict {unknown or labels}; its labels are {list(spec.labels)}: pass some of them "
            "as labels=[...]"
        )
    return labels


def _whole_images(images: da.Array, spec: ModelSpec) -> da.Array:
    """Grey ``(n, S, S)``, or colour as ``(n, C, S, S)`` (a colour store's ``(n, S, S, C)`` is turned around)."""
    channels = int(spec.in_channels or 1)
    if images.ndim == 4 and images.shape[1] == 1:
        images = images[:, 0]
    elif images.ndim == 4 and images.shape[-1] == channels and images.shape[1] != channels:
        images = images.transpose(0, 3, 1, 2)  # channel-last, as a colour store holds it
    got = 1 if images.ndim == 3 else images.shape[1]
    if images.ndim not in (3, 4) or images.shape[-1] != images.shape[-2] or images.dtype.kind not in "uif":
        raise DatasetError(
            f"explain takes square images (n, S, S) grey or (n, S, S, C) colour of pixels 0-255; got shape "
            f"{images.shape}, dtype {images.dtype}"
        )
    if got != channels:
        raise DatasetError(
            f"the model takes images of {channels} channel(s) but the data has {got}; explain it on a store "
            f"ingested with channels={channels}"
        )
    if spec.input_size is not None and images.shape[-1] != spec.input_size:
        raise DatasetError(
            f"the model takes {spec.input_size} px images but the data has {images.shape[-1]} px images; ingest the "
            f"collection at size={spec.input_size} or explain a model trained at {images.shape[-1]} px"
        )
    return images.rechunk({i: -1 for i in range(1, images.ndim)})


def _occlusion_options(side: int, window: int | None, stride: int | None) -> dict[str, int]:
    window = positive_int("window", window if window is not None else max(2, side // 8))
    stride = positive_int("stride", stride if stride is not None else max(1, window // 2))
    if window > side:
        raise ConfigurationError(f"window={window} is larger than the {side} px images; pass e.g. window={side // 8}")
    return {"window": window, "stride": stride}


def _sample_coords(data: Any, n: int) -> dict[str, Any]:
    import xarray as xr

    source = data if isinstance(data, xr.Dataset | xr.DataArray) else None
    if source is None or "sample" not in source.dims:
        return {"sample": np.arange(n)}
    coords = {"sample": source["sample"].values}
    for name in _COORDS:
        if name in source.coords and source[name].dims == ("sample",):
            coords[name] = ("sample", source[name].values)
    return coords


def write_maps(maps: xr.DataArray, store: str | os.PathLike, *, group: str | None = None, overwrite: bool = False):
    """Write maps from :func:`explain` to a Zarr store (computing them there, chunk by chunk).

    Zarr needs equal chunks along ``sample``, which a split selection breaks, so the maps are rechunked to their
    largest chunk first; text coordinates are written as variable-length strings.

    Parameters
    ----------
    maps
        From :func:`explain`.
    store
        Path or URL of the Zarr store; ``group`` writes into a group of it (e.g. ``"explanations/gradcam"`` in
        the images' own store, which :func:`~dask_dl.open_dataset` then ignores).
    overwrite
        Replace what is there.

    Returns
    -------
    str
        The store written.

    Raises
    ------
    StoreError
        Something is there already and ``overwrite`` is False.
    """
    from dask_dl.cluster.storage import absolute, exists
    from dask_dl.errors import StoreError

    url = absolute(store)  # the workers write the chunks, maybe from another folder (a gateway's, a batch job's)
    if not overwrite and group is None and exists(url):
        raise StoreError(f"{url!r} exists already; pass overwrite=True (CLI: --overwrite) to replace it")
    chunk = max(maps.chunks[0]) if maps.chunks is not None else maps.sizes["sample"]
    out = maps.chunk({"sample": chunk, "finding": -1, "y": -1, "x": -1})
    text = {
        name: (out[name].dims, out[name].values.astype(object)) for name in out.coords if out[name].dtype.kind in "UO"
    }
    out = out.assign_coords(text).to_dataset(name=maps.name or "explanation")
    out.to_zarr(url, group=group, mode="w" if overwrite or group is None else "w-", consolidated=False)
    return url


# ---- the task ----------------------------------------------------------------------------------------------


def _explain_block(
    block: np.ndarray,
    payload: bytes | None,
    *,
    spec: ModelSpec,
    method: str,
    targets: tuple[int, ...],
    dtype_name: str,
    batch_size: int,
    device: str | None,
    options: dict[str, int],
) -> np.ndarray:
    import torch

    n, side = block.shape[0], block.shape[-1]
    out = np.empty((n, len(targets), side, side), np.dtype(dtype_name))
    if spec.kind == "onnx":
        forward, lock, where = _onnx_forward(spec), None, torch.device("cpu")
    else:
        loaded = get_model(spec, payload, device)
        forward, lock, where = None, loaded.lock, loaded.device
    for start in range(0, n, batch_size):
        pixels = np.asarray(block[start : start + batch_size], np.float32)
        pixels = torch.from_numpy(pixels[:, None] if pixels.ndim == 3 else pixels).to(where)
        if spec.kind == "onnx":
            raw = _occlusion(forward, pixels, targets, options)
        else:
            with lock, torch.enable_grad():
                raw = _torch_maps(loaded.net, spec, method, pixels, targets, options)
        out[start : start + len(pixels)] = _scaled(raw, dtype_name)
    return out


def _torch_maps(net, spec: ModelSpec, method: str, pixels, targets, options) -> np.ndarray:
    import torch

    from dask_dl.normalize import scale

    mean, std = spec.normalization["mean"], spec.normalization["std"]

    def logits(x):
        return net(scale(x, mean, std))

    if method == "gradcam":
        attr = _captum()
        cam = attr.LayerGradCam(logits, dict(net.named_modules())[spec.layer])
        maps = []
        for j in targets:
            attribution = cam.attribute(pixels, target=j, relu_attributions=True)
            up = attr.LayerAttribution.interpolate(attribution, tuple(pixels.shape[-2:]), interpolate_mode="bilinear")
            maps.append(up[:, 0].detach().float().cpu().numpy())
        return np.stack(maps, axis=1)

    def probabilities(x):
        out = logits(x)
        return torch.sigmoid(out) if spec.activation == "sigmoid" else torch.softmax(out, dim=1)

    with torch.no_grad():
        return _occlusion(probabilities, pixels, targets, options)


def _occlusion(forward, pixels, targets, options) -> np.ndarray:
    occlusion = _captum().Occlusion(forward)
    window, stride = options["window"], options["stride"]
    # the patch is the image's own mean gray: black would be a striking, lung-like dark square on a radiograph
    baseline = pixels.mean(dim=(1, 2, 3), keepdim=True).expand_as(pixels).contiguous()
    # occluded copies evaluated per forward pass: as many as fit in 2**20 pixels (256 images of 64 px), at least one
    per_eval = max(1, 2**20 // (len(pixels) * pixels.shape[-1] * pixels.shape[-2]))
    maps = []
    for j in targets:
        attribution = occlusion.attribute(
            pixels,
            sliding_window_shapes=(pixels.shape[1], window, window),
            strides=(1, stride, stride),
            target=j,
            baselines=baseline,
            perturbations_per_eval=per_eval,
            show_progress=False,
        )
        maps.append(attribution[:, 0].detach().float().cpu().numpy())
    return np.stack(maps, axis=1)


def _captum():
    """``captum.attr``, imported without the warning tqdm gives in a notebook lacking ipywidgets."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import captum.attr

    return captum.attr


def _onnx_forward(spec: ModelSpec):
    import torch

    from dask_dl.inference import get_session

    session = get_session(spec.path, spec.stamp, None, int(config.get("predict.threads")))
    io = spec.onnx

    def forward(x):
        batch = x.detach().cpu().numpy()
        if io["input_rank"] == 3:
            batch = batch[:, 0]
        if spec.normalization is not None:
            from dask_dl.normalize import scale

            batch = scale(batch, spec.normalization["mean"], spec.normalization["std"])
        result = session.run([io["output_name"]], {io["input_name"]: batch.astype(io["input_dtype"], copy=False)})
        return torch.from_numpy(np.asarray(result[0], np.float32))

    return forward


def _scaled(raw: np.ndarray, dtype_name: str) -> np.ndarray:
    """Cut negative evidence and divide each map by its maximum (all-zero maps stay zero)."""
    raw = np.clip(np.nan_to_num(raw.astype(np.float32), nan=0.0), 0, None)
    peak = raw.max(axis=(2, 3), keepdims=True)
    scaled = np.divide(raw, peak, out=np.zeros_like(raw), where=peak > 0)
    if dtype_name == "uint8":
        return np.rint(255 * scaled).astype(np.uint8)
    return scaled.astype(np.float16)

"""The commands on trained models: ``export`` (ONNX), ``predict``, ``explain`` and ``report``."""

from __future__ import annotations

import os
from typing import Any

import click

from dask_dl.cli.group import cli
from dask_dl.cli.options import PathOrURL, scheduler_option
from dask_dl.cli.session import connect


@cli.command("export")
@click.argument("checkpoint")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--opset", type=int, default=None, help="ONNX opset (default: the torch exporter's).")
def export_command(checkpoint, out, overwrite, opset) -> None:
    """Write the model of CHECKPOINT (an epoch-NNNN.pt file or a checkpoint directory) as ONNX file OUT.

    The graph takes float32 pixels 0-255 (batch, C, S, S), C the store's channels, and returns probabilities;
    labels, input size, channels and normalization are in its metadata. onnxruntime's output is checked against
    torch before OUT is written.
    """
    from dask_dl.export import export_onnx, read_model_info

    path = export_onnx(checkpoint, out, overwrite=overwrite, opset=opset)
    info = read_model_info(path)
    click.echo(
        f"wrote {path}: {info.model_name}, {info.input_size} px, {len(info.labels)} labels ({info.task}, "
        f"{info.activation}), parity with torch checked"
    )


@cli.command("predict")
@click.argument("store")
@click.argument("model", type=PathOrURL(exists=True, dir_okay=False))
@click.option(
    "--out",
    "-o",
    required=True,
    help="Where to write the scores: a .parquet table (ids, split, site, p_<label>, true labels) or a .zarr store.",
)
@click.option("--split", default=None, help="Score only this split (train, val or test). Default: every image.")
@click.option("--batch-size", type=int, default=None, help="Images per onnxruntime call (default from config).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option(
    "--on",
    "on",
    type=click.Choice(["cpu", "gpu", "any"]),
    default=None,
    help="Workers that score: cpu (the CPU workers when the cluster has GPU workers too), gpu (the workers with a "
    "GPU resource; onnxruntime's CUDA provider where installed), any. Default: dask-dl.predict.workers, cpu.",
)
@scheduler_option
def predict_command(store, model, out, split, batch_size, overwrite, on, scheduler, workers) -> None:
    """Score the images of STORE (from dask-dl ingest) with MODEL (.onnx); print AUROC per label and split when
    the store has labels."""
    from dask_dl.cluster.storage import exists
    from dask_dl.data.dataset import open_dataset
    from dask_dl.errors import StoreError
    from dask_dl.inference import predict, scores_table, write_scores_zarr
    from dask_dl.onnx_info import read_model_info

    kind = "zarr" if out.rstrip("/").endswith(".zarr") else "parquet" if out.endswith(".parquet") else None
    if kind is None:
        raise StoreError(f"--out {out!r} must end in .parquet (a table) or .zarr (a store)")
    if exists(out) and not overwrite:
        raise StoreError(f"{out!r} exists already; pass --overwrite to replace it")
    info = read_model_info(model)
    ds = open_dataset(store, split=split)
    with connect(scheduler, workers) as client:
        probs = client.compute(predict(ds, model, batch_size=batch_size, client=client, on=on)).result()
    table = scores_table(ds, probs, labels=list(info.labels))
    if kind == "parquet":
        import fsspec

        with fsspec.open(out, "wb") as f:  # through fsspec and its settings, as every store (pandas: pyarrow's S3)
            table.to_parquet(f, index=False)
    else:
        write_scores_zarr(table, list(info.labels), out, overwrite=overwrite)
    click.echo(f"wrote {len(table)} scores of {len(info.labels)} labels to {out}")
    truth = [label for label in info.labels if label in table.columns]
    if truth:
        _echo_auroc(table, truth)


def _echo_auroc(table: Any, labels: list[str]) -> None:
    """AUROC per label and split: the scores of images the model trained on are no measure of it, so each split
    has its own column (train, val, test, then any other)."""
    import numpy as np

    from dask_dl.inference import evaluate
    from dask_dl.metrics import NO_AUROC_NOTE, auroc_text

    order = ("train", "val", "test")
    present = list(dict.fromkeys(table["split"].dropna()))
    splits = [s for s in order if s in present] + [s for s in present if s not in order]
    columns = {s: evaluate(table[table["split"] == s], labels=labels).to_numpy() for s in splits}
    width = max(8, *(len(s) + 2 for s in columns))

    def line(name: str, values: list[float]) -> str:
        return f"  {name:24s}" + "".join(f"{auroc_text(v, 4):>{width}s}" for v in values)

    click.echo(f"  {'AUROC':24s}" + "".join(f"{s:>{width}s}" for s in columns))
    for row, label in enumerate(labels):
        click.echo(line(label, [v[row] for v in columns.values()]))
    click.echo(line("mean", [v[np.isfinite(v)].mean() if np.isfinite(v).any() else np.nan for v in columns.values()]))
    if any(not np.isfinite(v).all() for v in columns.values()):
        click.echo(f"  {NO_AUROC_NOTE}")
    if len(columns) > 1:
        click.echo("  train and val: images the model learned from or was chosen on; test measures it")


@cli.command("explain")
@click.argument("store")
@click.argument("model", type=PathOrURL(exists=True))
@click.option("--labels", "-l", default=None, help="Findings to explain, comma-separated. Default: all of the model's.")
@click.option("--out", "-o", required=True, help="Zarr store for the maps: explanation(sample, finding, y, x).")
@click.option(
    "--method",
    type=click.Choice(["gradcam", "occlusion"]),
    default="gradcam",
    show_default=True,
    help="Grad-CAM (checkpoint file or directory) or occlusion (also an .onnx file).",
)
@click.option("--split", default=None, help="Explain only this split (train, val or test). Default: every image.")
@click.option(
    "--dtype",
    type=click.Choice(["float16", "uint8"]),
    default="float16",
    show_default=True,
    help="Maps in [0, 1] as float16, or 255 * map as uint8.",
)
@click.option(
    "--boxes",
    default=None,
    help="A box CSV (NIH BBox_List_2017.csv or image_id,finding,x,y,w,h): print the localization table.",
)
@click.option("--image-size", type=int, default=None, help="Side of the images the --boxes coordinates are in.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@scheduler_option
def explain_command(
    store, model, labels, out, method, split, dtype, boxes, image_size, overwrite, scheduler, workers
) -> None:
    """Explain MODEL's findings on the images of STORE and write the maps to a Zarr store."""
    from dask_dl.data.dataset import open_dataset
    from dask_dl.errors import StoreError
    from dask_dl.explanation import explain, localization
    from dask_dl.explanation.maps import write_maps

    if os.path.exists(out) and not overwrite:
        raise StoreError(f"{out!r} exists already; pass --overwrite to replace it")
    ds = open_dataset(store, split=split)
    if boxes is not None:  # a mistake in the box table is told before the maps are computed
        from dask_dl.data.boxes import read_boxes

        boxes = read_boxes(boxes, size=ds, image_size=image_size)
    chosen = [label.strip() for label in labels.split(",")] if labels else None
    maps = explain(ds, model, labels=chosen, method=method, dtype=dtype)
    with connect(scheduler, workers):  # the maps are computed as they are written, on the block's client
        write_maps(maps, out, overwrite=True)
        click.echo(f"wrote {method} maps of {maps.sizes['sample']} images x {maps.sizes['finding']} findings to {out}")
        if boxes is not None:
            import xarray as xr

            written = xr.open_zarr(out, consolidated=False)["explanation"]
            table = localization(written, boxes)  # in the maps' pixels: read above
            click.echo(table.round(3).to_string())


@cli.command("report")
@click.argument("store")
@click.argument("model", type=PathOrURL(exists=True))
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="The .html page to write.")
@click.option("--split", default="test", show_default=True, help="Split to report on ('all': every image).")
@click.option("--top", type=int, default=8, show_default=True, help="How many of the worst images to show.")
@click.option(
    "--explain/--no-explain",
    default=True,
    show_default=True,
    help="Lay Grad-CAM (occlusion for an .onnx MODEL) over the worst images.",
)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@scheduler_option
def report_command(store, model, out, split, top, explain, overwrite, scheduler, workers) -> None:
    """Write one self-contained HTML page of MODEL (.onnx, checkpoint file or directory) on STORE: AUROC and average
    precision per label, ROC, precision-recall and calibration curves, and the worst images by loss."""
    from dask_dl.interpretation.report import report

    with connect(scheduler, workers) as client:
        path = report(
            store,
            model,
            out,
            split=None if split == "all" else split,
            top=top,
            explain=explain,
            overwrite=overwrite,
            client=client,
        )
    click.echo(f"wrote {path}")

"""The data commands: ``catalog``, ``synth``, ``ingest``, ``summary`` and ``check`` (dask_dl.data)."""

from __future__ import annotations

import contextlib
import sys
import warnings

import click

from dask_dl.cli.group import cli
from dask_dl.cli.options import PathOrURL, quiet_option, scheduler_option
from dask_dl.cli.session import connect


class _LayoutChoice(click.Choice):
    """The catalog layouts registered in ``dask_dl.data.layouts.LAYOUTS``, read when first needed.

    Filling the registry imports the readers (pandas), which ``import dask_dl.cli`` must not do.
    """

    def __init__(self) -> None:
        super().__init__([], case_sensitive=True)

    @property
    def choices(self):
        from dask_dl.data.catalog import LAYOUTS

        return tuple(sorted(LAYOUTS))

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ assigns it
        pass


@cli.command()
@click.argument("source", type=PathOrURL(exists=True))
@click.option(
    "--out",
    "-o",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the catalog to this Parquet file (labels and task kept in its metadata). Default: only print counts.",
)
@click.option(
    "--layout",
    type=_LayoutChoice(),
    default=None,
    help="Reader to use. Default: detected from SOURCE (Data_Entry table -> nih, DICOM files -> dicom, "
    "class folders -> folders, .parquet -> parquet).",
)
@click.option("--site", default=None, help="Value of the site column. Default: NIH for nih, else the folder name.")
@click.option("--seed", type=int, default=None, help="Key of the patient hash that splits patients (default: config).")
@click.option(
    "--val-fraction",
    type=float,
    default=None,
    help="Share of patients for val; with the official NIH lists they come out of train_val (default from config).",
)
@click.option(
    "--test-fraction",
    type=float,
    default=None,
    help="Share of patients for test when the collection has no official split (default from config).",
)
@click.option(
    "--labels-csv",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="DICOM only: labels table keyed by SOP Instance UID, file name or path (first column), with "
    "'Finding Labels' or one 0/1 column per label.",
)
@click.option(
    "--id-from",
    type=click.Choice(["uid", "path"]),
    default=None,
    help="DICOM only: name images by SOP Instance UID (default) or by path under SOURCE (for archives where UIDs "
    "repeat).",
)
def catalog(source, out, layout, site, seed, val_fraction, test_fraction, labels_csv, id_from) -> None:
    """Read the collection at SOURCE into a catalog; print image counts per split and per label.

    SOURCE is an NIH ChestX-ray14 folder (Data_Entry_2017*.csv[.gz], images/), a folder of DICOM files,
    class folders (root/<class>/<image>) or a catalog .parquet file.
    """
    from dask_dl.data.catalog import read_catalog
    from dask_dl.data.schema import labels_of, write_catalog

    options = {"site": site, "seed": seed, "val_fraction": val_fraction, "test_fraction": test_fraction}
    options |= {"labels_csv": labels_csv, "id_from": id_from}
    table = read_catalog(source, layout=layout, **{k: v for k, v in options.items() if v is not None})
    splits = [s for s in ("train", "val", "test") if (table["split"] == s).any()]
    counts = table.groupby("split")[labels_of(table)].sum().T.reindex(columns=splits)
    click.echo(f"{len(table)} images, {table['patient_id'].nunique()} patients, {table['site'].nunique()} site(s)")
    click.echo(f"{'split':24s}" + "".join(f"{s:>9s}" for s in splits))
    click.echo(f"{'images':24s}" + "".join(f"{int((table['split'] == s).sum()):9d}" for s in splits))
    for label, row in counts.iterrows():
        click.echo(f"{label:24s}" + "".join(f"{int(v):9d}" for v in row))
    if out is not None:
        write_catalog(table, out)
        click.echo(f"wrote {out}")


@cli.command()
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--images", "-n", type=int, default=1000, show_default=True, help="Number of images (all sites).")
@click.option("--size", "-s", type=int, default=256, show_default=True, help="Side of the square PNGs (>= 64).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed: the same seed writes identical files.")
@click.option("--patients", type=int, default=None, help="Number of patients. Default: NIH-like follow-up counts.")
@click.option(
    "--label-source",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A real NIH table (Data_Entry_2017[_v2020].csv[.gz]) to take labels, ages, sexes, views and follow-up "
    "counts from. Default: label combinations with NIH's real frequencies, built in.",
)
@click.option(
    "--sites",
    default=None,
    metavar="N|A,B,...",
    help="Spread patients over sites (hospitals) with their own label mix and exposure: a count (site-A, "
    "site-B, ...) or comma-separated names. Each site is written as its own NIH root, ROOT/<site>/.",
)
@click.option("--rgba", type=float, default=0.0, show_default=True, help="Share of the PNGs saved as RGBA.")
@click.option(
    "--corrupt",
    type=float,
    default=0.0,
    show_default=True,
    help="Share of the images written corrupt (truncated, empty or garbage) but listed in the table.",
)
@scheduler_option
@quiet_option
def synth(root, images, size, seed, patients, label_source, sites, rgba, corrupt, scheduler, workers, quiet) -> None:
    """Write a synthetic chest X-ray collection in the NIH ChestX-ray14 layout under ROOT.

    ROOT gets images/<patient>_<follow-up>.png, Data_Entry_2017.csv, train_val_list.txt and test_list.txt,
    readable by `dask-dl catalog ROOT`. Images are drawn in this process unless --scheduler or --workers asks
    for a cluster (whose workers must see ROOT).
    """
    from dask_dl.data.synthetic import synthesize

    if sites is not None and sites.strip().isdigit():
        sites = int(sites)
    cluster = connect(scheduler, workers) if (scheduler or workers) else contextlib.nullcontext()
    with cluster as client:
        table = synthesize(
            root,
            n_images=images,
            size=size,
            seed=seed,
            n_patients=patients,
            label_source=label_source,
            sites=sites,
            rgba_fraction=rgba,
            corrupt_fraction=corrupt,
            client=client,
            progress=not quiet,
        )
    where = ", ".join(sorted(table["site"].unique())) if sites is not None else root
    click.echo(
        f"wrote {len(table)} images of {table['patient_id'].nunique()} patients to {where} "
        f"({int((table['split'] == 'test').sum())} in test_list.txt, {int(table['rgba'].sum())} RGBA, "
        f"{int(table['corrupt'].sum())} corrupt)"
    )


@cli.command("ingest")
@click.argument("source")
@click.argument("store")
@click.option("--size", "-s", type=int, default=None, help="Side of the square uint8 images (default from config).")
@click.option("--chunk", type=int, default=None, help="Images per Zarr chunk (default from config).")
@click.option("--shard", type=int, default=None, help="Chunks per Zarr shard, the unit one task writes (config).")
@click.option(
    "--min-size",
    type=int,
    default=None,
    help="Reject images with a side under this many pixels (default from config, else a quarter of --size).",
)
@click.option(
    "--max-reject-share",
    type=float,
    default=None,
    help="Fail when more than this share of the images is rejected (default from config: 0.5).",
)
@click.option("--overwrite", is_flag=True, help="Replace STORE if it holds another dataset (size, catalog, ...).")
@click.option(
    "--channels",
    type=click.Choice(["1", "3"]),
    default=None,
    help="1: grey (radiographs); 3: keep RGB colour (grey images replicated, alpha dropped). Default from config: 1.",
)
@scheduler_option
@quiet_option
def ingest_command(
    source, store, size, chunk, shard, min_size, max_reject_share, overwrite, channels, scheduler, workers, quiet
) -> None:
    """Decode, grayscale (or keep RGB: --channels 3) and resize the images of SOURCE into the Zarr store STORE.

    SOURCE is anything `dask-dl catalog` reads (a collection root or a catalog .parquet). Rerunning on a store
    that a killed run left behind writes only the missing shards. Rejected images are listed in
    STORE/_dask_dl/rejects.parquet.
    """
    import logging

    from dask_dl.data.catalog import read_catalog
    from dask_dl.data.ingest import ingest

    if quiet:  # log lines of dask_dl only, not every line of distributed
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logging.getLogger("dask_dl").addHandler(handler)
        logging.getLogger("dask_dl").setLevel(logging.INFO)
    catalog = read_catalog(source)
    with connect(scheduler, workers) as client:
        result = ingest(
            catalog,
            store,
            size=size,
            chunk=chunk,
            shard=shard,
            min_size=min_size,
            max_reject_share=max_reject_share,
            overwrite=overwrite,
            client=client,
            progress=False if quiet else None,
            channels=None if channels is None else int(channels),
        )
    click.echo(result.summary())


@cli.command("summary")
@click.argument("store")
def summary_command(store) -> None:
    """Count the images of STORE per split and label, and the rejected ones."""
    from dask_dl.data.dataset import summary

    table = summary(store)
    click.echo(f"{store}: {int(table.loc['total', 'images'])} images, {int(table.loc['total', 'rejected'])} rejected")
    click.echo(table.T.to_string())


@cli.command("check")
@click.argument("store")
def check_command(store) -> None:
    """Verify STORE (from dask-dl ingest): metadata, shapes, labels, coordinates, shard files, every chunk.

    Prints the problems found with the samples they touch, and exits with status 1 when there is one.
    """
    from dask_dl.data.check import check_store
    from dask_dl.data.order import SampleOrderWarning

    with warnings.catch_warnings():  # the summary says it, as a note
        warnings.simplefilter("ignore", SampleOrderWarning)
        report = check_store(store)
    click.echo(report.summary())
    if not report.ok:
        sys.exit(1)

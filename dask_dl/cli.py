"""The ``dask-dl`` command (also ``dask dl`` through Dask's ``dask_cli`` entry point).

Every sub-command is a thin layer over the Python API: it parses options, connects to a cluster (a local one by
default, ``--scheduler ADDRESS`` for a running one) and calls the function of the same name. Heavy imports stay
inside the commands so that ``dask-dl --help`` is fast. Errors that dask_dl raises on purpose are printed as one
readable message, without a traceback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from dask_dl.errors import DaskDLError
from dask_dl.interrupt import Interrupted, caught_interrupt
from dask_dl.models import MODELS
from dask_dl.registry import Registry
from dask_dl.train.compressors import COMPRESSORS
from dask_dl.train.option_groups import DEFAULTS


class _Group(click.Group):
    """A click group that turns :class:`DaskDLError` into a one-line message and exit status 1.

    Ctrl-C ends a command with status 130, as shells report it, and with the message of an
    :class:`~dask_dl.interrupt.Interrupted` (what was kept, how to go on) instead of click's "Aborted!". Any
    other exception is a bug and keeps its traceback; ``--debug`` shows the traceback of every error.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            click.echo(str(exc) if isinstance(exc, Interrupted) else "stopped by Ctrl-C", err=True)
            sys.exit(130)
        except DaskDLError as exc:
            if ctx.params.get("debug"):
                raise
            message = " ".join(str(exc).split("\n")) or type(exc).__name__
            click.secho(f"error: {message}", fg="red", err=True)
            sys.exit(1)
        finally:
            logging.getLogger("asyncio").addFilter(_unclosed_at_exit)


def _unclosed_at_exit(record: logging.LogRecord) -> bool:
    """Once a command has finished: drop aiohttp's reports of sessions it finds unclosed at interpreter exit.

    zarr reads object stores (``s3://``) through asynchronous fsspec filesystems that nobody closes, and s3fs's own
    finalizer fails to close its synchronous ones (fsspec/s3fs#943); their aiohttp sessions report themselves as
    they are collected at exit, about connections the ending process closes anyway.
    """
    return not str(record.msg).startswith(("Unclosed client session", "Unclosed connector"))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="dask-dl", prog_name="dask-dl")
@click.option("--debug", is_flag=True, default=False, help="Show the full traceback of every error, expected or not.")
def cli(debug: bool) -> None:
    """Dask-native deep learning on big image collections: ingest, train, export, predict."""
    here = os.getcwd()
    if not {"", here} & set(sys.path):
        # your models (--model module:function, and checkpoints of them) import from the current folder, as with
        # `python -m`; appended, so that nothing installed is shadowed; a local cluster's workers get this path
        sys.path.append(here)


def scheduler_option(f):
    """``--scheduler``/``--workers`` options shared by every command that runs on a cluster (with cluster_options)."""
    f = cluster_options(f)
    f = click.option(
        "--workers",
        "-w",
        "--jobs",
        "workers",
        type=int,
        default=None,
        help="Workers of the cluster started when no --scheduler is given, or jobs of --cluster slurm "
        "(default from config).",
    )(f)
    return click.option(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="Address of a running Dask scheduler (tcp://host:8786, tls://...). Default: start a local cluster.",
    )(f)


def _set_config(key: str | tuple[str, ...]):
    """Click callback: put an option's value into dask.config for the command's duration (dask_dl reads it there)."""

    def callback(ctx: click.Context, param: click.Parameter, value):
        if value is not None:
            import dask.config

            keys = {key: value} if isinstance(key, str) else {k: value for k in key}
            if param.name.startswith("tls"):
                keys["distributed.comm.require-encryption"] = True
            ctx.with_resource(dask.config.set(keys))
        return value

    return callback


def cluster_options(f):
    """``--cluster KIND`` and ``--tls-ca/--tls-cert/--tls-key``, applied through dask.config (no parameters).

    ``--cluster`` sets ``dask-dl.cluster.kind`` (the kind :func:`dask_dl.cluster.make` makes when no
    ``--scheduler`` is given); the TLS files set ``distributed.comm.tls.*``, which a ``tls://`` scheduler address
    and the clusters dask_dl makes both use.
    """
    from dask_dl.cluster.make import KINDS

    tls = [
        ("--tls-key", ("distributed.comm.tls.client.key", "distributed.comm.tls.scheduler.key",
                       "distributed.comm.tls.worker.key"), "Private key of --tls-cert, when it is a file of its own."),
        ("--tls-cert", ("distributed.comm.tls.client.cert", "distributed.comm.tls.scheduler.cert",
                        "distributed.comm.tls.worker.cert"), "Certificate (PEM) of this client, and of the "
         "scheduler and workers of a cluster dask-dl starts."),
        ("--tls-ca", ("distributed.comm.tls.ca-file",), "Certificate authority (PEM) of a TLS cluster."),
    ]  # fmt: skip
    for name, keys, text in tls:
        f = click.option(
            name, type=click.Path(exists=True, dir_okay=False), default=None, expose_value=False, is_eager=True,
            callback=_set_config(keys), help=text,
        )(f)  # fmt: skip
    return click.option(
        "--cluster", type=click.Choice(KINDS.names()), default=None, expose_value=False, is_eager=True,
        callback=_set_config("dask-dl.cluster.kind"),
        help="Kind of cluster to start when no --scheduler is given: "
        + "; ".join(f"{k}: {v}" for k, v in KINDS.help().items()) + " (default: dask-dl.cluster.kind, local).",
    )(f)  # fmt: skip


@contextlib.contextmanager
def _connect(scheduler: str | None, n_workers: int | None) -> Any:
    """The command's cluster (:func:`dask_dl.cluster.connect`), whose workers get this command's storage settings.

    fsspec reads its settings from ``FSSPEC_<PROTOCOL>_<OPTION>`` variables (``FSSPEC_S3_ENDPOINT_URL``,
    ``FSSPEC_S3_KEY``, ...) and ``~/.config/fsspec``; the workers of a gateway, SLURM or remote cluster do not see
    this shell's, so the settings of every remote protocol go to them (``set_storage_options``) before any work.
    """
    import fsspec.config

    from dask_dl.cluster import connect, set_storage_options

    settings = {
        protocol: dict(values)
        for protocol, values in fsspec.config.conf.items()
        if protocol not in ("file", "local") and isinstance(values, dict) and values
    }
    with connect(scheduler=scheduler, n_workers=n_workers) as client:
        if settings:
            set_storage_options(client, settings)
        yield client


class _PathOrURL(click.Path):
    """An existing local path (``click.Path``), or an fsspec URL (``s3://...``) that exists, looked up with fsspec.

    The URL is looked up with this process's fsspec settings (``FSSPEC_S3_ENDPOINT_URL``, ...), as the command
    will read it.
    """

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from dask_dl.cluster.storage import exists, is_url

        if not (isinstance(value, str) and is_url(value)):
            return super().convert(value, param, ctx)
        try:
            found = exists(value)
        except Exception as exc:  # credentials, endpoint, no such protocol: fsspec's own words
            self.fail(f"cannot look up {value!r}: {type(exc).__name__}: {exc}", param, ctx)
        if not found:
            self.fail(f"{value!r} does not exist.", param, ctx)
        return value


class _ModelName(click.Choice):
    """A registry model (the choices, completed by the shell), or ``torchvision:NAME``, ``timm:NAME`` or the
    import path ``module:function`` of the user's own (checked by ``fit``, which says what is wrong)."""

    def get_metavar(self, param, *args, **kwargs):
        return "[" + "|".join(self.choices) + "|torchvision:NAME|timm:NAME|MODULE:FUNCTION]"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and ":" in value:
            return value
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            self.fail(
                f"{value!r} is no model: name one of {', '.join(self.choices)}, or give torchvision:NAME, timm:NAME "
                "or the import path module:function of a function returning your network",
                param, ctx,
            )  # fmt: skip


def model_option(*names: str):
    """``--model``: the registry's names and help lines, plus the other forms ``fit(model=...)`` takes by name."""
    return registry_option(
        *names, registry=MODELS, what="Model", type=_ModelName(MODELS.names()),
        more=" Or torchvision:NAME, timm:NAME, or module:function: a function of yours returning the network (it"
        " gets num_outputs and in_channels when it takes them), importable from the current folder or PYTHONPATH.",
    )  # fmt: skip


quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bar: log lines only (batch jobs).")


def registry_option(
    *names: str, registry: Registry, what: str, default: str | None = None, type: click.Choice | None = None,
    more: str = "",
):  # fmt: skip
    """An option whose choices and help are the names and help lines of ``registry`` (not a copied list).

    ``type`` replaces the plain choice of those names (a choice that also takes other forms, said in ``more``).
    """
    lines = "; ".join(f"{name}: {text}" if text else name for name, text in registry.help().items())
    default_text = f" Default: {default}." if default is not None else " Default from config."
    return click.option(
        *names,
        type=type or click.Choice(registry.names()),
        default=default,
        help=f"{what} ({lines}).{more}{default_text}",
    )


# ---- commands ---------------------------------------------------------------------------------------------
# Each room adds its commands in its own section below, above the end marker.


@cli.command()
def info() -> None:
    """Show the dask_dl version, the settings in force and which optional extras are installed."""
    import dask.config
    import yaml

    from dask_dl._version import __version__

    click.echo(f"dask-dl {__version__}")
    for extra, module in [
        ("gpu", "dask_cuda"),
        ("gateway", "dask_gateway"),
        ("hpc", "dask_jobqueue"),
        ("dicom", "pydicom"),
        ("s3", "s3fs"),
        ("tensorboard", "tensorboard"),
        ("explain", "captum"),
        ("torchvision", "torchvision"),
        ("timm", "timm"),
        ("monai", "monai"),
        ("notebook", "jupyterlab"),
    ]:
        found = importlib.util.find_spec(module) is not None
        click.echo(f"  extra {extra:11s} {'installed' if found else 'not installed'} ({module})")
    click.echo(yaml.safe_dump({"dask-dl": dask.config.get("dask-dl")}, sort_keys=False).rstrip())


# ---- catalog (data room: dask_dl.data.catalog) -------------------------------------------------------------


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
@click.argument("source", type=_PathOrURL(exists=True))
@click.option(
    "--out", "-o", type=click.Path(dir_okay=False), default=None,
    help="Write the catalog to this Parquet file (labels and task kept in its metadata). Default: only print counts.",
)  # fmt: skip
@click.option(
    "--layout", type=_LayoutChoice(), default=None,
    help="Reader to use. Default: detected from SOURCE (Data_Entry table -> nih, DICOM files -> dicom, "
    "class folders -> folders, .parquet -> parquet).",
)  # fmt: skip
@click.option("--site", default=None, help="Value of the site column. Default: NIH for nih, else the folder name.")
@click.option("--seed", type=int, default=None, help="Key of the patient hash that splits patients (default: config).")
@click.option(
    "--val-fraction", type=float, default=None,
    help="Share of patients for val; with the official NIH lists they come out of train_val (default from config).",
)  # fmt: skip
@click.option(
    "--test-fraction", type=float, default=None,
    help="Share of patients for test when the collection has no official split (default from config).",
)  # fmt: skip
@click.option(
    "--labels-csv", type=click.Path(exists=True, dir_okay=False), default=None,
    help="DICOM only: labels table keyed by SOP Instance UID, file name or path (first column), with "
    "'Finding Labels' or one 0/1 column per label.",
)  # fmt: skip
@click.option(
    "--id-from", type=click.Choice(["uid", "path"]), default=None,
    help="DICOM only: name images by SOP Instance UID (default) or by path under SOURCE (for archives where UIDs "
    "repeat).",
)  # fmt: skip
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


# ---- synth (data room: dask_dl.data.synthetic) ---------------------------------------------------------------


@cli.command()
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--images", "-n", type=int, default=1000, show_default=True, help="Number of images (all sites).")
@click.option("--size", "-s", type=int, default=256, show_default=True, help="Side of the square PNGs (>= 64).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed: the same seed writes identical files.")
@click.option("--patients", type=int, default=None, help="Number of patients. Default: NIH-like follow-up counts.")
@click.option(
    "--label-source", type=click.Path(exists=True, dir_okay=False), default=None,
    help="A real NIH table (Data_Entry_2017[_v2020].csv[.gz]) to take labels, ages, sexes, views and follow-up "
    "counts from. Default: label combinations with NIH's real frequencies, built in.",
)  # fmt: skip
@click.option(
    "--sites", default=None, metavar="N|A,B,...",
    help="Spread patients over sites (hospitals) with their own label mix and exposure: a count (site-A, "
    "site-B, ...) or comma-separated names. Each site is written as its own NIH root, ROOT/<site>/.",
)  # fmt: skip
@click.option("--rgba", type=float, default=0.0, show_default=True, help="Share of the PNGs saved as RGBA.")
@click.option(
    "--corrupt", type=float, default=0.0, show_default=True,
    help="Share of the images written corrupt (truncated, empty or garbage) but listed in the table.",
)  # fmt: skip
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
    cluster = _connect(scheduler, workers) if (scheduler or workers) else contextlib.nullcontext()
    with cluster as client:
        table = synthesize(
            root, n_images=images, size=size, seed=seed, n_patients=patients, label_source=label_source,
            sites=sites, rgba_fraction=rgba, corrupt_fraction=corrupt, client=client, progress=not quiet,
        )  # fmt: skip
    where = ", ".join(sorted(table["site"].unique())) if sites is not None else root
    click.echo(
        f"wrote {len(table)} images of {table['patient_id'].nunique()} patients to {where} "
        f"({int((table['split'] == 'test').sum())} in test_list.txt, {int(table['rgba'].sum())} RGBA, "
        f"{int(table['corrupt'].sum())} corrupt)"
    )


# ---- ingest and summary (data room: dask_dl.data.ingest, dask_dl.data.dataset) -----------------------------


@cli.command("ingest")
@click.argument("source")
@click.argument("store")
@click.option("--size", "-s", type=int, default=None, help="Side of the square uint8 images (default from config).")
@click.option("--chunk", type=int, default=None, help="Images per Zarr chunk (default from config).")
@click.option("--shard", type=int, default=None, help="Chunks per Zarr shard, the unit one task writes (config).")
@click.option(
    "--min-size", type=int, default=None,
    help="Reject images with a side under this many pixels (default from config, else a quarter of --size).",
)  # fmt: skip
@click.option(
    "--max-reject-share", type=float, default=None,
    help="Fail when more than this share of the images is rejected (default from config: 0.5).",
)  # fmt: skip
@click.option("--overwrite", is_flag=True, help="Replace STORE if it holds another dataset (size, catalog, ...).")
@click.option(
    "--channels", type=click.Choice(["1", "3"]), default=None,
    help="1: grey (radiographs); 3: keep RGB colour (grey images replicated, alpha dropped). Default from config: 1.",
)  # fmt: skip
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
    with _connect(scheduler, workers) as client:
        result = ingest(
            catalog, store, size=size, chunk=chunk, shard=shard, min_size=min_size,
            max_reject_share=max_reject_share, overwrite=overwrite, client=client, progress=False if quiet else None,
            channels=None if channels is None else int(channels),
        )  # fmt: skip
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

    report = check_store(store)
    click.echo(report.summary())
    if not report.ok:
        sys.exit(1)


# ---- train (training room: dask_dl.train.run) ---------------------------------------------------------------


def train_options(f):
    """The options of ``dask-dl train`` that are options of ``fit``: one per option with flags
    (:func:`dask_dl.train.option_groups.cli_options`), named as ``fit``'s keyword. ``--model`` and
    ``--compression`` take their choices and help lines from their registries."""
    from dask_dl.train.option_groups import cli_options

    for opt in reversed(cli_options()):  # click lists the options in the order they decorate, last first
        if opt.name == "model":
            decorate = model_option(*opt.flags, opt.name)
        elif opt.name == "compression":
            decorate = registry_option(*opt.flags, opt.name, registry=COMPRESSORS, what="Gradient compressor")
        elif opt.cli == "flag":
            decorate = click.option(*opt.flags, opt.name, is_flag=True, default=DEFAULTS[opt.name], help=opt.help)
        else:
            kind = click.Choice(list(opt.cli())) if callable(opt.cli) and opt.cli not in (int, float, str) else opt.cli
            decorate = click.option(*opt.flags, opt.name, type=kind, default=DEFAULTS[opt.name], help=opt.help,
                                    metavar=opt.metavar)  # fmt: skip
        f = decorate(f)
    return f


@cli.command("train")
@click.argument("store")
@train_options
@click.option(
    "--upload", multiple=True, type=click.Path(exists=True, dir_okay=False),
    help="Send this .py (or zipped package) file to the workers before training (client.upload_file), for a "
    "--model module:function they cannot import otherwise. Repeatable.",
)  # fmt: skip
@scheduler_option
@quiet_option
def train_command(store, upload, scheduler, workers, quiet, **options) -> None:
    """Train a model on the train split of STORE, validating on its val split after every epoch.

    Prints one line per epoch and a final table; Ctrl-C stops the trainers within a few steps and frees the
    workers (the last completed epoch's checkpoint stays), then exits with status 130.
    """

    from dask_dl import config
    from dask_dl.data.dataset import open_dataset
    from dask_dl.normalize import channel_stats
    from dask_dl.train.run import fit

    n_trainers = config.get("train.trainers", options.pop("trainers"))
    dataset = open_dataset(store)
    n_workers = workers or max(n_trainers, config.get("cluster.n-workers"))
    interactive = not quiet and sys.stderr is not None and sys.stderr.isatty()
    normalization = _normalization(options.pop("normalization"), dataset)
    with _connect(scheduler, n_workers) as client:
        for path in upload:
            _upload(client, path)
        if normalization == "stats":
            normalization = channel_stats(dataset)  # one pass over the train split, on the cluster
            click.echo(f"normalization of the train split: mean {normalization['mean']}, std {normalization['std']}")
        run = fit(
            dataset, trainers=n_trainers, normalization=normalization, view="terminal" if interactive else "none",
            client=client, wait=False, **options,
        )  # fmt: skip
        interrupted = _follow(
            run, lambda shown: _echo_training(run, shown, interactive), "stopping the trainers", shown=(0, 0)
        )
        if "weights" in run.info:  # what of the start weights was loaded, adapted, re-initialised
            from dask_dl.models.weights import describe

            click.echo(describe(run.info["weights"], options["weights"]))
        if len(run.history):
            click.echo(_final_table(run.history))
        click.echo(f"{run.run_id}: {run.status}")
        run.wait()  # raises what made the run fail
    if interrupted:
        sys.exit(130)


def _upload(client: Any, path: str) -> None:
    """``--upload``: send a file to every worker, and to workers that join later, as ``client.upload_file`` does.

    Its worker plugin is named after the file, so that sending it again replaces it, and a file the workers cannot
    import is taken back (a one-line error says why) instead of failing on every worker that joins.
    """
    from distributed.diagnostics.plugin import UploadFile

    from dask_dl.errors import ClusterError

    name = f"dask-dl-upload-{os.path.basename(path)}"
    try:
        client.register_plugin(UploadFile(path), name=name)
    except Exception as exc:  # the workers import it on arrival: its own imports may fail there
        with contextlib.suppress(Exception):
            client.unregister_worker_plugin(name)
        raise ClusterError(
            f"--upload {path}: the workers could not import it ({type(exc).__name__}: {exc}); install what it "
            "imports where they run"
        ) from exc


IMAGENET_NORMALIZATION = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def _normalization(value: str | None, dataset: Any) -> dict[str, Any] | str | None:
    """``--normalization`` checked against the store's channels: ``MEAN:STD`` (numbers, or comma lists per
    channel) or ``imagenet`` as a normalization; ``stats`` stays, to be measured on the cluster."""
    if value in (None, "stats"):
        return value
    channels = int(dataset.attrs["dask_dl"].get("channels") or 1)
    hint = "'--normalization'"
    if value == "imagenet":
        if channels != 3:
            raise click.BadParameter(
                f"imagenet is ImageNet's mean and std of R, G and B, and this store has {channels} channel(s); "
                "give MEAN:STD or stats",
                param_hint=hint,
            )
        return IMAGENET_NORMALIZATION
    mean, sep, std = value.partition(":")
    try:
        parts = [[float(v) for v in text.split(",")] for text in (mean, std)] if sep else None
    except ValueError:
        parts = None
    if parts is None:
        raise click.BadParameter(
            f"{value!r} is no normalization: give MEAN:STD (e.g. 0.5:0.25, or per channel "
            "0.485,0.456,0.406:0.229,0.224,0.225), imagenet or stats",
            param_hint=hint,
        )
    if min(parts[1]) <= 0 or any(len(p) not in (1, channels) for p in parts):
        raise click.BadParameter(
            f"{value!r}: every STD must be above 0, and the store has {channels} channel(s): give one MEAN and one "
            f"STD{'' if channels == 1 else f', or {channels} of each'}",
            param_hint=hint,
        )
    return {k: v[0] if len(v) == 1 else v for k, v in zip(("mean", "std"), parts, strict=True)}


_TRAIN_COLUMNS = (
    "epoch", "global_batch", "lr", "head_lr", "train_loss", "val_loss", "val_auroc_mean", "images_per_s", "data_wait_s",
    "bytes_sent",
)  # fmt: skip


def _final_table(history: Any, width: int = 100) -> str:
    """What ``dask-dl train`` prints last, within ``width`` columns: the settings that stayed the same over the run
    on one line, the mean metrics of every epoch, then the last epoch's validation AUROC of each label, as many
    ``label value`` pairs to a line as fit (14 labels as columns made a table 250 characters wide)."""
    columns = [c for c in _TRAIN_COLUMNS if c in history]
    fixed = [c for c in ("global_batch", "lr", "head_lr") if c in columns and history[c].nunique(dropna=False) == 1]
    lines = ["  ".join(f"{c} {history[c].iloc[0]:.4g}" for c in fixed)] if fixed else []
    table = history[[c for c in columns if c not in fixed]]
    lines.append(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    labels = [c for c in history if c.startswith("val_auroc_") and c != "val_auroc_mean"]
    if labels:
        last = history.iloc[-1]
        pairs = [f"{c.removeprefix('val_auroc_')} {last[c]:.3f}" for c in labels]
        cell = max(len(p) for p in pairs) + 2
        per_line = max(1, (width + 2) // cell)
        lines.append(f"validation AUROC per label, epoch {int(last['epoch'])}:")
        lines += [
            "".join(p.ljust(cell) for p in pairs[i : i + per_line]).rstrip() for i in range(0, len(pairs), per_line)
        ]
    return "\n".join(lines)


def _follow(run: Any, echo: Callable[[Any], Any], stopping: str, shown: Any = 0) -> bool:
    """Print what ``run`` adds until it ends (``echo(shown) -> shown``, from ``shown``); Ctrl-C stops it and waits
    for its end.

    Returns whether Ctrl-C stopped it: the command then exits with status 130 once it has printed what the run
    did, as shells report a command that Ctrl-C ended, so that a script's next step does not start.
    """
    interrupted = False
    try:
        with caught_interrupt() as interrupt:  # raised here, never lost in a finalizer (dask_dl.interrupt)
            while not run.done:
                time.sleep(0.5)
                interrupt.check()
                shown = echo(shown)
    except KeyboardInterrupt:
        interrupted = True
        click.echo(f"{stopping} within a few steps ...", err=True)
        run.stop()
        while not run.done:
            time.sleep(0.2)
    echo(shown)
    return interrupted


def _echo_training(run, shown: tuple[int, int], interactive: bool) -> tuple[int, int]:
    """Print the restarts and the epochs since the last call (the terminal view prints its own epochs); return
    how many of each were printed."""
    restarts = run.restarts.to_dict("records")
    for row in restarts[shown[0] :]:
        when = (
            f"in epoch {row['failed_epoch']} step {row['failed_step']}" if row["failed_epoch"] >= 0
            else "before training started"
        )  # fmt: skip
        click.echo(
            f"{run.run_id}: lost {row['lost_workers'] or 'a trainer'} {when} ({row['error']}); went on "
            f"{row['seconds']:.1f} s later with {row['world_size']} trainer(s) from epoch {row['resumed_epoch']} "
            f"step {row['resumed_step']}, {row['steps_lost']} step(s) lost"
        )
    rows = run.history.to_dict("records")
    if not interactive:
        for row in rows[shown[1] :]:
            text = " ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in
                            _TRAIN_COLUMNS if k in row)  # fmt: skip
            click.echo(f"{run.run_id} {text}" + (f" ({row['event']})" if row.get("event") else ""))
    return len(restarts), len(rows)


# ---- export and predict (exchange room: dask_dl.export, dask_dl.inference) ---------------------------------


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
@click.argument("model", type=_PathOrURL(exists=True, dir_okay=False))
@click.option(
    "--out", "-o", required=True,
    help="Where to write the scores: a .parquet table (ids, split, site, p_<label>, true labels) or a .zarr store.",
)  # fmt: skip
@click.option("--split", default=None, help="Score only this split (train, val or test). Default: every image.")
@click.option("--batch-size", type=int, default=None, help="Images per onnxruntime call (default from config).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option(
    "--on", "on", type=click.Choice(["cpu", "gpu", "any"]), default=None,
    help="Workers that score: cpu (the CPU workers when the cluster has GPU workers too), gpu (the workers with a "
    "GPU resource; onnxruntime's CUDA provider where installed), any. Default: dask-dl.predict.workers, cpu.",
)  # fmt: skip
@scheduler_option
def predict_command(store, model, out, split, batch_size, overwrite, on, scheduler, workers) -> None:
    """Score the images of STORE (from dask-dl ingest) with MODEL (.onnx); print AUROC per label and split when
    the store has labels."""
    from dask_dl.cluster.storage import exists
    from dask_dl.data.dataset import open_dataset
    from dask_dl.errors import StoreError
    from dask_dl.inference import predict, scores_table
    from dask_dl.onnx_info import read_model_info

    kind = "zarr" if out.rstrip("/").endswith(".zarr") else "parquet" if out.endswith(".parquet") else None
    if kind is None:
        raise StoreError(f"--out {out!r} must end in .parquet (a table) or .zarr (a store)")
    if exists(out) and not overwrite:
        raise StoreError(f"{out!r} exists already; pass --overwrite to replace it")
    info = read_model_info(model)
    ds = open_dataset(store, split=split)
    with _connect(scheduler, workers) as client:
        probs = client.compute(predict(ds, model, batch_size=batch_size, client=client, on=on)).result()
    table = scores_table(ds, probs, labels=list(info.labels))
    if kind == "parquet":
        import fsspec

        with fsspec.open(out, "wb") as f:  # through fsspec and its settings, as every store (pandas: pyarrow's S3)
            table.to_parquet(f, index=False)
    else:
        _write_scores_zarr(table, list(info.labels), out, overwrite=overwrite)
    click.echo(f"wrote {len(table)} scores of {len(info.labels)} labels to {out}")
    truth = [label for label in info.labels if label in table.columns]
    if truth:
        _echo_auroc(table, truth)


def _echo_auroc(table: Any, labels: list[str]) -> None:
    """AUROC per label and split: the scores of images the model trained on are no measure of it, so each split
    has its own column (train, val, test, then any other)."""
    import numpy as np

    from dask_dl.inference import evaluate

    order = ("train", "val", "test")
    present = list(dict.fromkeys(table["split"].dropna()))
    splits = [s for s in order if s in present] + [s for s in present if s not in order]
    columns = {s: evaluate(table[table["split"] == s], labels=labels).to_numpy() for s in splits}
    width = max(8, *(len(s) + 2 for s in columns))

    def line(name: str, values: list[float]) -> str:
        return f"  {name:24s}" + "".join(f"{v:{width}.4f}" if np.isfinite(v) else f"{'-':>{width}s}" for v in values)

    click.echo(f"  {'AUROC':24s}" + "".join(f"{s:>{width}s}" for s in columns))
    for row, label in enumerate(labels):
        click.echo(line(label, [v[row] for v in columns.values()]))
    click.echo(line("mean", [v[np.isfinite(v)].mean() if np.isfinite(v).any() else np.nan for v in columns.values()]))
    if any(not np.isfinite(v).all() for v in columns.values()):
        click.echo("  -: no AUROC, the split's images all have that label or all lack it")
    if len(columns) > 1:
        click.echo("  train and val: images the model learned from or was chosen on; test measures it")


def _write_scores_zarr(table, labels: list[str], out: str, *, overwrite: bool) -> None:
    """Scores as a Zarr store: ``probability(sample, label)`` with the table's id columns as coordinates."""
    import numpy as np
    import xarray as xr

    from dask_dl.data.store import COORDS

    probs = table[[f"p_{label}" for label in labels]].to_numpy()
    # object arrays of str become Zarr 3 variable-length strings (numpy's fixed-width '<U' has no Zarr 3 spec)
    coords = {"sample": table["sample"].to_numpy(), "label": np.array(labels, dtype=object)}
    coords |= {c: ("sample", table[c].to_numpy(dtype=object)) for c in COORDS}
    ds = xr.Dataset({"probability": (("sample", "label"), probs)}, coords=coords)
    ds.to_zarr(out, mode="w" if overwrite else "w-", consolidated=False, zarr_format=3)


# ---- demo -------------------------------------------------------------------------------------------------


@cli.command()
@click.argument("out", default="dask-dl-demo", type=click.Path(file_okay=False))
@click.option("--images", default=4000, show_default=True, help="Images in the synthetic collection.")
@click.option("--size", default=64, show_default=True, help="Training image size in pixels per side.")
@click.option("--epochs", default=8, show_default=True, help="Training epochs.")
@registry_option("--model", registry=MODELS, what="Model", default="small_cnn")
@click.option("--trainers", default=2, show_default=True, help="Training actors, one per worker.")
@registry_option("--compression", registry=COMPRESSORS, what="Gradient compressor", default="onebit")
@click.option("--batch-size", default=32, show_default=True, help="Images per trainer per step.")
@click.option(
    "--data",
    default=None,
    type=click.Path(exists=True),
    help="Use this collection (NIH root, class folders, DICOM folder, Parquet catalog) instead of synthetic data.",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the synthetic data and of training.")
@scheduler_option
@quiet_option
def demo(out, images, size, epochs, model, trainers, compression, batch_size, data, seed, scheduler, workers, quiet):
    """Run the whole story on a local cluster: synthesize, ingest, train, evaluate, export, score, report.

    Everything is written under OUT (default ./dask-dl-demo): the raw collection, the Zarr store, checkpoints,
    the ONNX model and the test-split scores. Stopped (Ctrl-C) and run again, it keeps what it finished (the
    synthetic collection, the shards of the store) and trains anew.
    """
    from dask_dl.demo import run_demo

    try:
        report = run_demo(
            out, images=images, size=size, epochs=epochs, model=model, trainers=trainers, compression=compression,
            batch_size=batch_size, data=data, seed=seed, scheduler=scheduler, workers=workers,
            view="log" if quiet else "auto",
        )  # fmt: skip
    except KeyboardInterrupt:
        raise Interrupted(
            f"demo stopped by Ctrl-C; run the same command again to go on: it keeps what it finished under {out} "
            "(the synthetic collection, the shards of the store) and trains anew"
        ) from None
    click.echo(str(report))


# ---- explain (room: explanations) --------------------------------------------------------------------------


@cli.command("explain")
@click.argument("store")
@click.argument("model", type=_PathOrURL(exists=True))
@click.option("--labels", "-l", default=None, help="Findings to explain, comma-separated. Default: all of the model's.")
@click.option("--out", "-o", required=True, help="Zarr store for the maps: explanation(sample, finding, y, x).")
@click.option("--method", type=click.Choice(["gradcam", "occlusion"]), default="gradcam", show_default=True,
              help="Grad-CAM (checkpoint file or directory) or occlusion (also an .onnx file).")  # fmt: skip
@click.option("--split", default=None, help="Explain only this split (train, val or test). Default: every image.")
@click.option("--dtype", type=click.Choice(["float16", "uint8"]), default="float16", show_default=True,
              help="Maps in [0, 1] as float16, or 255 * map as uint8.")  # fmt: skip
@click.option("--boxes", default=None, help="A box CSV (NIH BBox_List_2017.csv or image_id,finding,x,y,w,h): print "
              "the localization table.")  # fmt: skip
@click.option("--image-size", type=int, default=None, help="Side of the images the --boxes coordinates are in.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@scheduler_option
def explain_command(
    store, model, labels, out, method, split, dtype, boxes, image_size, overwrite, scheduler, workers
) -> None:
    """Explain MODEL's findings on the images of STORE and write the maps to a Zarr store."""
    from dask_dl.cluster import close_client, get_client
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
    client = get_client(scheduler=scheduler, n_workers=workers)
    try:
        write_maps(maps, out, overwrite=True)
        click.echo(f"wrote {method} maps of {maps.sizes['sample']} images x {maps.sizes['finding']} findings to {out}")
        if boxes is not None:
            import xarray as xr

            written = xr.open_zarr(out, consolidated=False)["explanation"]
            table = localization(written, boxes)  # in the maps' pixels: read above
            click.echo(table.round(3).to_string())
    finally:
        if scheduler is not None:
            client.close()
        else:
            close_client(client)


@cli.command("report")
@click.argument("store")
@click.argument("model", type=_PathOrURL(exists=True))
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="The .html page to write.")
@click.option("--split", default="test", show_default=True, help="Split to report on ('all': every image).")
@click.option("--top", type=int, default=8, show_default=True, help="How many of the worst images to show.")
@click.option("--explain/--no-explain", default=True, show_default=True,
              help="Lay Grad-CAM (occlusion for an .onnx MODEL) over the worst images.")  # fmt: skip
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@scheduler_option
def report_command(store, model, out, split, top, explain, overwrite, scheduler, workers) -> None:
    """Write one self-contained HTML page of MODEL (.onnx, checkpoint file or directory) on STORE: AUROC and average
    precision per label, ROC, precision-recall and calibration curves, and the worst images by loss."""
    from dask_dl.interpretation.report import report

    with _connect(scheduler, workers) as client:
        path = report(store, model, out, split=None if split == "all" else split, top=top, explain=explain,
                      overwrite=overwrite, client=client)  # fmt: skip
    click.echo(f"wrote {path}")


# ---- xsite (cross-site training: dask_dl.sites) ---------------------------------------------------------------


@cli.command("xsite")
@click.argument("plan", type=click.Path(exists=True, dir_okay=False))
@click.option("--protocol", "-p", type=click.Choice(["ensemble", "incremental", "cyclic", "fedavg", "fedprox"]),
              default=None, help="Overrides the file's protocol.")  # fmt: skip
@click.option("--rounds", "-r", type=int, default=None, help="Overrides the file's rounds.")
@click.option("--export", "export_path", default=None, help="Write the final model as ONNX to this path.")
@click.option("--history", "history_path", default=None, help="Write the history table to this .csv or .parquet.")
@scheduler_option
@quiet_option
def xsite_command(plan, protocol, rounds, export_path, history_path, scheduler, workers, quiet) -> None:
    """Train one model across sites that keep their images, as PLAN (a YAML file) says.

    PLAN names the protocol, the rounds, the model, the options of dask_dl.fit_sites and the sites: a site with
    a scheduler address is a cluster of its own (only weights and metrics travel); a site with only a store
    (and a resource) is on the shared cluster (--scheduler, or a local one). Prints the AUROC of every round per
    site and what the coordinator received from each site. Ctrl-C stops the visits within a few steps, prints
    what the finished rounds did (and exports their model with --export, if a round finished), then exits with
    status 130.
    """

    from dask_dl.errors import TrainingError
    from dask_dl.sites.plan_file import read_plan_file
    from dask_dl.sites.run import fit_sites

    _, options = read_plan_file(plan, open_stores=False)  # a mistake in the plan is told before a cluster starts
    overrides = {k: v for k, v in (("protocol", protocol), ("rounds", rounds)) if v is not None}
    for key in ("protocol", "rounds"):
        if key not in {**options, **overrides}:
            raise click.UsageError(f"{plan} has no {key}: add '{key}:' to it or pass --{key}")
    with _connect(scheduler, workers) as client:
        sites, options = read_plan_file(plan)  # opens the shared cluster's stores, with its client current
        run = fit_sites(sites, client=client, wait=False, **{**options, **overrides})
        interrupted = _follow(run, lambda shown: _echo_rounds(run, shown, quiet), "stopping the sites' trainers")
        click.echo(f"{run.run_id} {run.protocol}: {run.status}")
        if len(run.history):
            click.echo(run.curves.to_string(float_format=lambda v: f"{v:.3f}"))
        click.echo("received by the coordinator:")
        click.echo(run.transfers.to_string(index=False))
        if history_path is not None:
            frame = run.history
            frame.to_parquet(history_path) if history_path.endswith(".parquet") else frame.to_csv(history_path)
        run.wait()  # raises what made the run fail
        if export_path is not None:
            try:
                path = run.export_onnx(export_path, overwrite=True)
                click.echo(f"wrote {path} (the model of round {run.model_round})")
            except TrainingError as exc:  # Ctrl-C before a round finished: nothing to export, and that is no error
                if not interrupted:
                    raise
                click.echo(f"nothing exported to {export_path}: {exc}", err=True)
    if interrupted:
        sys.exit(130)


def _echo_rounds(run, shown: int, quiet: bool) -> int:
    """Print the rounds finished since the last call: mean AUROC per site; return how many rounds were shown."""
    curves = run.curves
    if quiet or curves.empty:
        return len(curves)
    for r, row in curves.iloc[shown:].iterrows():
        click.echo(f"round {r}: " + " ".join(f"{k}={v:.3f}" for k, v in row.items()))
    return len(curves)


# ---- end of commands --------------------------------------------------------------------------------------

main = cli
# ``dask dl ...``: Dask's CLI loads click commands from the ``dask_cli`` entry point.
dask_cli = _Group(name="dl", commands=cli.commands, help=cli.help)

if __name__ == "__main__":  # pragma: no cover
    cli()

"""The training commands: ``train`` (dask_dl.fit on a store) and ``demo`` (the whole story on a local cluster)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import click

from dask_dl.cli.group import cli
from dask_dl.cli.options import model_option, quiet_option, registry_option, scheduler_option
from dask_dl.cli.session import connect, follow
from dask_dl.interrupt import Interrupted
from dask_dl.models import MODELS
from dask_dl.train.compressors import AUTO_HELP, COMPRESSORS
from dask_dl.train.option_groups import DEFAULTS


def train_options(f):
    """The options of ``dask-dl train`` that are options of ``fit``: one per option with flags
    (:func:`dask_dl.train.option_groups.cli_options`), named as ``fit``'s keyword. ``--model`` and
    ``--compression`` take their choices and help lines from their registries; ``--lr`` also takes ``find``."""
    from dask_dl.train.option_groups import cli_options

    for opt in reversed(cli_options()):  # click lists the options in the order they decorate, last first
        if opt.name == "model":
            decorate = model_option(*opt.flags, opt.name)
        elif opt.name == "compression":
            decorate = registry_option(
                *opt.flags,
                opt.name,
                registry=COMPRESSORS,
                what="Gradient compressor",
                type=click.Choice(list(opt.cli())),
                more=f" auto: {AUTO_HELP}.",
            )
        elif opt.name == "lr":
            decorate = click.option(
                *opt.flags,
                opt.name,
                default=DEFAULTS[opt.name],
                metavar="LR|find",
                callback=lambda ctx, param, value: _lr(value),
                help=f"{opt.help} find: run a learning-rate range test first (dask_dl.find_lr) and train with its "
                "suggestion.",
            )
        elif opt.cli == "flag":
            decorate = click.option(*opt.flags, opt.name, is_flag=True, default=DEFAULTS[opt.name], help=opt.help)
        else:
            kind = click.Choice(list(opt.cli())) if callable(opt.cli) and opt.cli not in (int, float, str) else opt.cli
            decorate = click.option(
                *opt.flags, opt.name, type=kind, default=DEFAULTS[opt.name], help=opt.help, metavar=opt.metavar
            )
        f = decorate(f)
    return f


@cli.command("train")
@click.argument("store")
@train_options
@click.option(
    "--upload",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Send this .py (or zipped package) file to the workers before training (client.upload_file), for a "
    "--model module:function they cannot import otherwise. Repeatable.",
)
@click.option(
    "--tracking",
    default=None,
    metavar="URI",
    help="Record the run in MLflow: http://host:port, sqlite:///runs.db or a folder (default: config, then "
    "MLFLOW_TRACKING_URI).",
)
@scheduler_option
@quiet_option
def train_command(store, upload, tracking, scheduler, workers, quiet, **options) -> None:
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
    with connect(scheduler, n_workers) as client:
        for path in upload:
            _upload(client, path)
        if normalization == "stats":
            normalization = channel_stats(dataset)  # one pass over the train split, on the cluster
            click.echo(f"normalization of the train split: mean {normalization['mean']}, std {normalization['std']}")
        if options["lr"] == "find":
            found = ("model", "batch_size", "optimizer", "seed", "augment", "weights", "accumulate")
            options["lr"] = _found_lr(dataset, client, normalization=normalization, **{k: options[k] for k in found})
        run = fit(
            dataset,
            trainers=n_trainers,
            normalization=normalization,
            view="terminal" if interactive else "none",
            client=client,
            wait=False,
            tracking=tracking,
            **options,
        )
        interrupted = follow(
            run, lambda shown: _echo_training(run, shown, interactive), "stopping the trainers", shown=(0, 0, False)
        )
        if "weights" in run.info:  # what of the start weights was loaded, adapted, re-initialised
            from dask_dl.models.weights import describe

            click.echo(describe(run.info["weights"], options["weights"]))
        if len(run.history):
            click.echo(_final_table(run.history))
        click.echo(f"{run.run_id}: {run.status}")
        if run.tracker is not None:
            click.echo(f"MLflow run {run.tracker.run_id} at {run.tracker.uri}")
        run.wait()  # raises what made the run fail
    if interrupted:
        sys.exit(130)


def _lr(value: str | None) -> float | str | None:
    """``--lr``: a number, or ``find``."""
    if value is None:
        return None
    if value.strip().lower() == "find":
        return "find"
    try:
        return float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither a number nor 'find'; e.g. --lr 0.001 or --lr find") from None


def _found_lr(dataset: Any, client: Any, **options: Any) -> float:
    """``--lr find``: the range test's suggestion, printed with how to see the curve."""
    from dask_dl.train.lr_find import find_lr

    finder = find_lr(dataset, client=client, **{k: v for k, v in options.items() if v is not None})
    if finder.suggestion is None:
        raise click.ClickException(
            f"the learning-rate range test stopped after {len(finder.results)} steps ({finder.stopped}), too few to "
            "suggest a learning rate; pass --lr NUMBER"
        )
    click.echo(
        f"learning-rate range test: {len(finder.results)} steps ({finder.stopped}), suggested lr "
        f"{finder.suggestion:.3g} (the curve: dask_dl.find_lr(ds, ...).plot())"
    )
    return finder.suggestion


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


def _normalization(value: str | None, dataset: Any) -> dict[str, Any] | str | None:
    """``--normalization`` checked against the store's channels (:func:`dask_dl.normalize.parse_normalization`)."""
    from dask_dl.errors import ConfigurationError
    from dask_dl.normalize import parse_normalization

    try:
        return parse_normalization(value, channels=int(dataset.attrs["dask_dl"].get("channels") or 1))
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="'--normalization'") from None


_TRAIN_COLUMNS = (
    "epoch",
    "global_batch",
    "lr",
    "head_lr",
    "train_loss",
    "val_loss",
    "val_auroc_mean",
    "images_per_s",
    "data_wait_s",
    "bytes_sent",
)


def _final_table(history: Any, width: int = 100) -> str:
    """What ``dask-dl train`` prints last, within ``width`` columns: the settings that stayed the same over the run
    on one line, the mean metrics of every epoch, then the last epoch's validation AUROC of each label, as many
    ``label value`` pairs to a line as fit (14 labels as columns made a table 250 characters wide)."""
    from dask_dl.metrics import NO_AUROC_NOTE, auroc_text

    columns = [c for c in _TRAIN_COLUMNS if c in history]
    fixed = [c for c in ("global_batch", "lr", "head_lr") if c in columns and history[c].nunique(dropna=False) == 1]
    lines = ["  ".join(f"{c} {history[c].iloc[0]:.4g}" for c in fixed)] if fixed else []
    table = history[[c for c in columns if c not in fixed]]
    lines.append(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    labels = [c for c in history if c.startswith("val_auroc_") and c != "val_auroc_mean"]
    if labels:
        last = history.iloc[-1]
        pairs = [f"{c.removeprefix('val_auroc_')} {auroc_text(last[c])}" for c in labels]
        cell = max(len(p) for p in pairs) + 2
        per_line = max(1, (width + 2) // cell)
        lines.append(f"validation AUROC per label, epoch {int(last['epoch'])}:")
        lines += [
            "".join(p.ljust(cell) for p in pairs[i : i + per_line]).rstrip() for i in range(0, len(pairs), per_line)
        ]
        if last[labels].isna().any():
            lines.append(NO_AUROC_NOTE)
    return "\n".join(lines)


def _echo_training(run, shown: tuple[int, int, bool], interactive: bool) -> tuple[int, int, bool]:
    """Print ``--compression auto``'s choice once it is made, the restarts and the epochs since the last call (the
    terminal view prints its own epochs); return how many of each were printed and whether the choice was."""
    chosen = run.info.get("compression")
    if chosen and not shown[2]:
        click.echo(f"{run.run_id}: compression auto chose {chosen['name']}: {chosen['reason']}")
    restarts = run.restarts.to_dict("records")
    for row in restarts[shown[0] :]:
        when = (
            f"in epoch {row['failed_epoch']} step {row['failed_step']}"
            if row["failed_epoch"] >= 0
            else "before training started"
        )
        click.echo(
            f"{run.run_id}: lost {row['lost_workers'] or 'a trainer'} {when} ({row['error']}); went on "
            f"{row['seconds']:.1f} s later with {row['world_size']} trainer(s) from epoch {row['resumed_epoch']} "
            f"step {row['resumed_step']}, {row['steps_lost']} step(s) lost"
        )
    rows = run.history.to_dict("records")
    if not interactive:
        for row in rows[shown[1] :]:
            text = " ".join(
                f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}"
                for k in _TRAIN_COLUMNS
                if k in row
            )
            click.echo(f"{run.run_id} {text}" + (f" ({row['event']})" if row.get("event") else ""))
    return len(restarts), len(rows), bool(chosen)


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
            out,
            images=images,
            size=size,
            epochs=epochs,
            model=model,
            trainers=trainers,
            compression=compression,
            batch_size=batch_size,
            data=data,
            seed=seed,
            scheduler=scheduler,
            workers=workers,
            view="log" if quiet else "auto",
        )
    except KeyboardInterrupt:
        raise Interrupted(
            f"demo stopped by Ctrl-C; run the same command again to go on: it keeps what it finished under {out} "
            "(the synthetic collection, the shards of the store) and trains anew"
        ) from None
    click.echo(str(report))

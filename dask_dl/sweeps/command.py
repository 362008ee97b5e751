"""``dask-dl sweep STORE --space space.yaml``: a sweep from the shell, a line per finished trial, the best last.

The space file is YAML (:func:`dask_dl.sweeps.space.space_from_yaml`)::

    lr: {low: 1.0e-4, high: 0.3, log: true}   # a float range (log scale)
    epochs: {low: 1, high: 5, step: 1}        # integer bounds: an integer range
    model: [small_cnn, resnet18]              # a list: a choice
    batch_size: 16                            # anything else: fixed for every trial
    model_kwargs: {width: 8}
"""

from __future__ import annotations

import time
from typing import Any

import click

from dask_dl.sweeps.choices import PRUNERS, SAMPLERS

__all__ = ["sweep_command"]


@click.command("sweep")
@click.argument("store")
@click.option(
    "--space",
    "space_file",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="YAML file of fit options to search (ranges, lists of choices, fixed values).",
)
@click.option(
    "--trials", type=int, default=20, show_default=True, help="Trials in all (a resumed sweep counts those done)."
)
@click.option("--metric", default="val_auroc_mean", show_default=True, help="History column that judges a trial.")
@click.option("--direction", type=click.Choice(["maximize", "minimize"]), default="maximize", show_default=True)
@click.option("--pruner", type=click.Choice(PRUNERS), default="asha", show_default=True, help="Stops losing trials.")
@click.option("--sampler", type=click.Choice(SAMPLERS), default="tpe", show_default=True, help="Chooses the options.")
@click.option("--trainers-per-trial", type=int, default=1, show_default=True, help="Workers of each trial.")
@click.option("--max-concurrent", type=int, default=None, help="At most this many trials at once.")
@click.option("--storage", default=None, help="Optuna storage: an SQLite file path or an RDB URL (resumable).")
@click.option("--resume", is_flag=True, help="Continue the sweep kept in --storage.")
@click.option(
    "--checkpoint-dir", default=None, help="Folder of the trials' checkpoint folders (default: beside --storage)."
)
@click.option(
    "--workers", "-w", type=int, default=None, help="Workers of the local cluster started without --scheduler."
)
@click.option("--scheduler", default=None, metavar="ADDRESS", help="Address of a running Dask scheduler.")
def sweep_command(
    store: str,
    space_file: str,
    trials: int,
    metric: str,
    direction: str,
    pruner: str,
    sampler: str,
    trainers_per_trial: int,
    max_concurrent: int | None,
    storage: str | None,
    resume: bool,
    checkpoint_dir: str | None,
    workers: int | None,
    scheduler: str | None,
) -> None:
    """Search fit's options on STORE: trials side by side on the cluster, losers pruned, best trial last.

    Prints a line per finished trial (complete, pruned or failed), then the best trial's options and checkpoint.
    With --storage, a sweep that was killed goes on with --resume.
    """
    import yaml

    from dask_dl.cluster import connect
    from dask_dl.data.dataset import open_dataset
    from dask_dl.sweeps.run import sweep
    from dask_dl.sweeps.space import space_from_yaml

    with open(space_file, encoding="utf-8") as f:
        space, fixed = space_from_yaml(yaml.safe_load(f))
    if checkpoint_dir is not None:
        fixed["checkpoint_dir"] = checkpoint_dir
    with connect(scheduler=scheduler, n_workers=workers) as client:
        running = sweep(
            open_dataset(store),
            space,
            trials=trials,
            metric=metric,
            direction=direction,
            pruner=pruner,
            sampler=sampler,
            trainers_per_trial=trainers_per_trial,
            max_concurrent=max_concurrent,
            storage=storage,
            resume=resume,
            client=client,
            wait=False,
            **fixed,
        )
        shown: set[int] = set()
        try:
            while True:
                done = running.done
                shown |= _echo_finished(running, shown, metric)
                if done:
                    break
                time.sleep(1.0)
        except KeyboardInterrupt:
            running.stop().wait()
            raise
        running.wait()
        best = running.best
        click.echo(f"best: trial {best.number} {metric}={best.metric:.4f} {_params(best.params)}")
        click.echo(f"checkpoint: {best.checkpoint}")


def _params(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _echo_finished(running: Any, shown: set[int], metric: str) -> set[int]:
    """Print a line for each trial that ended since the last call; return the numbers printed."""
    results = running.results
    printed = set()
    for _, row in results.iterrows():
        if row["number"] in shown or row["state"] not in ("complete", "pruned", "failed"):
            continue
        epochs = int(row["epochs"])
        line = f"trial {row['number']} {row['state']} after {epochs} epoch{'' if epochs == 1 else 's'}: "
        line += _params(row["params"])
        if row["state"] == "failed":
            line += f" ({row['error']})"
        else:
            line += f" {metric}={row['best']:.4f}"
        click.echo(line)
        printed.add(row["number"])
    return printed

"""``dask-dl xsite``: one model trained across sites that keep their images (dask_dl.sites)."""

from __future__ import annotations

import sys

import click

from dask_dl.cli.group import cli
from dask_dl.cli.options import quiet_option, scheduler_option
from dask_dl.cli.session import connect, follow


@cli.command("xsite")
@click.argument("plan", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--protocol",
    "-p",
    type=click.Choice(["ensemble", "incremental", "cyclic", "fedavg", "fedprox"]),
    default=None,
    help="Overrides the file's protocol.",
)
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
    with connect(scheduler, workers) as client:
        sites, options = read_plan_file(plan)  # opens the shared cluster's stores, with its client current
        run = fit_sites(sites, client=client, wait=False, **{**options, **overrides})
        interrupted = follow(run, lambda shown: _echo_rounds(run, shown, quiet), "stopping the sites' trainers")
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

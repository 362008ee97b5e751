"""``dask-dl info``: the version, the settings in force and the optional extras installed."""

from __future__ import annotations

import importlib.util

import click

from dask_dl.cli.group import cli


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
        ("sweep", "optuna"),
        ("tracking", "mlflow"),
        ("augment", "kornia"),
        ("notebook", "jupyterlab"),
    ]:
        found = importlib.util.find_spec(module) is not None
        click.echo(f"  extra {extra:11s} {'installed' if found else 'not installed'} ({module})")
    click.echo(yaml.safe_dump({"dask-dl": dask.config.get("dask-dl")}, sort_keys=False).rstrip())

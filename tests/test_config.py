import os

import dask.config

from dask_dl import config


def test_defaults_are_registered():
    assert dask.config.get("dask-dl.ingest.size") == 224
    assert dask.config.get("dask-dl.split.val-fraction") == 0.1


def test_get_prefers_value_then_config():
    assert config.get("train.epochs", 3) == 3
    with dask.config.set({"dask-dl.train.epochs": 7}):
        assert config.get("train.epochs") == 7
    assert config.get("train.epochs") == 5


def test_environment_variable_as_documented():
    """docs/reference/config.md's spelling reaches dask-dl.train.epochs (DASK_DL__... would be the key dl.*)."""
    import subprocess
    import sys

    code = "from dask_dl import config; print(config.get('train.epochs'))"
    env = {**os.environ, "DASK_DASK_DL__TRAIN__EPOCHS": "11"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "11"

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

"""The live views of a run: HTML content, terminal bar, log lines."""

import logging

from dask_dl.train.view import RunView, snapshot_html

SNAP = {
    "run_id": "fit-1",
    "status": "running",
    "model": "small_cnn",
    "compression": "onebit",
    "global_batch": 64,
    "epoch": 1,
    "epochs": 3,
    "step": 4,
    "steps_per_epoch": 10,
    "loss": 0.4321,
    "images_per_s": 250.0,
    "data_wait_share": 0.031,
    "bytes_sent": 123456,
    "history": [
        {
            "epoch": 0,
            "train_loss": 0.69,
            "val_loss": 0.6,
            "val_auroc_mean": 0.71,
            "val_auroc_Nodule": 0.8,
            "val_auroc_Hernia": float("nan"),
            "bytes_sent": 1000,
        },
    ],
}


def test_html_has_the_numbers():
    page = snapshot_html(SNAP)
    assert "fit-1" in page and "onebit" in page and "global batch 64" in page
    assert "epoch 2/3" in page and "step 4/10" in page
    assert "0.4321" in page and "3.1%" in page and "123,456" in page
    assert "<td>Nodule</td><td>0.8</td>" in page
    assert "<td>Hernia</td><td>n/a</td>" in page  # a label without positives has no AUROC


def test_html_escapes():
    assert "<script>" not in snapshot_html({"run_id": "<script>", "error": "<b>x</b>"})


def test_log_mode_logs_each_epoch_once(caplog):
    view = RunView("log")
    with caplog.at_level(logging.INFO, logger="dask_dl.train"):
        view.update(SNAP)
        view.update(SNAP)
        view.update({**SNAP, "history": SNAP["history"] + [{"epoch": 1, "train_loss": 0.5}]})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "fit-1 epoch=0 train_loss=0.69 val_loss=0.6 val_auroc_mean=0.71 bytes_sent=1,000",
        "fit-1 epoch=1 train_loss=0.5",
    ]


def test_terminal_bar_counts_steps(capsys):
    view = RunView("terminal")
    view.update(SNAP)
    assert view._bar.total == 30 and view._bar.n == 14
    view.update({**SNAP, "epoch": 2, "step": 10})
    assert view._bar.n == 30
    view.close()


def test_unknown_view_is_a_configuration_error():
    import pytest

    from dask_dl import ConfigurationError

    with pytest.raises(ConfigurationError, match="unknown view 'fancy': use one of auto, notebook"):
        RunView("fancy")

"""The dask-dl command's error handling: one line and exit status 1 for expected failures, tracebacks for bugs.

Real stores (written as ingest lays them out), real checkpoint files, a real LocalCluster for ``train``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from dask_dl.cli import cli
from dask_dl.errors import CheckpointError
from dask_dl.interrupt import Interrupted
from dask_dl.testing.data import write_store
from dask_dl.testing.interrupt import ctrl_c_in_a_finalizer


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "s.zarr"
    return str(write_store(path, n=24, size=32, chunk=4, split_of=lambda i: "train" if i < 16 else "val"))


def _one_line_error(result, *fragments: str) -> str:
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert "Traceback" not in result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.slow
def test_train_resume_from_damaged_or_hostile_checkpoint(store, cluster_client, tmp_path):
    runner = CliRunner()
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "epoch-0000.pt").write_bytes(b"PK\x03\x04" + b"\0" * 100)  # a damaged zip, no manifest
    args = ["train", store, "--checkpoint-dir", str(ck), "--resume", "--epochs", "2", "-b", "4", "--quiet"]
    args += ["--scheduler", cluster_client.scheduler.address]
    _one_line_error(runner.invoke(cli, args), "no usable checkpoint", "epoch-0000.pt' is damaged or not a torch file")

    torch.save({"format": 1, "evil": os.system}, ck / "epoch-0000.pt")
    line = _one_line_error(runner.invoke(cli, args), "holds objects other than tensors and plain data")
    assert "weights_only" not in line

    result = runner.invoke(cli, ["--debug", *args])  # --debug: the error itself, with its traceback
    assert result.exit_code == 1 and isinstance(result.exception, CheckpointError)


@pytest.mark.slow
def test_ctrl_c_stops_training_and_exits_130_even_when_pressed_in_a_finalizer(store, cluster_client):
    # the follow loop allocates as it prints; Python's own handler would raise the press into a finalizer there,
    # which loses it, and the 500 epochs would go on (dask_dl.interrupt)
    args = ["train", store, "-b", "4", "--quiet", "--scheduler", cluster_client.scheduler.address]
    with ctrl_c_in_a_finalizer("_echo_training"):
        result = CliRunner().invoke(cli, [*args, "--epochs", "500"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 130, result.output
    assert "stopping the trainers within a few steps ..." in lines
    assert lines[-1].endswith(": stopped"), result.output
    again = CliRunner().invoke(cli, [*args, "--epochs", "1"])  # the trainers freed their workers
    assert again.exit_code == 0, again.output
    assert again.output.strip().splitlines()[-1].endswith(": finished"), again.output


def test_predict_with_bad_onnx_metadata(store, tmp_path):
    from dask_dl.export import export_onnx
    from dask_dl.models import build_model

    net = build_model("small_cnn", num_outputs=3, width=4).eval()
    path = tmp_path / "m.onnx"
    export_onnx(net, path, labels=["Atelectasis", "Effusion", "Mass"], input_size=32)
    proto = onnx.load(str(path))
    for prop in proto.metadata_props:
        if prop.key == "dask_dl":
            prop.value = json.dumps({"input_size": 32})
    onnx.save(proto, str(path))
    result = CliRunner().invoke(cli, ["predict", store, str(path), "--out", str(tmp_path / "p.parquet")])
    _one_line_error(result, "m.onnx' has dask_dl metadata without ['labels']")


def test_bugs_keep_their_traceback(monkeypatch, store):
    import dask_dl.data.dataset

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(dask_dl.data.dataset, "summary", broken)
    result = CliRunner().invoke(cli, ["summary", store])
    assert result.exit_code == 1 and isinstance(result.exception, ZeroDivisionError)
    assert not result.output.startswith("error: ")


@pytest.mark.parametrize(
    ("raised", "said"),
    [
        (KeyboardInterrupt(), "stopped by Ctrl-C"),
        (
            Interrupted("ingest into 's.zarr' stopped by Ctrl-C with 3 of 8 shards written; ..."),
            "ingest into 's.zarr' stopped by Ctrl-C with 3 of 8 shards written; ...",
        ),
    ],
)
def test_ctrl_c_ends_any_command_with_130_and_what_it_kept(monkeypatch, store, raised, said):
    """Status 130, as shells report Ctrl-C (click alone says "Aborted!" and exits with 1), with --debug too."""
    import dask_dl.data.dataset

    def pressed(*args, **kwargs):
        raise raised

    monkeypatch.setattr(dask_dl.data.dataset, "summary", pressed)
    for debug in ([], ["--debug"]):
        result = CliRunner().invoke(cli, [*debug, "summary", store])
        assert (result.exit_code, result.output) == (130, said + "\n")


def test_a_stopped_demo_says_that_running_it_again_goes_on(monkeypatch, tmp_path):
    import dask_dl.demo

    def pressed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dask_dl.demo, "run_demo", pressed)
    result = CliRunner().invoke(cli, ["demo", str(tmp_path / "demo")])
    assert (result.exit_code, result.output) == (
        130,
        f"demo stopped by Ctrl-C; run the same command again to go on: it keeps what it finished under "
        f"{tmp_path / 'demo'} (the synthetic collection, the shards of the store) and trains anew\n",
    )


@pytest.mark.slow  # the installed command twice, each with a local cluster of its own
def test_train_and_export_a_model_of_your_own_from_the_current_folder(store, tmp_path, monkeypatch):
    """``dask-dl train -m mymodels:build`` in the folder of mymodels.py, as `python -m` would import it: the local
    cluster's worker processes import it too, and ``dask-dl export`` rebuilds the model from the checkpoint."""
    dask_dl = Path(sys.executable).with_name("dask-dl")  # the installed command: its sys.path lacks the folder
    work = tmp_path / "work"
    work.mkdir()
    (work / "mymodels.py").write_text(
        "from dask_dl.testing.models import TinyNet\n\n\n"
        "def build(num_outputs):\n"
        "    return TinyNet(num_outputs, width=3)\n"
    )

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(dask_dl), *args], cwd=work, capture_output=True, text=True, timeout=240)

    trained = run(
        "train",
        store,
        "-m",
        "mymodels:build",
        "-e",
        "1",
        "-b",
        "4",
        "-t",
        "1",
        "-w",
        "1",
        "-q",
        "--checkpoint-dir",
        "ck",
    )
    assert trained.returncode == 0, trained.stderr
    assert trained.stdout.strip().splitlines()[-1].endswith(": finished"), trained.stdout
    checkpoint = torch.load(work / "ck" / "epoch-0000.pt", weights_only=True)
    assert checkpoint["model_source"]["path"] == "mymodels:build"
    assert checkpoint["model"]["conv1.weight"].shape[0] == 3

    exported = run("export", "ck", "m.onnx")
    assert exported.returncode == 0 and exported.stdout.startswith("wrote m.onnx: mymodels:build, 32 px"), exported

    monkeypatch.chdir(tmp_path)  # elsewhere: the command's folder has no mymodels.py
    monkeypatch.setattr(sys, "path", list(sys.path))
    elsewhere = CliRunner().invoke(cli, ["export", str(work / "ck"), str(tmp_path / "m.onnx")])
    assert _one_line_error(elsewhere) == (
        "error: the model is built by 'mymodels:build', which does not import here (ModuleNotFoundError: No module "
        "named 'mymodels'): run where it imports (from the module's folder, or with it on PYTHONPATH or installed), "
        "or pass the model again (export_onnx(checkpoint, path, model=...))"
    )


def test_model_option_takes_names_and_import_paths():
    result = CliRunner().invoke(cli, ["train", "s.zarr", "-m", "resnet1"])
    assert result.exit_code == 2
    assert "'resnet1' is no model: name one of small_cnn, alexnet, resnet18" in result.output
    assert "or give torchvision:NAME, timm:NAME or the import path module:function" in result.output
    help_text = " ".join(CliRunner().invoke(cli, ["train", "--help"]).output.split())
    assert "--model [small_cnn|alexnet|resnet18|resnet50|densenet121|torchvision:NAME|timm:NAME|MODULE:FUNCTION]" in (
        help_text
    )


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("0.5", "'0.5' is no normalization: give MEAN:STD (e.g. 0.5:0.25, or per channel"),
        ("x:y", "'x:y' is no normalization"),
        ("0.5:0", "'0.5:0': every STD must be above 0, and the store has 1 channel(s): give one MEAN and one STD"),
        ("0.4,0.5:0.2", "'0.4,0.5:0.2': every STD must be above 0, and the store has 1 channel(s)"),
        ("imagenet", "imagenet is ImageNet's mean and std of R, G and B, and this store has 1 channel(s)"),
    ],
)
def test_a_normalization_that_does_not_fit_the_store_is_refused_before_any_cluster(store, given, said):
    result = CliRunner().invoke(cli, ["train", store, "--normalization", given, "--scheduler", "tcp://nowhere:1"])
    assert result.exit_code == 2, result.output  # a usage error, before connecting to the (absent) scheduler
    assert said in " ".join(result.output.split())


@pytest.mark.slow
def test_train_with_the_normalization_given_or_measured(store, cluster_client, tmp_path):
    import dask_dl

    args = ["train", store, "-e", "1", "-b", "4", "-q", "--scheduler", cluster_client.scheduler.address]
    for given, expected in [
        ("0.53:0.23", {"mean": 0.53, "std": 0.23}),
        ("stats", dask_dl.normalize.channel_stats(dask_dl.open_dataset(store))),
    ]:
        ck = tmp_path / given.replace(":", "_")
        result = CliRunner().invoke(cli, [*args, "--normalization", given, "--checkpoint-dir", str(ck)])
        assert result.exit_code == 0, result.output
        assert torch.load(ck / "epoch-0000.pt", weights_only=True)["normalization"] == expected
    assert f"normalization of the train split: mean {expected['mean']}, std {expected['std']}" in result.output


def test_train_from_start_weights_says_what_it_loaded_and_the_head_rate(store, cluster_client, tmp_path):
    import dask_dl

    torch.save(dask_dl.build_model("small_cnn", num_outputs=1000, in_channels=3).state_dict(), tmp_path / "pre.pt")
    args = ["train", store, "-e", "1", "-b", "4", "-q", "--scheduler", cluster_client.scheduler.address]
    result = CliRunner().invoke(cli, [*args, "--weights", str(tmp_path / "pre.pt"), "--head-lr", "0.01"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert " lr=0.003 head_lr=0.01 train_loss=" in lines[0]
    assert lines[1] == (
        f"weights {str(tmp_path / 'pre.pt')!r}: 1 adapted (features.0.weight), 2 reinitialized (fc.bias, fc.weight), "
        "0 missing, 0 unexpected"
    )


def test_info_lists_every_extra_of_the_package():
    import importlib.util
    import tomllib

    extras = set(
        tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ) - {"dev"}
    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    listed = {line.split()[1]: line for line in result.output.splitlines() if line.startswith("  extra ")}
    assert set(listed) == extras
    captum = importlib.util.find_spec("captum") is not None
    assert listed["explain"].split()[2:] == (["installed", "(captum)"] if captum else ["not", "installed", "(captum)"])


@pytest.mark.slow
def test_upload_sends_your_model_to_workers_that_cannot_import_it(store, cluster_client, tmp_path, monkeypatch):
    name = f"netmod_{os.getpid()}_{tmp_path.name.replace('-', '_')}"
    source = tmp_path / f"{name}.py"
    source.write_text(
        "from dask_dl.testing.models import TinyNet\n\n\ndef build(num_outputs):\n    return TinyNet(num_outputs)\n"
    )
    monkeypatch.chdir(tmp_path)  # the command imports the model from the current folder
    monkeypatch.setattr(sys, "path", list(sys.path))
    args = [
        "train",
        store,
        "-m",
        f"{name}:build",
        "-e",
        "1",
        "-b",
        "4",
        "-t",
        "2",
        "-q",
        "--scheduler",
        cluster_client.scheduler.address,
    ]
    try:
        refused = CliRunner().invoke(cli, args)  # the cluster's workers were started elsewhere
        line = _one_line_error(refused, f"needs module '{name}', which 2 of 2 worker(s) cannot import")
        assert line.endswith(f"(dask-dl train --upload {source})")
        sent = CliRunner().invoke(cli, [*args, "--upload", str(source)])
        assert sent.exit_code == 0, sent.output
        assert sent.output.splitlines()[-1].endswith(": finished")
        broken = tmp_path / "broken_mod.py"
        broken.write_text("import dask_dl_no_such_dependency\n")
        _one_line_error(
            CliRunner().invoke(cli, [*args, "--upload", str(broken)]),
            f"--upload {broken}: the workers could not import it (",
        )
        plugins = cluster_client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.worker_plugins))
        assert f"dask-dl-upload-{source.name}" in plugins and "dask-dl-upload-broken_mod.py" not in plugins
    finally:
        sys.modules.pop(name, None)


def test_the_final_table_of_train_fits_100_columns_with_every_label():
    from dask_dl.cli.train import _final_table
    from dask_dl.data.schema import NIH_LABELS
    from dask_dl.metrics import NO_AUROC_NOTE

    per_label = {f"val_auroc_{label}": 0.5 + 0.01 * i for i, label in enumerate(NIH_LABELS)}
    rows = [
        dict(
            epoch=e,
            global_batch=64,
            lr=0.001 * (e + 1),
            train_loss=0.3,
            val_loss=0.31,
            val_auroc_mean=0.71,
            images_per_s=812.3,
            data_wait_s=0.12,
            bytes_sent=123456,
            **per_label,
        )
        for e in range(5)
    ]
    lines = _final_table(pd.DataFrame(rows)).splitlines()
    assert max(map(len, lines)) <= 100
    assert lines[0] == "global_batch 64"  # the same every epoch; lr changed, so it stays a column
    assert lines[1].split() == [
        "epoch",
        "lr",
        "train_loss",
        "val_loss",
        "val_auroc_mean",
        "images_per_s",
        "data_wait_s",
        "bytes_sent",
    ]
    assert lines[7] == "validation AUROC per label, epoch 4:"
    pairs = " ".join(lines[8:]).split()
    assert dict(zip(pairs[::2], pairs[1::2], strict=True)) == {
        label: f"{0.5 + 0.01 * i:.3f}" for i, label in enumerate(NIH_LABELS)
    }

    # a label without a positive validation image has no AUROC: "-" and the line that says why, not "nan"
    rows[-1]["val_auroc_Hernia"] = float("nan")
    lines = _final_table(pd.DataFrame(rows)).splitlines()
    pairs = " ".join(lines[8:-1]).split()
    assert dict(zip(pairs[::2], pairs[1::2], strict=True))["Hernia"] == "-"
    assert lines[-1] == NO_AUROC_NOTE

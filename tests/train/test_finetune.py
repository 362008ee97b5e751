"""Start from pretrained weights and fine-tune: weights files, frozen backbone, head learning rate, schedules.

Every test saves its own "pretrained" weights first (nothing downloads). Training runs use the squares
collection (32 px, 2 labels) on a real cluster with two gloo trainers.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from dask_dl import CheckpointError, ConfigurationError
from dask_dl.checkpoint import load_checkpoint
from dask_dl.models import build_model
from dask_dl.models.weights import load_weights, read_state_dict
from dask_dl.testing.train import fit_squares
from dask_dl.train.tuning import Tuner, check_schedule, schedule_factor

SIZE = 32
SMALL = {"width": 8}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """An "ImageNet" small_cnn: three input channels and five classes, saved as a state dict."""
    torch.manual_seed(11)
    net = build_model("small_cnn", num_outputs=5, in_channels=3, **SMALL)
    with torch.no_grad():  # running statistics that differ from a fresh model's
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    path = str(tmp_path_factory.mktemp("weights") / "pretrained.pt")
    torch.save(net.state_dict(), path)
    return path, {k: v.clone() for k, v in net.state_dict().items()}


# ---- reading weights ---------------------------------------------------------------------------------------


def test_load_weights_adapts_first_layer_and_reinitializes_the_head(pretrained, tmp_path):
    path, state = pretrained
    net = build_model("small_cnn", num_outputs=2, in_channels=1, **SMALL)
    fresh_head = net.fc.weight.detach().clone()
    report = load_weights(net, path)
    assert report == {
        "missing": [],
        "unexpected": [],
        "adapted": ["features.0.weight"],
        "reinitialized": ["fc.bias", "fc.weight"],
    }
    torch.testing.assert_close(net.features[0].weight, state["features.0.weight"].sum(dim=1, keepdim=True))
    torch.testing.assert_close(net.features[1].running_var, state["features.1.running_var"])
    assert torch.equal(net.fc.weight, fresh_head)
    # grey to colour: repeated over the channels and divided by them
    grey = str(tmp_path / "grey.pt")
    torch.save(net.state_dict(), grey)
    colour = build_model("small_cnn", num_outputs=2, in_channels=3, **SMALL)
    assert load_weights(colour, grey)["adapted"] == ["features.0.weight"]
    torch.testing.assert_close(colour.features[0].weight.sum(dim=1, keepdim=True), net.features[0].weight)


def test_load_weights_reads_checkpoints_and_wrapped_state_dicts(tmp_path):
    net = build_model("small_cnn", num_outputs=2, **SMALL)
    wrapped = {"state_dict": {f"module.{k}": v for k, v in net.state_dict().items()}, "epoch": 3}
    torch.save(wrapped, tmp_path / "wrapped.pt")
    assert read_state_dict(tmp_path / "wrapped.pt").keys() == net.state_dict().keys()
    torch.save({"format": 1, "model": net.state_dict(), "epoch": 0}, tmp_path / "checkpoint.pt")  # dask_dl's
    assert read_state_dict(f"file://{tmp_path}/checkpoint.pt").keys() == net.state_dict().keys()  # fsspec URLs
    extra = {**net.state_dict(), "aux.weight": torch.zeros(3)}
    del extra["fc.bias"]
    torch.save(extra, tmp_path / "extra.pt")
    other = build_model("small_cnn", num_outputs=2, **SMALL)
    report = load_weights(other, tmp_path / "extra.pt")
    assert (report["missing"], report["unexpected"]) == (["fc.bias"], ["aux.weight"])
    assert torch.equal(other.fc.weight, net.fc.weight)


def test_load_weights_refuses_other_shapes_and_objects(tmp_path):
    wide = build_model("small_cnn", num_outputs=2, width=16)
    torch.save(wide.state_dict(), tmp_path / "wide.pt")
    with pytest.raises(ConfigurationError, match=r"features\.3\.weight: file \(32, 16, 3, 3\), model \(16, 8, 3, 3\)"):
        load_weights(build_model("small_cnn", num_outputs=2, **SMALL), tmp_path / "wide.pt")

    class Payload:
        def __reduce__(self):
            return (print, ("owned",))

    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"w": Payload()}, protocol=2))
    with pytest.raises(CheckpointError, match="refused|not a torch file"):
        read_state_dict(tmp_path / "evil.pt")
    torch.save({"note": "no tensors"}, tmp_path / "empty.pt")
    with pytest.raises(CheckpointError, match="hold no tensors"):
        read_state_dict(tmp_path / "empty.pt")


# ---- schedules ---------------------------------------------------------------------------------------------


def _torch_lrs(make, steps: int) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    scheduler = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


def test_schedules_match_torch():
    total = 40
    onecycle = _torch_lrs(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=total), total)
    ours = [schedule_factor(check_schedule("onecycle"), t, total) for t in range(total)]
    np.testing.assert_allclose(ours, onecycle, rtol=1e-6, atol=1e-9)
    cosine = _torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total), total)
    np.testing.assert_allclose(
        [schedule_factor(check_schedule("cosine"), t, total) for t in range(total)], cosine, rtol=1e-6, atol=1e-9
    )
    warm = check_schedule({"name": "warmup-cosine", "warmup_steps": 4})
    assert [schedule_factor(warm, t, total) for t in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert schedule_factor(warm, total - 1, total) == pytest.approx(0.5 * (1 + math.cos(math.pi * 35 / 36)))


def test_schedule_errors():
    with pytest.raises(ConfigurationError, match="unknown schedule 'linear'"):
        check_schedule("linear")
    with pytest.raises(ConfigurationError, match=r"has no option\(s\) \['warmup'\]; its options are"):
        check_schedule({"name": "warmup-cosine", "warmup": 3})
    with pytest.raises(ConfigurationError, match="factor=2 is out of range"):
        check_schedule({"name": "plateau", "factor": 2})


def test_plateau_lowers_the_rate_after_patience_epochs():
    net = build_model("small_cnn", num_outputs=2, **SMALL)
    tuner = Tuner(
        net,
        head=None,
        lr=0.1,
        head_lr=None,
        freeze_epochs=0,
        total_steps=10,
        schedule=check_schedule({"name": "plateau", "patience": 1, "factor": 0.5}),
    )
    opt = torch.optim.SGD(tuner.param_groups(), lr=0.1)
    seen = []
    for loss in (1.0, 0.9, 0.95, 0.95, 0.8, 0.9, 0.9):
        tuner.end_epoch(loss, opt)
        seen.append(opt.param_groups[0]["lr"])
    np.testing.assert_allclose(seen, [0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025])


# ---- fine-tuning runs --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_frozen_backbone_stays_as_loaded_under_onebit(store, cluster_client, pretrained):
    path, state = pretrained
    run = fit_squares(
        store, cluster_client, weights=path, freeze_epochs=1, head_lr=0.2, compression="onebit", warmup_steps=0
    )
    assert run.info["weights"]["reinitialized"] == ["fc.bias", "fc.weight"]
    assert run.info["weights"]["adapted"] == ["features.0.weight"]
    trained = run.checkpoint()["model"]
    for key, value in trained.items():
        if key.startswith("fc."):
            continue
        want = state[key].sum(dim=1, keepdim=True) if key == "features.0.weight" else state[key]
        assert torch.equal(value, want), key  # weights and BatchNorm statistics: exactly as loaded
    row = run.history.iloc[0]
    assert (row["lr"], row["head_lr"]) == (0.0, 0.2)
    assert run.history["bytes_sent"].iloc[0] > 0
    assert not torch.equal(trained["fc.weight"], build_model("small_cnn", num_outputs=2, **SMALL).fc.weight)


@pytest.mark.slow
def test_thawed_backbone_trains_and_weights_that_do_not_fit_fail_first(store, cluster_client, pretrained, tmp_path):
    path, state = pretrained
    run = fit_squares(store, cluster_client, weights=path, freeze_epochs=1, epochs=2)
    first_conv = run.checkpoint()["model"]["features.3.weight"]
    assert not torch.equal(first_conv, state["features.3.weight"])  # the second epoch trained the backbone
    assert list(run.history["lr"]) == [0.0, 0.05]
    wide = str(tmp_path / "wide.pt")
    torch.save(build_model("small_cnn", num_outputs=2, width=16).state_dict(), wide)
    with pytest.raises(ConfigurationError, match=r"do not fit model 'small_cnn'.*file \(32, 16, 3, 3\)"):
        fit_squares(store, cluster_client, weights=wide)


def test_schedule_survives_resume(store, cluster_client, tmp_path):
    schedule = {"name": "warmup-cosine", "warmup_steps": 2}
    directory = tmp_path / "ck"
    whole = fit_squares(store, cluster_client, epochs=2, schedule=schedule, checkpoint_dir=str(directory))
    lrs = list(whole.history["lr"])
    assert lrs[0] > lrs[1] > 0
    assert load_checkpoint(str(directory / "epoch-0000.pt"))["tuning"]["step"] == 4  # 64 images / (8 x 2)
    for name in ("epoch-0001.pt", "epoch-0001.pt.sha256"):  # as if the run had died during its second epoch
        (directory / name).unlink()
    resumed = fit_squares(
        store, cluster_client, epochs=2, schedule=schedule, checkpoint_dir=str(directory), resume=True
    )
    assert resumed.history["event"].iloc[1] == "resumed"
    assert list(resumed.history["lr"]) == lrs  # a schedule restarted at step 0 would be warming up again
    np.testing.assert_allclose(resumed.history["train_loss"], whole.history["train_loss"], rtol=1e-5)


@pytest.mark.slow
def test_cli_fine_tunes_from_a_weights_file(store, cluster_client, pretrained, tmp_path):
    from click.testing import CliRunner

    from dask_dl.cli import cli

    torch.save(build_model("small_cnn", num_outputs=5, in_channels=3).state_dict(), tmp_path / "w16.pt")
    args = [
        "train",
        store,
        "-m",
        "small_cnn",
        "-e",
        "1",
        "-b",
        "8",
        "-t",
        "2",
        "--freeze-epochs",
        "1",
        "--head-lr",
        "0.1",
        "--schedule",
        "cosine",
        "--precision",
        "bf16",
        "--quiet",
        "--scheduler",
        cluster_client.scheduler.address,
    ]
    result = CliRunner().invoke(cli, [*args, "--weights", str(tmp_path / "w16.pt")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    settings = next(i for i, line in enumerate(lines) if line.startswith("global_batch "))  # the same every epoch
    assert lines[settings].split()[::2] == ["global_batch", "lr", "head_lr"], result.output
    assert lines[settings + 1].split()[:2] == ["epoch", "train_loss"], result.output
    assert "validation AUROC per label, epoch 0:" in lines
    assert all(len(line) <= 100 for line in lines[settings:]), result.output  # fits a terminal, 14 labels too
    assert f"weights {str(tmp_path / 'w16.pt')!r}: 1 adapted (features.0.weight), 2 reinitialized" in result.output
    # the fixture's weights are of a narrower small_cnn (width 8) than the CLI's (16): one line, both shapes
    result = CliRunner().invoke(cli, [*args, "--weights", pretrained[0]])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "features.3.weight: file (16, 8, 3, 3), model (32, 16, 3, 3)" in result.output

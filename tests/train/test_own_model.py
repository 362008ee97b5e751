"""Bring your own model: modules by value, factories, losses and accumulation, on a real cluster with gloo.

The squares collection of ``test_fit`` (32 px, 64 train / 32 val images, labels ``a`` and ``b``), two trainers.
:class:`~dask_dl.testing.models.TinyNet` has no BatchNorm, so runs that differ only in how a step's images are
split (micro-batches) give the same weights.
"""

from __future__ import annotations

import re
import sys
import textwrap
import uuid

import cloudpickle
import numpy as np
import pytest
import torch
from torch import nn

import dask_dl
from dask_dl import ClusterError, ConfigurationError, ExportError, MissingDependencyError, TrainingError
from dask_dl.checkpoint import load_checkpoint
from dask_dl.models import nets
from dask_dl.models.source import adapt_first_conv, build_from_checkpoint, check_fits, head_name, model_source
from dask_dl.testing.models import TinyNet, broken_net, tiny_net

SIZE = 32

# a notebook's classes live in __main__ and travel by value; this module's classes must do the same on the workers
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NotebookNet(nn.Module):
    """A model defined where the user works (not importable by the workers)."""

    def __init__(self, outputs: int = 2, channels: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 4, 3, stride=2, padding=1)
        self.head = nn.Linear(4, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def fit(store, client, **kwargs):
    options = dict(epochs=1, batch_size=8, trainers=2, lr=0.05, optimizer="sgd")
    return dask_dl.fit(dask_dl.open_dataset(store), client=client, **{**options, **kwargs})


# ---- what a model is ---------------------------------------------------------------------------------------


def test_model_source_kinds():
    assert model_source("small_cnn", {"width": 8}).kind == "registry"
    module = model_source(NotebookNet())
    assert (module.kind, module.path) == ("module", None)
    factory = model_source(tiny_net, {"width": 2})
    assert (factory.kind, factory.path, factory.kwargs) == ("factory", "dask_dl.testing.models:tiny_net", {"width": 2})
    cls = model_source(TinyNet)  # a class is a factory
    assert (cls.kind, cls.path) == ("factory", "dask_dl.testing.models:TinyNet")
    assert cls.build(num_outputs=3, in_channels=2).conv1.in_channels == 2
    local = model_source(lambda: NotebookNet())
    assert local.kind == "factory" and local.path is None
    built = factory.build(num_outputs=3, in_channels=2)
    assert built(torch.zeros(1, 2, 32, 32)).shape == (1, 3) and built.conv1.out_channels == 2


def test_model_source_of_an_import_path_and_the_modules_the_workers_import():
    by_path = model_source("dask_dl.testing.models:tiny_net", {"width": 2})
    assert (by_path.kind, by_path.name, by_path.path) == ("factory", "dask_dl.testing.models:tiny_net", by_path.name)
    assert by_path.build(num_outputs=3, in_channels=1).conv1.out_channels == 2
    assert model_source("dask_dl.testing.models:TinyNet").path == "dask_dl.testing.models:TinyNet"
    assert by_path.modules() == ("dask_dl.testing.models",)
    assert model_source(TinyNet(2)).modules() == ("dask_dl.testing.models",)  # its class travels by reference
    assert model_source(NotebookNet()).modules() == ()  # this module is registered to travel by value
    assert model_source(lambda: NotebookNet()).modules() == ()
    assert model_source("small_cnn").modules() == ("dask_dl.models.nets",)


def test_model_source_errors():
    with pytest.raises(ConfigurationError, match="unknown model 'nope'"):
        model_source("nope")
    for bad in ("mymodels:", ":build", "my models:build", "mymodels:make.<locals>.build"):
        with pytest.raises(ConfigurationError, match=rf"model='{re.escape(bad)}' is no import path; pass 'module:"):
            model_source(bad)
    with pytest.raises(ConfigurationError, match=r"importing 'no_such_module_x' failed \(ModuleNotFoundError: No "):
        model_source("no_such_module_x:build")
    with pytest.raises(ConfigurationError, match=r"module 'dask_dl.testing.models' has no 'nothing'"):
        model_source("dask_dl.testing.models:nothing")
    with pytest.raises(ConfigurationError, match=r"'dask_dl.testing.models:__name__' is a str, not a function"):
        model_source("dask_dl.testing.models:__name__")
    with pytest.raises(ConfigurationError, match=r"model_kwargs=\{'width': 8\} cannot apply to a model passed as"):
        model_source(NotebookNet(), {"width": 8})
    with pytest.raises(ConfigurationError, match="model must be a name"):
        model_source(42)
    with pytest.raises(ConfigurationError, match="names no model"):
        model_source("timm:")


@pytest.mark.skipif(__import__("importlib").util.find_spec("torchvision") is not None, reason="torchvision installed")
def test_torchvision_name_without_torchvision_says_what_to_install():
    with pytest.raises(MissingDependencyError, match=r"pip install 'dask-dl\[torchvision\]'"):
        model_source("torchvision:resnet18")


def test_torchvision_model_is_adapted_to_channels_and_labels():
    pytest.importorskip("torchvision")
    net = model_source("torchvision:resnet18").build(num_outputs=2, in_channels=1)
    assert net.conv1.in_channels == 1 and net.fc.out_features == 2
    check_fits(net, name="torchvision:resnet18", in_channels=1, input_size=32, labels=("a", "b"))


def test_a_checkpoint_of_user_code_says_why_it_needs_that_code_again():
    def saved(kind, name):
        return {"labels": ["a"], "model_source": {"kind": kind, "name": name, "kwargs": {}, "path": None}}

    why = {
        ("module", "x.Net"): r"passed by value \(fit\(model=Net\(\.\.\.\)\)\)",
        ("factory", "__main__.big_net"): r"made by a function of your script or notebook \(__main__\), which",
        ("factory", "x.make.<locals>.net"): r"made by a function without an import path \(a local function or",
    }
    for (kind, name), reason in why.items():
        with pytest.raises(TrainingError, match=rf"user model '{name}', {reason}.*Pass the model again"):
            build_from_checkpoint(saved(kind, name))


def test_adapt_first_conv_and_head_name():
    net = nets.resnet18(5, in_channels=3)
    adapt_first_conv(net, 1)
    assert net.conv1.in_channels == 1 and net.conv1.out_channels == 64 and net.conv1.kernel_size == (7, 7)
    assert net(torch.zeros(2, 1, 32, 32)).shape == (2, 5)
    assert head_name(net) == "fc" and head_name(nets.DenseNet(2)) == "classifier"
    assert head_name(nets.AlexNet(2)) == "classifier.6"


def test_check_fits_names_both_shapes():
    with pytest.raises(ConfigurationError, match=r"returns \(2, 3\) for a batch of shape \(2, 1, 32, 32\).*\(2, 2\)"):
        check_fits(NotebookNet(outputs=3), name="n", in_channels=1, input_size=32, labels=("a", "b"))
    with pytest.raises(ConfigurationError, match=r"batch of shape \(2, 1, 32, 32\).*first layer must take 1 channel"):
        check_fits(NotebookNet(channels=3), name="n", in_channels=1, input_size=32, labels=("a", "b"))


# ---- training a user's model -------------------------------------------------------------------------------


@pytest.mark.slow
def test_module_by_value_trains_exports_and_needs_its_code_to_rebuild(store, cluster_client, tmp_path):
    mine = NotebookNet()
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    run = fit(store, cluster_client, model=mine, checkpoint_dir=str(tmp_path / "ck"))
    assert run.status == "finished" and np.isfinite(run.history["train_loss"]).all()
    assert all(torch.equal(before[k], v) for k, v in mine.state_dict().items())  # the user's module is untouched
    trained = run.model()
    assert isinstance(trained, NotebookNet) and trained is not mine
    ck = load_checkpoint(str(tmp_path / "ck"))
    assert ck["model_source"] == {"kind": "module", "name": f"{__name__}.NotebookNet", "kwargs": {}, "path": None}
    assert all(torch.equal(ck["model"][k], v) for k, v in trained.state_dict().items())
    with pytest.raises(ExportError, match=r"NotebookNet.*needs your code.*model=\.\.\."):
        dask_dl.export_onnx(ck, tmp_path / "a.onnx")
    dask_dl.export_onnx(ck, tmp_path / "b.onnx", model=NotebookNet())  # the module's weights are the checkpoint's
    dask_dl.export_onnx(run, tmp_path / "c.onnx")  # the run knows its module
    assert dask_dl.read_model_info(tmp_path / "c.onnx").labels == ("a", "b")


@pytest.mark.slow
def test_factory_with_import_path_is_rebuilt_and_resumed(store, cluster_client, tmp_path):
    directory = str(tmp_path / "ck")
    first = fit(store, cluster_client, model=tiny_net, model_kwargs={"width": 2}, checkpoint_dir=directory)
    ck = load_checkpoint(directory)
    assert ck["model_source"]["path"] == ck["model_name"] == "dask_dl.testing.models:tiny_net"
    rebuilt = build_from_checkpoint(ck)  # no user code needed: the factory is importable
    assert isinstance(rebuilt, TinyNet) and rebuilt.conv1.out_channels == 2
    assert build_from_checkpoint(ck, model=tiny_net).conv1.out_channels == 2  # passed again: the options stay
    dask_dl.export_onnx(directory, tmp_path / "m.onnx")
    second = fit(
        store,
        cluster_client,
        model=tiny_net,
        model_kwargs={"width": 2},
        checkpoint_dir=directory,
        resume=True,
        epochs=2,
    )
    assert list(second.history["epoch"]) == [0, 1] and second.history["event"].iloc[1] == "resumed"
    assert first.history["train_loss"].iloc[0] == second.history["train_loss"].iloc[0]


def test_a_model_that_does_not_fit_fails_before_training(store, cluster_client):
    with pytest.raises(ConfigurationError, match=r"returns \(2, 5\) for a batch of shape \(2, 1, 32, 32\)"):
        fit(store, cluster_client, model=NotebookNet(outputs=5))  # by value: checked on the driver

    def colour_net(num_outputs):
        return NotebookNet(outputs=num_outputs, channels=3)

    with pytest.raises(ConfigurationError, match=r"batch of shape \(2, 1, 32, 32\).*first layer must take 1"):
        fit(store, cluster_client, model=colour_net)  # a factory: checked on the trainers, before any epoch


def test_a_module_the_workers_cannot_import_is_refused_before_training_then_sent(
    store, cluster_client, tmp_path, monkeypatch
):
    """A model or loss from the user's own module travels by reference: each trainer imports the module. Before,
    a worker without it failed the run inside distributed, with its tracebacks and no word of the fix."""
    name = f"mymodels_{uuid.uuid4().hex[:8]}"
    source = tmp_path / f"{name}.py"
    source.write_text(
        textwrap.dedent("""
        import torch.nn.functional as F
        from dask_dl.testing.models import TinyNet

        def build(num_outputs):
            return TinyNet(num_outputs, width=2)

        def loss(logits, targets):
            return F.binary_cross_entropy_with_logits(logits, targets.float())
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver imports it; the running workers have no such path
    try:
        refused = rf"which 2 of 2 worker\(s\) cannot import \(worker tcp://\S+: no module named '{name}'; worker "
        fix = (
            rf"send it to them from Python before the run: client\.upload_file\('{re.escape(str(source))}'\) "
            rf"\(dask-dl train --upload {re.escape(str(source))}\)"
        )
        with pytest.raises(ClusterError, match=rf"^model '{name}:build' needs module '{name}', {refused}.*{fix}$"):
            fit(store, cluster_client, model=f"{name}:build")
        loss = __import__(name).loss
        with pytest.raises(ClusterError, match=rf"^loss '{name}:loss' needs module '{name}', {refused}"):
            fit(store, cluster_client, model=tiny_net, loss=loss)
        assert not cluster_client.run_on_scheduler(
            lambda dask_scheduler: [k for k in dask_scheduler.tasks if "dask-dl-trainer" in str(k)]
        )  # refused before any trainer was placed

        cluster_client.upload_file(str(source))  # the fix the message gives
        run = fit(store, cluster_client, model=f"{name}:build", loss=loss)
        assert run.status == "finished" and np.isfinite(run.history["train_loss"]).all()
        assert run.model().conv1.out_channels == 2
    finally:
        sys.modules.pop(name, None)


def test_a_module_whose_import_fails_only_on_the_workers_is_an_error_of_the_run(
    store, cluster_client, tmp_path, monkeypatch
):
    """The workers find the module (the check before the run passes) but importing it fails there: a dependency
    only the driver has. distributed leaves an actor call whose arguments fail to unpickle unanswered, so the
    trainers unpickle the run's spec themselves and say why they cannot (fit would otherwise wait for good)."""
    name = f"mymodels_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent("""
        import os
        if os.environ.get("DASK_DL_TEST_WORKER_LACKS_A_DEPENDENCY"):
            import dask_dl_no_such_dependency
        from dask_dl.testing.models import TinyNet

        def build(num_outputs):
            return TinyNet(num_outputs, width=2)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    folder = str(tmp_path)

    def lacking(on: bool) -> None:
        import os
        import sys

        if on:
            sys.path.insert(0, folder)
            os.environ["DASK_DL_TEST_WORKER_LACKS_A_DEPENDENCY"] = "1"
        else:
            sys.path.remove(folder)
            del os.environ["DASK_DL_TEST_WORKER_LACKS_A_DEPENDENCY"]

    cluster_client.run(lacking, True)
    try:
        cause = r"ModuleNotFoundError: No module named 'dask_dl_no_such_dependency'"
        with pytest.raises(
            ConfigurationError,
            match=rf"worker tcp://\S+ cannot load the run's model and options: "
            rf"{cause}\. The model or loss comes from a module",
        ):
            fit(store, cluster_client, model=f"{name}:build")
    finally:
        cluster_client.run(lacking, False)
        sys.modules.pop(name, None)
    assert fit(store, cluster_client, model=tiny_net).status == "finished"  # the trainers' workers are usable


# ---- losses ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_base_exception_on_a_trainer_reaches_the_driver_with_its_cause(store, cluster_client):
    """torch.distributed.checkpoint raises CheckpointException, a BaseException; Dask's actor calls pass on
    Exceptions only: without care the driver reports "Unable to contact Actor's worker" instead of the cause."""
    cause = r"RuntimeError: CheckpointException: rank 1: OSError: \[Errno 28\] No space left on device"
    with pytest.raises(TrainingError, match=rf"trainer \d on \S+ failed in epoch 0: {cause}") as failed:
        fit(store, cluster_client, model=broken_net, max_restarts=0)
    assert "Unable to contact" not in str(failed.value)
    assert fit(store, cluster_client, model=tiny_net).status == "finished"  # the workers are as good as new


@pytest.mark.slow
def test_loss_names_and_callables(store, cluster_client):
    base = dict(model=tiny_net, seed=3)
    default = fit(store, cluster_client, **base)

    def mean_bce(logits, targets):
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, targets)

    own = fit(store, cluster_client, loss=mean_bce, **base)
    assert own.options.task == "multilabel"
    np.testing.assert_allclose(own.history["train_loss"], default.history["train_loss"], rtol=1e-5)
    np.testing.assert_allclose(own.history["val_loss"], default.history["val_loss"], rtol=1e-5)
    single = fit(store, cluster_client, loss="ce", **base)
    assert single.options.task == "multiclass" and "val_accuracy" in single.history
    with pytest.raises(ConfigurationError, match="unknown loss 'l2'"):
        fit(store, cluster_client, loss="l2", **base)


# ---- accumulation ------------------------------------------------------------------------------------------


def test_accumulate_equals_the_larger_batch(store, cluster_client):
    common = dict(model=tiny_net, seed=5, lr=0.2, optimizer="sgd")
    big = fit(store, cluster_client, batch_size=8, **common)
    micro = fit(store, cluster_client, batch_size=4, accumulate=2, **common)
    assert list(micro.history["global_batch"]) == [16] == list(big.history["global_batch"])
    want, got = big.checkpoint()["model"], micro.checkpoint()["model"]
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compression", ["onebit", "powersgd"])
@pytest.mark.slow
def test_accumulate_with_compression_exchanges_once_per_step(store, cluster_client, compression):
    common = dict(model=tiny_net, compression=compression, warmup_steps=2, seed=4)
    big = fit(store, cluster_client, batch_size=8, **common)
    micro = fit(store, cluster_client, batch_size=4, accumulate=2, **common)
    assert np.isfinite(micro.history["train_loss"]).all()
    # the same 4 optimizer steps of the same gradients: the same bytes, and the same training within float noise
    assert micro.history["bytes_sent"].iloc[0] == big.history["bytes_sent"].iloc[0] > 0
    np.testing.assert_allclose(micro.history["train_loss"], big.history["train_loss"], rtol=1e-3)


def test_monai_network_through_a_factory():
    pytest.importorskip("monai")

    def monai_densenet(num_outputs, in_channels):
        from monai.networks.nets import DenseNet121

        return DenseNet121(spatial_dims=2, in_channels=in_channels, out_channels=num_outputs)

    source = model_source(monai_densenet)
    net = source.build(num_outputs=2, in_channels=1)
    check_fits(net, name=source.name, in_channels=1, input_size=32, labels=("a", "b"))
    with pytest.raises(ConfigurationError, match=r"returns \(2, 2\).*must return \(2, 3\)"):
        check_fits(net, name=source.name, in_channels=1, input_size=32, labels=("a", "b", "c"))


def test_own_models_and_memory_options_are_for_ddp(store, cluster_client):
    with pytest.raises(ConfigurationError, match=r"parallel='fsdp' needs a model of dask_dl's registry"):
        fit(store, cluster_client, model=tiny_net, parallel="fsdp")
    with pytest.raises(ConfigurationError, match=r"accumulate=2, precision='bf16' apply to parallel='ddp' only"):
        fit(store, cluster_client, model="small_cnn", parallel="fsdp", accumulate=2, precision="bf16")

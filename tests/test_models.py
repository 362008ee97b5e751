"""The model registry: torchvision's architectures (checked by parameter count), any input size, normalize."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dask_dl import ConfigurationError
from dask_dl.models import DEFAULT_NORMALIZATION, build_model, list_models, normalize

# torchvision's published parameter counts (3 input channels, 1000 classes) and the two layers that change:
# the first convolution (weights out * in * k * k, no bias except AlexNet's, which does not depend on in) and the
# head (features * classes + classes).
TORCHVISION = {
    # name: (params, first conv out channels, kernel, head in-features)
    "alexnet": (61_100_840, 64, 11, 4096),
    "resnet18": (11_689_512, 64, 7, 512),
    "resnet50": (25_557_032, 64, 7, 2048),
    "densenet121": (7_978_856, 64, 7, 1024),
}


def _expected_params(name: str, num_outputs: int, in_channels: int) -> int:
    total, out, k, feat = TORCHVISION[name]
    total += out * k * k * (in_channels - 3)
    return total - (feat * 1000 + 1000) + feat * num_outputs + num_outputs


def _n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_list_models():
    assert list_models() == ["small_cnn", "alexnet", "resnet18", "resnet50", "densenet121"]


@pytest.mark.parametrize("name", list(TORCHVISION))
@pytest.mark.parametrize(("num_outputs", "in_channels"), [(14, 1), (1000, 3), (2, 1)])
def test_parameter_counts_match_torchvision(name, num_outputs, in_channels):
    with torch.device("meta"):  # shapes only: no memory, no initialization
        model = build_model(name, num_outputs=num_outputs, in_channels=in_channels)
    assert _n_params(model) == _expected_params(name, num_outputs, in_channels)


def test_known_counts_for_chest_xray_heads():
    # 1 channel, 14 NIH findings
    with torch.device("meta"):
        assert _n_params(build_model("alexnet", num_outputs=14)) == 57_045_710
        assert _n_params(build_model("resnet18", num_outputs=14)) == 11_177_422
        assert _n_params(build_model("resnet50", num_outputs=14)) == 23_530_446
        assert _n_params(build_model("densenet121", num_outputs=14)) == 6_961_934


def test_torchvision_parameter_names():
    # same names as torchvision, so its state dicts map over
    keys = set(build_model("resnet50", num_outputs=3).state_dict())
    assert {"conv1.weight", "layer4.2.bn3.running_var", "layer2.0.downsample.0.weight", "fc.bias"} <= keys
    keys = set(build_model("densenet121", num_outputs=3).state_dict())
    assert {
        "features.conv0.weight",
        "features.denseblock3.denselayer24.conv2.weight",
        "features.transition3.conv.weight",
        "features.norm5.running_mean",
        "classifier.weight",
    } <= keys
    keys = set(build_model("alexnet", num_outputs=3).state_dict())
    assert {"features.0.weight", "features.10.bias", "classifier.1.weight", "classifier.6.bias"} <= keys
    # ResNet v1.5: the stride of a bottleneck sits on its 3x3 convolution
    r50 = build_model("resnet50", num_outputs=3)
    assert r50.layer2[0].conv2.stride == (2, 2) and r50.layer2[0].conv1.stride == (1, 1)


@pytest.mark.parametrize("name", ["small_cnn", "alexnet", "resnet18", "resnet50", "densenet121"])
def test_any_input_size_from_32(name):
    torch.manual_seed(0)
    model = build_model(name, num_outputs=5).eval()
    for size in (32, 67):  # the smallest, and an odd size where every pool runs its usual path
        images = torch.randn(3, 1, size, size)
        with torch.no_grad():
            out = model(images)
            alone = model(images[1:2])
        assert out.shape == (3, 5) and out.dtype == torch.float32
        assert torch.isfinite(out).all()
        # rows are independent in eval mode: an image gives the same logits alone or in a batch
        torch.testing.assert_close(alone[0], out[1], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(out[0], out[1])


def test_alexnet_pool_matches_plain_pool_where_that_works():
    torch.manual_seed(1)
    model = build_model("alexnet", num_outputs=3)
    x = torch.randn(2, 64, 13, 13)
    torch.testing.assert_close(model.features[2](x), torch.nn.functional.max_pool2d(x, 3, 2), rtol=0, atol=0)
    # on a map smaller than the window the result is the maximum of the map
    small = torch.randn(2, 4, 1, 2)
    assert torch.equal(model.features[12](small), small.amax(dim=(2, 3), keepdim=True))


def test_small_cnn_trains():
    # a few steps of SGD fit a separable toy problem: the model and its gradients are wired up
    torch.manual_seed(0)
    model = build_model("small_cnn", num_outputs=1, width=8)
    x = torch.randn(16, 1, 32, 32)
    y = (x.mean(dim=(1, 2, 3)) > 0).float()[:, None]
    x = x + y[:, :, None, None] * 2
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]  # over seeds 0-4 the ratio was 0.0008-0.0022


def test_unknown_model_lists_names():
    with pytest.raises(ConfigurationError, match="unknown model 'vgg16'.*small_cnn, alexnet, resnet18"):
        build_model("vgg16", num_outputs=2)


def test_bad_options_refused():
    with pytest.raises(ConfigurationError, match="no option.*'depth'.*width"):
        build_model("small_cnn", num_outputs=2, depth=3)
    with pytest.raises(ConfigurationError, match="num_outputs must be a positive integer, got 0"):
        build_model("resnet18", num_outputs=0)
    with pytest.raises(ConfigurationError, match="in_channels"):
        build_model("resnet18", num_outputs=2, in_channels=1.5)


def test_model_options_apply():
    assert build_model("small_cnn", num_outputs=2, width=4).fc.in_features == 32
    assert build_model("alexnet", num_outputs=2, dropout=0.1).classifier[0].p == 0.1
    r18 = build_model("resnet18", num_outputs=2, zero_init_residual=True)
    assert float(r18.layer1[0].bn2.weight.detach().abs().sum()) == 0.0


def test_normalize_values_and_shapes():
    assert DEFAULT_NORMALIZATION == {"mean": 0.5, "std": 0.25}
    batch = np.array([[[0, 255], [128, 64]]], dtype=np.uint8)
    out = normalize(batch)
    assert out.shape == (1, 1, 2, 2) and out.dtype == torch.float32
    expected = (batch.astype(np.float32) / 255 - 0.5) / 0.25
    np.testing.assert_allclose(out.numpy()[:, 0], expected, rtol=1e-6)
    assert out[0, 0, 0, 0] == -2.0 and out[0, 0, 0, 1] == 2.0
    # (B, 1, S, S) torch input gives the same
    assert torch.equal(normalize(torch.from_numpy(batch)[:, None]), out)
    custom = normalize(batch, mean=0.0, std=1.0)
    np.testing.assert_allclose(custom.numpy()[:, 0], batch / 255.0, rtol=1e-6)


def test_normalize_rejects_bad_shape():
    with pytest.raises(ValueError, match=r"\(B, S, S\) or \(B, C, S, S\); got \(2, 4\)"):
        normalize(np.zeros((2, 4), np.uint8))


# the layers fine-tuning adapts (weights=) and the blocks activation checkpointing recomputes, per registry model
ADAPTED = {
    "small_cnn": ("features.0", "fc", 1),
    "alexnet": ("features.0", "classifier.6", 1),
    "resnet18": ("conv1", "fc", 8),
    "resnet50": ("conv1", "fc", 16),
    "densenet121": ("features.conv0", "classifier", 7),
}


@pytest.mark.parametrize("name", list(ADAPTED))
def test_first_layer_head_and_blocks_of_registry_models(name):
    from dask_dl.models.source import first_conv_name, head_name

    model = build_model(name, num_outputs=3)
    first, head, blocks = ADAPTED[name]
    assert (first_conv_name(model), head_name(model), len(model.checkpoint_blocks())) == (first, head, blocks)
    assert model.get_submodule(first).in_channels == 1 and model.get_submodule(head).out_features == 3

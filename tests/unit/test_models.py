"""PreActResNet-18 and torchvision models by name."""

import pytest
import torch

from mixhook.app.models import PreActResNet18, classification_models, torchvision_model


@pytest.mark.parametrize(("channels", "size"), [(1, 8), (3, 32)])
def test_preact_resnet18_runs_at_digits_and_cifar_size(channels, size):
    model = PreActResNet18(in_channels=channels, num_classes=7)
    assert model(torch.randn(2, channels, size, size)).shape == (2, 7)
    names = dict(model.named_children())
    assert list(names) == ["conv1", "layer1", "layer2", "layer3", "layer4", "linear"]
    assert sum(p.numel() for p in PreActResNet18().parameters()) == 11_171_146  # as the reference code


def test_torchvision_model_adapts_the_stem_and_keeps_names():
    model = torchvision_model("resnet18", in_channels=1, num_classes=10)
    assert model.conv1.in_channels == 1 and model.conv1.out_channels == 64
    assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)
    assert "layer2.0.bn1" in dict(model.named_modules())
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    mobile = torchvision_model("mobilenet_v3_small", in_channels=1, num_classes=4)
    assert mobile.features[0][0].in_channels == 1
    assert mobile(torch.randn(2, 1, 32, 32)).shape == (2, 4)


def test_unknown_torchvision_model_suggests_names():
    assert "resnet50" in classification_models()
    with pytest.raises(
        ValueError,
        match=r"model.name='resnet181' is not a torchvision classification model; did you mean resnet18",
    ):
        torchvision_model("resnet181")

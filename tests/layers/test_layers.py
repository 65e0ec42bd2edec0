"""Layer names: normalisation, resolution, the unknown-layer message, and the one-batch trace."""

import pytest
import torch
import torchvision
from torch import nn

from mixhook import INPUT, UnknownLayerError, layer_names, resolve_layers
from mixhook.app.models import PreActResNet18
from mixhook.layers import normalize_layers, trace_outputs


def test_normalize_accepts_a_name_or_a_list():
    assert normalize_layers("layer2") == ("layer2",)
    assert normalize_layers(["input", "layer1"]) == ("input", "layer1")


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ([], ValueError, "at least one layer"),
        (["layer1", "layer1"], ValueError, r"\['layer1'\] more than once"),
        (["layer1", 3], TypeError, "non-empty strings, got 3"),
        ("", TypeError, "non-empty strings"),
        (5, TypeError, "a module name or a list of names, got int 5"),
    ],
)
def test_normalize_refuses_bad_specs(spec, error, match):
    with pytest.raises(error, match=match):
        normalize_layers(spec)


def test_resolve_maps_names_to_modules_and_input_to_the_model():
    model = torchvision.models.resnet18()
    resolved = resolve_layers(model, ["input", "layer2", "layer3.1.conv2"])
    assert resolved == {"input": model, "layer2": model.layer2, "layer3.1.conv2": model.layer3[1].conv2}
    assert layer_names(model)[:3] == [INPUT, "conv1", "bn1"]


def test_unknown_layer_names_it_suggests_and_lists():
    model = PreActResNet18()
    with pytest.raises(UnknownLayerError) as info:
        resolve_layers(model, ["layer2", "layr2"])
    message = str(info.value)
    assert message.startswith("unknown layer 'layr2' in PreActResNet; did you mean 'layer2'")
    listed = message.split("Valid layers: ")[1]
    for name in ("input", "conv1", "layer1", "layer2", "layer4.1", "linear"):
        assert name in listed.split(" (and")[0].split(", ")
    assert "deeper modules such as 'layer1.0.bn1'" in message
    assert "\n" not in message
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_unknown_layer_without_close_match_still_lists_valid_names():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(KeyError, match=r"unknown layer 'zzz' in Sequential\. Valid layers: input, 0, 1$"):
        resolve_layers(model, ["zzz"])
    with pytest.raises(KeyError, match="unknown layer ''"):
        resolve_layers(model, [""])  # the root's own empty name is not a layer


def test_trace_outputs_records_layers_restores_mode_and_leaves_no_hooks():
    model = PreActResNet18(in_channels=1).train()
    x = torch.randn(2, 1, 8, 8)
    outputs = trace_outputs(model, ["input", "layer1", "layer3"], x)
    assert outputs["input"][0] is x and list(outputs["input"]) == ["x"]  # the model's arguments by name
    assert outputs["layer1"].shape == (2, 64, 8, 8) and outputs["layer3"].shape == (2, 256, 2, 2)
    assert model.training
    assert all(not m._forward_hooks for m in model.modules())
    assert model.layer1[0].bn1.num_batches_tracked == 0  # ran in eval mode: no statistics updated


# nestordemeure/ManifoldMixupV2 at 9f066d6, manifold_mixup.py: fastai's default layer choice (the
# TabularModel, UnetBlock and ManifoldMixupModule rules need fastai; the models below have none of them).
non_mixable_module_types = [nn.Sequential, nn.Dropout, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                            nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                            nn.LSTM, nn.LSTMCell, nn.GRU, nn.GRUCell,
                            nn.RNN, nn.RNNBase, nn.RNNCell, nn.RNNCellBase]  # fmt: skip


def _is_mixable(m):
    return not any(isinstance(m, non_mixable_class) for non_mixable_class in non_mixable_module_types)


def _is_block_module(m):
    m = str(type(m)).lower()
    return "block" in m or "bottleneck" in m


def _get_mixup_module_list(model):
    module_list = list(model.modules())
    block_modules = list(filter(_is_block_module, module_list))
    if len(block_modules) != 0:
        return block_modules
    mixable_modules = list(filter(_is_mixable, module_list))
    if len(mixable_modules) != 0:
        return mixable_modules
    raise ValueError("No eligible layer found for mixup.")


def test_fastai_layers_are_fastais_default_candidates():
    import timm

    from mixhook import fastai_layers
    from tests.helpers import SmallCNN

    models = [
        PreActResNet18(),
        torchvision.models.resnet18(),
        torchvision.models.resnet50(),  # Bottleneck
        timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2),
        nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Dropout(), nn.Linear(4, 2)),
        SmallCNN(),  # no blocks: every mixable module, where fastai also lists the model itself
        nn.Sequential(nn.Embedding(9, 4), nn.LSTM(4, 4), nn.Linear(4, 2)),  # the LSTM is not a candidate
    ]
    for model in models:
        modules = dict(model.named_modules())
        names = fastai_layers(model)
        assert names[0] == INPUT and fastai_layers(model, input=False) == names[1:]
        expected = [m for m in _get_mixup_module_list(model) if m is not model]
        assert [modules[name] for name in names[1:]] == expected, type(model).__name__
    assert fastai_layers(PreActResNet18(), input=False) == [
        f"layer{i}.{j}" for i in (1, 2, 3, 4) for j in (0, 1)
    ]
    for model in (nn.Sequential(nn.BatchNorm1d(3), nn.Dropout()), nn.GRU(3, 4)):
        with pytest.raises(
            ValueError, match=r"^no layer of (Sequential|GRU) is eligible for fastai's manifold mixup"
        ):
            fastai_layers(model)

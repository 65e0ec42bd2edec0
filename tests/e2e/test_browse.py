"""The layer browser: mixable layers, residual-block membership read from the autograd graph, and the
`mixhook-layers` command."""

import pytest
import torch
from torch import nn

from harness.app_runs import config
from mixhook.app import run as app
from mixhook.app.browse import browse, format_table
from mixhook.app.models import PreActResNet18
from tests.helpers import Lazy
from tests.toy_models import TupleBlockNet

torchvision = Lazy("torchvision")  # imported by the first test that uses it, not at collection


def rows_of(model, x):
    return {r.name: r for r in browse(model, x)}


def test_torchvision_resnet18_stages_are_mixable_and_their_insides_are_residual():
    rows = rows_of(torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 32, 32))
    assert list(rows)[:2] == ["input", "conv1"]
    for name in ("layer1", "layer2", "layer2.0", "layer3.1", "avgpool", "fc"):
        assert rows[name].mixable and rows[name].residual_in is None, name
    inside = (
        "layer2.0.bn1",
        "layer2.0.conv2",
        "layer2.0.downsample",
        "layer2.0.downsample.0",
        "layer4.1.bn2",
    )
    for name in inside:
        assert rows[name].mixable and rows[name].residual_in == ".".join(name.split(".")[:2]), name
    for name in ("layer2.0.downsample", "layer2.0.downsample.0", "layer3.0.downsample.1"):
        assert rows[name].on_skip, name  # the shortcut, told from the residual branch
    for name in ("layer2.0.bn1", "layer2.0.conv2", "layer1.0.conv1"):
        assert not rows[name].on_skip, name
    assert rows["layer2.0.relu"].calls == 2
    assert rows["layer2"].output == "(2, 128, 4, 4)"
    table = format_table(browse(torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 32, 32)))
    assert "on the skip path of residual block layer2.0: the residual branch stays unmixed" in table


def test_the_papers_preactresnet_and_a_model_with_a_global_skip():
    rows = rows_of(PreActResNet18(in_channels=1, num_classes=10), torch.randn(2, 1, 8, 8))
    assert rows["layer1"].residual_in is None and rows["layer1.0.conv1"].residual_in == "layer1.0"
    assert rows["layer2.0.shortcut"].on_skip and not rows["layer2.0.conv2"].on_skip
    assert rows["layer2.0.bn1"].residual_in is None  # before the fork: both branches start from it

    class GlobalSkip(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU())

        def forward(self, x):
            return (self.body(x) + x).mean((2, 3))

    rows = rows_of(GlobalSkip(), torch.randn(2, 3, 4, 4))
    assert rows["body"].residual_in == "(the model)" and rows["body.0"].residual_in == "(the model)"


def test_structures_show_their_elements_and_batch_dimensions_and_nothing_is_left_behind():
    model = TupleBlockNet()
    before = [p.clone() for p in model.parameters()]
    rows = rows_of(model, torch.randn(2, 1, 8, 8))
    assert rows["block"].mixable and rows["block"].output == "tuple: [0] (2, 4, 8, 8) batch@0, [1] ()"
    assert rows["stem"].mixable and model.training

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(3, 4)  # sequence first
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.lstm(x)[1][0][-1])

    rows = rows_of(Seq(), torch.randn(5, 2, 3))
    assert (
        rows["lstm"].output
        == "tuple: [0] (5, 2, 4) batch@1, [1.0] (1, 2, 4) batch@1, [1.1] (1, 2, 4) batch@1"
    )
    assert not rows["head"].mixable and "cannot tell the batch dimension" in rows["head"].why_not
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    table = format_table(browse(model, torch.randn(2, 1, 8, 8)))
    assert table.splitlines()[0].split() == ["layer", "portable", "type", "output", "mixable", "note"]


@pytest.mark.slow
def test_the_command_lists_layers_as_the_issue_asks(capsys):
    from mixhook.app.browse import main  # (mixhook-layers, in this process: the command as a
    # process of its own, printing nothing on stderr, in test_packaging.py's run from a built wheel)

    assert main(["model=torchvision", "model.name=resnet18"]) == 0
    result = capsys.readouterr()
    assert result.err == "", result.err
    head, statement, *rows = result.out.splitlines()
    assert statement == "portable specs (torchvision ResNet): 5 stages, 8 blocks"
    lines = {line.split()[0]: line for line in rows[1:]}
    assert lines["layer2"].split()[1:] == ["stage:2", "Sequential", "(2,", "128,", "1,", "1)", "yes"]
    assert (
        lines["layer2.1"].split()[1:3] == ["block:3", "BasicBlock"] and lines["relu"].split()[1] == "stage:0"
    )
    assert "inside residual block layer2.0: the skip path stays unmixed" in lines["layer2.0.bn1"]
    assert "on the skip path of residual block layer2.0" in lines["layer2.0.downsample"]


@pytest.mark.slow
def test_the_browser_help_other_models_and_bad_options_in_process(capsys):
    from mixhook.app.browse import main

    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: mixhook-layers [OVERRIDE ...]")
    assert (
        main(["model=timm", "model.name=vit_tiny_patch16_224", "+model.img_size=8", "+model.patch_size=4"])
        == 0
    )
    out = capsys.readouterr().out
    assert "blocks.0.attn.qkv" in out and "(2, 5, 576)" in out
    assert main(["model=nosuch"]) == 2
    assert capsys.readouterr().err.startswith("error: model=nosuch is not an option of model")


def test_the_unknown_layer_error_points_to_the_browser():
    try:
        app.build(config("mixup.layer=layr2"))
    except app.ConfigError as err:
        assert "`mixhook-layers` with this run's model and data overrides lists every layer" in str(err)
    else:
        raise AssertionError("an unknown layer was accepted")


@pytest.mark.slow
def test_the_mixable_column_is_the_configured_methods_and_its_layer_is_checked(capsys):
    """``mixup=cutmix``: the column is CutMix's verdict, as train.py's before training (a 1x1 map and the
    logits refused, with its reason); an unknown ``mixup.layer`` is refused in train.py's one line."""
    from mixhook.app.browse import main

    assert main(["mixup=cutmix"]) == 0
    head, statement, method, *rows = capsys.readouterr().out.splitlines()
    assert method == "mixable: whether mixup=CutMix (its other settings as configured) can mix the layer"
    verdicts = {line.split()[0]: line.split(")", 1)[1].split(None, 1) for line in rows[1:]}  # after the shape
    assert verdicts["layer2"] == ["yes"] and verdicts["input"] == ["yes"]
    assert verdicts["layer4"][0] == "no" and verdicts["layer4"][1].startswith("its 1x1 map is too small")
    assert verdicts["linear"][0] == "no" and verdicts["linear"][1].startswith(
        "needs a (B, C, L), (B, C, H, W)"
    )
    assert main(["mixup=manifold"]) == 0 and capsys.readouterr().out.splitlines()[-1].endswith(
        " yes"
    )  # linear
    assert main(["mixup=cutmix", "mixup.layer=bogus"]) == 2
    result = capsys.readouterr()
    assert result.out == "" and result.err.startswith(
        "error: mixup.layer: unknown layer 'bogus' in PreActResNet"
    )
    assert len(result.err.splitlines()) == 1

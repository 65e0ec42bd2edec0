"""GradScale and GradClip against hand computations and against hand-edited models, on every layer
of torchvision's resnet18 (including layer2.0.bn1, whose output ReLU(inplace=True) then modifies)."""

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from mixhook import GradClip, GradScale
from mixhook.gradients import clip_per_sample
from tests.helpers import grads, hook_count, mlp, set_module


def loss_of(model, x, y):
    return F.cross_entropy(model(x), y)


def test_gradscale_scales_only_what_flows_upstream_of_the_layer():
    model = mlp().train()
    x = torch.randn(5, 6, dtype=torch.double, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3, 0])
    loss_of(model, x, y).backward()
    plain, plain_x = grads(model), x.grad.clone()
    model.zero_grad()
    x.grad = None
    with GradScale("2", 0.25).attach(model):
        out = model(x)
        F.cross_entropy(out, y).backward()
    assert torch.equal(out, model(x))  # forward unchanged
    hooked = grads(model)
    for name in ("0.weight", "0.bias"):  # upstream: scaled
        torch.testing.assert_close(hooked[name], 0.25 * plain[name], rtol=1e-12, atol=0)
    torch.testing.assert_close(x.grad, 0.25 * plain_x, rtol=1e-12, atol=0)
    for name in ("2.weight", "2.bias", "4.weight", "4.bias"):  # the layer itself and downstream: unchanged
        assert torch.equal(hooked[name], plain[name]), name
    assert hook_count(model) == 0


def test_gradscale_minus_one_reverses_on_layer2_0_bn1_and_leaves_bn1_params_alone():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).double().train()
    ref = copy.deepcopy(model)
    x, y = torch.randn(2, 3, 32, 32, dtype=torch.double), torch.tensor([0, 2])
    loss_of(ref, x, y).backward()
    with GradScale("layer2.0.bn1", -1.0).attach(model):
        loss_of(model, x, y).backward()
    got, want = grads(model), grads(ref)
    # layer2.0.conv1 feeds only bn1: its gradient is exactly reversed
    torch.testing.assert_close(
        got["layer2.0.conv1.weight"], -want["layer2.0.conv1.weight"], rtol=1e-10, atol=1e-12
    )
    for name in (
        "layer2.0.bn1.weight",
        "layer2.0.bn1.bias",
        "layer2.0.conv2.weight",
        "fc.weight",
        "layer4.1.bn2.bias",
    ):
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


def test_gradscale_is_inactive_in_eval_mode():
    model = mlp().eval()
    x = torch.randn(3, 6, dtype=torch.double)
    y = torch.tensor([0, 1, 2])
    loss_of(model, x, y).backward()
    plain = grads(model)
    model.zero_grad()
    with GradScale("2", 3.0).attach(model):
        loss_of(model, x, y).backward()
    assert all(torch.equal(plain[n], g) for n, g in grads(model).items())


class _RefScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, f):
        ctx.f = f
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.f, None


class _RefClip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, max_norm):
        ctx.max_norm = max_norm
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        norms = g.reshape(g.shape[0], -1).norm(dim=1)
        scale = torch.clamp(ctx.max_norm / norms, max=1.0)
        return g * scale.view(-1, *([1] * (g.ndim - 1))), None


class ScaledInput(nn.Module):
    """The hand edit GradScale replaces: forward(x) = layer(scale_grad(x))."""

    def __init__(self, layer, f):
        super().__init__()
        self.layer, self.f = layer, f

    def forward(self, *args):
        return self.layer(*(_RefScale.apply(a, self.f) if a.requires_grad else a for a in args))


class ClippedOutput(nn.Module):
    """The hand edit GradClip replaces: forward(x) = clip_grad(layer(x))."""

    def __init__(self, layer, max_norm):
        super().__init__()
        self.layer, self.max_norm = layer, max_norm

    def forward(self, *args):
        return _RefClip.apply(self.layer(*args), self.max_norm)


class NarrowResNet18(torchvision.models.ResNet):
    """torchvision's resnet18, module for module (the same names, blocks, in-place ReLUs and shortcuts), an
    eighth as wide: what the hooks are checked for does not depend on the width, and the full-width model
    in float64 made these the suite's slowest unit tests."""

    def __init__(self, num_classes: int):
        super().__init__(torchvision.models.resnet.BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
        self.conv1 = nn.Conv2d(3, 8, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(self.inplanes, num_classes)

    def _make_layer(self, block, planes, blocks, stride=1, dilate=False):
        if planes == 64:  # the first stage: the stem (replaced above) gives it 8 channels
            self.inplanes = 8
        return super()._make_layer(block, planes // 8, blocks, stride, dilate)


RESNET18_LAYERS = [n for n, _ in torchvision.models.resnet18().named_modules() if n]


def test_the_narrow_resnet18_has_every_module_of_resnet18():
    narrow, full = NarrowResNet18(4), torchvision.models.resnet18(num_classes=4)
    assert [(n, type(m)) for n, m in narrow.named_modules() if n] == [
        (n, type(m)) for n, m in full.named_modules() if n
    ]
    assert narrow.layer2[0].relu.inplace and narrow.layer4[0].downsample is not None


@pytest.fixture(scope="module")
def resnet18_setup():
    torch.manual_seed(0)
    model = NarrowResNet18(num_classes=4).double().train()
    x = torch.randn(2, 3, 16, 16, dtype=torch.double)  # layer3 and layer4 at 1x1: every layer still runs
    y = torch.tensor([1, 3])
    return model, x, y


def _compare(hooked, edited, x, y):
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out1, out2 = hooked(x1), edited(x2)
    assert torch.equal(out1, out2)
    F.cross_entropy(out1, y).backward()
    F.cross_entropy(out2, y).backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-12)
    g1, g2 = (
        grads(hooked),
        {n.replace(".layer.", ".").replace("layer.", ""): g for n, g in grads(edited).items()},
    )
    for name, g in g1.items():
        torch.testing.assert_close(g, g2[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("layer", RESNET18_LAYERS)
def test_gradscale_on_every_resnet18_layer_equals_a_hand_edited_model(resnet18_setup, layer):
    base, x, y = resnet18_setup
    hooked, edited = copy.deepcopy(base), copy.deepcopy(base)
    set_module(edited, layer, ScaledInput(edited.get_submodule(layer), 0.3))
    with GradScale(layer, 0.3).attach(hooked):
        _compare(hooked, edited, x, y)
    assert hook_count(hooked) == 0


@pytest.mark.parametrize("layer", RESNET18_LAYERS)
def test_gradclip_on_every_resnet18_layer_equals_a_hand_edited_model(resnet18_setup, layer):
    base, x, y = resnet18_setup
    hooked, edited = copy.deepcopy(base), copy.deepcopy(base)
    set_module(edited, layer, ClippedOutput(edited.get_submodule(layer), 1e-3))
    with GradClip(layer, 1e-3).attach(hooked):
        _compare(hooked, edited, x, y)
    assert hook_count(hooked) == 0


def test_gradclip_clips_the_output_gradient_per_sample_by_hand():
    model = mlp().train()
    x = torch.randn(4, 6, dtype=torch.double)
    y = torch.tensor([0, 1, 2, 3])
    # by hand: split the forward at layer "2", take dL/dh, clip each row, backpropagate it into the layer
    ref = copy.deepcopy(model)
    h = ref[2](ref[1](ref[0](x)))
    loss = F.cross_entropy(ref[4](ref[3](h)), y)
    (g,) = torch.autograd.grad(loss, h, retain_graph=True)
    norms = g.norm(dim=1)
    clipped = g * torch.clamp(0.05 / norms, max=1.0)[:, None]
    ref[4].weight.grad, ref[4].bias.grad = torch.autograd.grad(
        loss, (ref[4].weight, ref[4].bias), retain_graph=True
    )
    h.backward(clipped)
    clip = GradClip("2", max_norm=0.05)
    with clip.attach(model):
        F.cross_entropy(model(x), y).backward()
    torch.testing.assert_close(clip.last_norms, norms)
    assert bool((norms > 0.05).any())  # the test clips something
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=name)


def test_clip_per_sample_keeps_small_rows_and_caps_large_ones():
    g = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    clipped, norms = clip_per_sample(g, 1.0)
    torch.testing.assert_close(norms, torch.tensor([5.0, 0.5, 0.0]))
    torch.testing.assert_close(clipped, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="factor must be a finite number, got nan"):
        GradScale("layer1", float("nan"))
    with pytest.raises(TypeError, match="factor must be a number, got 'big'"):
        GradScale("layer1", "big")
    with pytest.raises(ValueError, match="max_norm must be > 0, got 0"):
        GradClip("layer1", 0)
    with pytest.raises(ValueError, match="'input' .* is not a layer with an output"):
        GradClip("input", 1.0)
    with pytest.raises(KeyError, match="unknown layer 'layer9'"):
        GradScale("layer9", 0.5).attach(torchvision.models.resnet18())

"""SmoothMix: the Gaussian mask against OpenMixup's on the same draw (and its swapped labels); the draw;
a hand-split forward with gradients; pin_last; the refusals."""

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision

from mixhook import SmoothMix
from mixhook.geometry import gaussian_mask
from tests.helpers import SmallCNN, gen


# The reference: lines of Westlake-AI/openmixup, openmixup/models/augments/smoothmix.py (smoothmix() and
# its gaussian_kernel, not dist_mode), without .cuda(); the draws made as there, from torch's global stream.
def ref_gaussian_kernel(kernel_size, rand_w, rand_h, sigma):
    s = kernel_size * 2
    x_cord = torch.arange(s)
    x_grid = x_cord.repeat(s).view(s, s)
    y_grid = x_grid.t()
    xy_grid = torch.stack([x_grid, y_grid], dim=-1)
    xy_grid = torch.roll(xy_grid, rand_w, 0)
    xy_grid = torch.roll(xy_grid, rand_h, 1)
    crop_size = s // 4
    xy_grid = xy_grid[crop_size : s - crop_size, crop_size : s - crop_size]
    mean = (s - 1) / 2
    var = sigma**2
    g_filter = torch.exp(-torch.sum((xy_grid - mean) ** 2, dim=-1) / (2 * var))
    g_filter = g_filter.view(kernel_size, kernel_size)
    return g_filter


def ref_smoothmix(img, rand_index):
    img_ = img[rand_index]
    _, _, h, w = img.size()
    rand_w = int(torch.randint(0, w, (1,)) - w / 2)
    rand_h = int(torch.randint(0, h, (1,)) - h / 2)
    sigma = (torch.rand(1) / 4 + 0.25) * h
    kernel = ref_gaussian_kernel(
        h, rand_h, rand_w, sigma.double()
    )  # float64 here (the squared distances are exact)
    img = img * (1 - kernel) + img_ * kernel
    lam = torch.sum(kernel) / (h * w)
    return img, lam, (rand_h, rand_w, float(sigma))


def test_the_mask_equals_openmixups_on_the_same_draw_and_its_labels_are_swapped():
    model = SmallCNN().double().train()
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    x = torch.randn(5, 3, 12, 12, dtype=torch.float64)
    for seed in range(10):
        torch.manual_seed(seed)
        index = torch.randperm(5)
        expected, ref_lam, (rand_h, rand_w, sigma) = ref_smoothmix(x, index)
        kernel = gaussian_mask(12, 12, 5.5 + rand_h, 5.5 + rand_w, sigma, sigma)  # centre: a pixel - 1/2
        torch.testing.assert_close(
            kernel, ref_gaussian_kernel(12, rand_h, rand_w, torch.tensor([sigma]).double())
        )
        mix = SmoothMix("input")
        with mix.attach(model):
            mix.pin(mask=1 - kernel, index=index)  # OpenMixup's G weights the partner
            model(x)
        torch.testing.assert_close(seen["x"], expected, rtol=0, atol=1e-14)
        # the image weights the sample itself by 1 - G, so its label should weigh mean(1 - G); OpenMixup
        # gives it mean(G): mixhook's lam is the paper's, OpenMixup's its complement
        assert float(mix.last.lam) == pytest.approx(1 - float(ref_lam), abs=1e-14)


def test_the_draw_is_a_gaussian_of_uniform_centre_and_width_and_lam_is_its_mean():
    model, x = SmallCNN().train(), torch.randn(4, 3, 10, 16)
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    mix = SmoothMix("input", sigma=(0.1, 0.3), generator=gen(4))
    centres, widths = set(), []
    with mix.attach(model):
        for _ in range(300):
            model(x)
            info, index = mix.last.info, mix.last.index
            (cy, cx), s = info["centre"], info["sigma"]
            assert 0.1 <= s <= 0.3
            mask = gaussian_mask(10, 16, cy, cx, s * 10, s * 16)
            assert torch.equal(info["mask"], mask) and float(mask[cy, cx]) == 1.0
            assert float(mix.last.lam) == float(mask.mean())
            m = mask.float()
            torch.testing.assert_close(seen["x"], m * x + (1 - m) * x[index], rtol=0, atol=0)
            centres.add((cy, cx))
            widths.append(s)
    assert {c[0] for c in centres} == set(range(10)) and {c[1] for c in centres} == set(range(16))
    assert min(widths) < 0.12 and max(widths) > 0.28


@pytest.mark.slow
def test_smoothmix_at_layer2_of_resnet18_equals_a_hand_split_forward_with_gradients():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 64, 64, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    mix = SmoothMix("layer2", generator=gen(2))
    with mix.attach(model):
        logits = model(x)
        mix.loss(F.cross_entropy, logits, y).backward()
    mask, index = mix.last.info["mask"], mix.last.index  # drawn, not pinned
    lam = float(mask.mean())
    m = by_hand
    h = m.layer2(m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(x))))))
    expected = m.fc(torch.flatten(m.avgpool(m.layer4(m.layer3(mask * h + (1 - mask) * h[index]))), 1))
    (lam * F.cross_entropy(expected, y) + (1 - lam) * F.cross_entropy(expected, y[index])).backward()
    assert float(mix.last.lam) == lam
    assert torch.equal(logits, expected)
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_pin_last_repeats_the_mask():
    model, x = SmallCNN().train(), torch.randn(4, 3, 8, 8)
    mix = SmoothMix(["input", "conv1"], generator=gen(5))
    assert repr(mix) == "SmoothMix(layer=['input', 'conv1'], sigma=(0.25, 0.5), prob=1.0)"
    with mix.attach(model):
        first = model(x)
        mask = mix.last.info["mask"]
        mix.pin_last()
        assert torch.equal(model(x), first) and torch.equal(mix.last.info["mask"], mask)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sigma": (0.0, 0.5)}, r"sigma must satisfy 0 < low <= high, got \(0.0, 0.5\)"),
        ({"sigma": (0.5, 0.2)}, r"sigma must satisfy 0 < low <= high, got \(0.5, 0.2\)"),
        ({"sigma": "wide"}, "sigma must be two numbers \\(low, high\\), got 'wide'"),
        ({"prob": -1}, r"prob must be in \[0, 1\], got -1"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SmoothMix("input", **kwargs)


def test_a_pinned_lam_a_bad_mask_and_a_single_pixel_are_refused():
    model = SmallCNN().train()
    mix = SmoothMix("conv1")
    with mix.attach(model):
        mix.pin(lam=0.3)
        with pytest.raises(ValueError, match="SmoothMix draws no lam \\(its lam is the mask's mean\\)"):
            model(torch.randn(2, 3, 8, 8))
        mix.pin(mask=torch.full((8, 8), 2.0))
        with pytest.raises(ValueError, match="pinned mask must hold weights in \\[0, 1\\]"):
            model(torch.randn(2, 3, 8, 8))
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 8), torch.nn.Flatten(), torch.nn.Linear(4, 2)).train()
    with pytest.raises(ValueError, match="SmoothMix at '0': its 1x1 map has a single pixel"):
        with SmoothMix("0").attach(net):
            net(torch.randn(2, 3, 8, 8))

"""ResizeMix: the box and the resized paste equal OpenMixup's on the same draw; a hand-split forward with
gradients; the scale's range; pin_last; the refusals."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision

from mixhook import ResizeMix
from tests.helpers import SmallCNN, gen


# The reference: lines of Westlake-AI/openmixup, openmixup/models/augments/resizemix.py (resizemix() and its
# rand_bbox_tao, not dist_mode), with numpy's legacy RandomState for np.random, np.int as int, no .cuda().
def ref_resizemix(img, rand_index, rng, scope=(0.1, 0.8), interpolate_mode="nearest"):
    def rand_bbox_tao(size, tao):
        W = size[2]
        H = size[3]
        cut_w = int(W * tao)
        cut_h = int(H * tao)
        cx = rng.randint(W)
        cy = rng.randint(H)
        bbx1 = np.clip(cx - cut_w // 2, 0, W)
        bby1 = np.clip(cy - cut_h // 2, 0, H)
        bbx2 = np.clip(cx + cut_w // 2, 0, W)
        bby2 = np.clip(cy + cut_h // 2, 0, H)
        return bbx1, bby1, bbx2, bby2

    img = img.clone()
    img_resize = img.clone()[rand_index]
    _, _, h, w = img.size()
    tao = rng.uniform(scope[0], scope[1])
    bbx1, bby1, bbx2, bby2 = rand_bbox_tao(img.size(), tao)
    box = (int(bby1), int(bby2), int(bbx1), int(bbx2))
    try:
        img_resize = F.interpolate(img_resize, (bby2 - bby1, bbx2 - bbx1), mode=interpolate_mode)
    except RuntimeError:  # an empty box (int(side * tao) < 2): the reference cannot resize to it
        return None, None, box, tao
    img[:, :, bby1:bby2, bbx1:bbx2] = img_resize
    lam = 1 - ((bbx2 - bbx1) * (bby2 - bby1) / (w * h))
    return img, lam, box, tao


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_the_paste_equals_openmixups_on_the_same_draw(mode):
    model = SmallCNN().train()
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    x = torch.randn(5, 3, 16, 16)
    empty = 0
    for seed in range(40):
        index = torch.randperm(5, generator=gen(seed))
        expected, lam, box, tau = ref_resizemix(x, index, np.random.RandomState(seed), interpolate_mode=mode)
        mix = ResizeMix("input", interpolation=mode)
        with mix.attach(model):
            mix.pin(box=box, index=index)
            model(x)
        if expected is None:  # where the reference raises, mixhook pastes nothing, lam 1
            assert int(16 * tau) < 2 and torch.equal(seen["x"], x) and float(mix.last.lam) == 1.0
            empty += 1
            continue
        assert torch.equal(seen["x"], expected)
        assert float(mix.last.lam) == lam
        side = 2 * (int(16 * tau) // 2)  # the reference's box before clipping: the same rule as ours
        assert box[1] - box[0] <= side and box[3] - box[2] <= side
    assert 0 < empty < 10


def test_the_drawn_box_has_sides_from_a_uniform_scale_in_scope():
    mix = ResizeMix("conv1", scope=(0.2, 0.6), generator=gen(3))
    model, x = SmallCNN().train(), torch.randn(2, 3, 40, 40)
    scales = []
    with mix.attach(model):
        for _ in range(200):
            model(x)
            (y1, y2, x1, x2), tau = mix.last.info["box"], mix.last.info["scale"]
            assert 0.2 - 1e-12 <= tau <= 0.6 + 1e-12
            cut = int(40 * tau)
            assert y2 - y1 <= 2 * (cut // 2) and x2 - x1 <= 2 * (cut // 2)
            if 0 < y1 and y2 < 40 and 0 < x1 and x2 < 40:  # not clipped: exactly the drawn size
                assert y2 - y1 == x2 - x1 == 2 * (cut // 2)
            assert float(mix.last.lam) == 1 - (y2 - y1) * (x2 - x1) / 1600
            scales.append(tau)
    assert min(scales) < 0.25 and max(scales) > 0.55  # spread over the whole scope


@pytest.mark.slow
def test_resizemix_at_layer2_of_resnet18_equals_a_hand_split_forward_with_gradients():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 64, 64, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    index = torch.tensor([3, 2, 1, 0])
    mix = ResizeMix("layer2", interpolation="bilinear", generator=gen())
    with mix.attach(model):
        mix.pin(box=(2, 7, 1, 5), index=index)
        logits = model(x)
        mix.loss(F.cross_entropy, logits, y).backward()
    lam = 1 - 20 / 64
    assert float(mix.last.lam) == lam
    m = by_hand
    h = m.layer2(m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(x))))))  # 8x8 here
    small = F.interpolate(h[index], size=(5, 4), mode="bilinear")
    middle = torch.cat([h[:, :, 2:7, :1], small, h[:, :, 2:7, 5:]], 3)
    pasted = torch.cat([h[:, :, :2], middle, h[:, :, 7:]], 2)
    expected = m.fc(torch.flatten(m.avgpool(m.layer4(m.layer3(pasted))), 1))
    (lam * F.cross_entropy(expected, y) + (1 - lam) * F.cross_entropy(expected, y[index])).backward()
    assert torch.equal(logits, expected)
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_pin_last_repeats_the_paste_and_a_pinned_lam_sets_the_scale():
    model, x = SmallCNN().train(), torch.randn(4, 3, 8, 8)
    mix = ResizeMix(["input", "conv1"], generator=gen(5))
    assert (
        repr(mix)
        == "ResizeMix(layer=['input', 'conv1'], scope=(0.1, 0.8), interpolation='nearest', prob=1.0)"
    )
    with mix.attach(model):
        first = model(x)
        box = mix.last.info["box"]
        mix.pin_last()
        assert torch.equal(model(x), first) and mix.last.info["box"] == box
        mix.pin(layer="conv1", lam=0.75)  # tau = 0.5: a 4x4 box on the 8x8 map, wherever its centre
        model(x)
        y1, y2, x1, x2 = mix.last.info["box"]
        assert mix.last.info["scale"] == 0.5 and y2 - y1 <= 4 and x2 - x1 <= 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scope": (0.0, 0.5)}, r"scope must satisfy 0 < low <= high < 1, got \(0.0, 0.5\)"),
        ({"scope": (0.6, 0.5)}, r"scope must satisfy 0 < low <= high < 1, got \(0.6, 0.5\)"),
        ({"scope": 0.5}, "scope must be two numbers \\(low, high\\), got 0.5"),
        (
            {"interpolation": "linear"},
            "interpolation must be one of nearest, nearest-exact, bilinear, bicubic, area",
        ),
        ({"prob": 2}, r"prob must be in \[0, 1\], got 2"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ResizeMix("input", **kwargs)


def test_maps_too_small_and_per_sample_lams_are_refused():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 7), torch.nn.Flatten(), torch.nn.Linear(16, 2)).train()
    with pytest.raises(
        ValueError, match="ResizeMix at '0': its 2x2 map is too small to ever paste a box at scales"
    ):
        with ResizeMix("0").attach(model):
            model(torch.randn(2, 3, 8, 8))
    mix, cnn = ResizeMix("conv1"), SmallCNN().train()
    with mix.attach(cnn):
        mix.pin(lam=torch.tensor([0.2, 0.8]))
        with pytest.raises(ValueError, match="ResizeMix pastes one box per batch: pin one lam, not 2"):
            cnn(torch.randn(2, 3, 8, 8))

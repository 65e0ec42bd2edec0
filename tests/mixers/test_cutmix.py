"""CutMix: the box, the corrected lam, the paste at the input and at a hidden layer, the errors."""

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision

from mixhook import CutMix
from mixhook.geometry import box_lam, rand_box, rand_boxes
from tests.helpers import SmallCNN, gen, hook_count


def test_rand_box_follows_the_papers_recipe():
    g, twin = gen(3), gen(3)
    for lam in (0.1, 0.5, 0.9):
        box = rand_box(32, 24, lam, g)
        ratio = (1 - lam) ** 0.5
        cut_h, cut_w = int(32 * ratio), int(24 * ratio)
        cy, cx = int(torch.randint(32, (), generator=twin)), int(torch.randint(24, (), generator=twin))
        assert box == (
            max(cy - cut_h // 2, 0),
            min(cy + cut_h // 2, 32),
            max(cx - cut_w // 2, 0),
            min(cx + cut_w // 2, 24),
        )
    assert box_lam((0, 4, 2, 6), 8, 8) == 1 - 16 / 64


def test_cutmix_at_the_input_pastes_the_box_and_corrects_lam():
    model = SmallCNN(channels=1).train()
    x = torch.randn(4, 1, 8, 8)
    x_before = x.clone()
    mix = CutMix("input", generator=gen(1))
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    lams = []
    with mix.attach(model):
        for _ in range(50):
            seen.clear()
            model(x)
            y1, y2, x1, x2 = mix.last.info["box"]
            expected = x.clone()
            expected[:, :, y1:y2, x1:x2] = x[mix.last.index][:, :, y1:y2, x1:x2]
            assert torch.equal(seen["x"], expected)
            assert float(mix.last.lam) == pytest.approx(1 - (y2 - y1) * (x2 - x1) / 64)
            lams.append(float(mix.last.lam))
    assert torch.equal(x, x_before)  # the caller's tensor is never modified
    assert min(lams) < 0.5 < max(lams)


@pytest.mark.slow
def test_cutmix_at_layer2_of_resnet18_equals_a_hand_split_forward_with_gradients():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 64, 64, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    index = torch.tensor([3, 2, 1, 0])
    mix = CutMix("layer2", generator=gen())
    with mix.attach(model):
        mix.pin(box=(1, 5, 2, 8), index=index)
        logits = model(x)
        mix.loss(F.cross_entropy, logits, y).backward()
    assert mix.last.info["box"] == (1, 5, 2, 8) and float(mix.last.lam) == 1 - 24 / 64  # layer2 is 8x8 here
    m = by_hand
    h = m.layer2(m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(x))))))
    pasted = torch.cat([h[:, :, :1], torch.cat([h[:, :, 1:5, :2], h[index, :, 1:5, 2:8]], 3), h[:, :, 5:]], 2)
    expected = m.fc(torch.flatten(m.avgpool(m.layer4(m.layer3(pasted))), 1))
    lam = 1 - 24 / 64
    (lam * F.cross_entropy(expected, y) + (1 - lam) * F.cross_entropy(expected, y[index])).backward()
    assert torch.equal(logits, expected)
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_a_layer_without_a_map_is_refused_clearly():
    model = torchvision.models.resnet18(num_classes=3).train()
    with CutMix("fc").attach(model):
        with pytest.raises(
            TypeError,
            match=r"CutMix at 'fc' needs a \(B, C, L\), \(B, C, H, W\) or \(B, C, D, H, W\) map with the "
            r"batch first, but has shape \(2, 3\)",
        ):
            model(torch.randn(2, 3, 32, 32))
    assert hook_count(model) == 0


def test_pinned_box_must_fit():
    model = SmallCNN().train()
    mix = CutMix("conv1")
    with mix.attach(model):
        mix.pin(box=(0, 40, 0, 4))
        with pytest.raises(ValueError, match=r"pinned box \(0, 40, 0, 4\) does not fit the 8x8 map"):
            model(torch.randn(2, 3, 8, 8))
    with pytest.raises(TypeError, match="unknown values \\['mask'\\]; valid: layer, lam, index, box"):
        mix.pin(mask=1)


# ------------------------------------------------------------------ mode="elem": one box per sample


def test_rand_boxes_are_rand_box_per_sample_with_all_row_centres_drawn_first():
    lam = torch.tensor([0.05, 0.3, 0.5, 0.77, 0.999], dtype=torch.float64)
    boxes = rand_boxes(30, 20, lam, gen(5))
    twin = gen(5)
    cy, cx = torch.randint(30, (5,), generator=twin), torch.randint(20, (5,), generator=twin)
    for i in range(5):
        ratio = (1 - float(lam[i])) ** 0.5
        cut_h, cut_w = int(30 * ratio), int(20 * ratio)
        expected = (
            max(int(cy[i]) - cut_h // 2, 0),
            min(int(cy[i]) + cut_h // 2, 30),
            max(int(cx[i]) - cut_w // 2, 0),
            min(int(cx[i]) + cut_w // 2, 20),
        )
        assert tuple(boxes[i].tolist()) == expected


def test_elem_mode_pastes_one_box_per_sample_with_its_own_lam():
    model = SmallCNN(channels=1).train()
    x = torch.randn(6, 1, 8, 8)
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    mix = CutMix("input", mode="elem", generator=gen(2))
    spread = []
    with mix.attach(model):
        for _ in range(20):
            model(x)
            boxes, index = mix.last.info["box"], mix.last.index
            assert boxes.shape == (6, 4) and mix.last.lam.shape == (6,)
            expected = x.clone()
            for i, (y1, y2, x1, x2) in enumerate(boxes.tolist()):
                expected[i, :, y1:y2, x1:x2] = x[index[i], :, y1:y2, x1:x2]
                assert float(mix.last.lam[i]) == 1 - (y2 - y1) * (x2 - x1) / 64
            assert torch.equal(seen["x"], expected)
            spread.append(float(mix.last.lam.max() - mix.last.lam.min()))
            targets = mix.targets(torch.arange(6), 6)
            lam = mix.last.lam.float()[:, None]
            eye = torch.eye(6)
            torch.testing.assert_close(targets, lam * eye + (1 - lam) * eye[index], rtol=0, atol=1e-7)
    assert max(spread) > 0.3  # the boxes (and lams) differ within a batch


@pytest.mark.slow
def test_elem_mode_at_layer2_of_resnet18_equals_a_hand_split_forward_with_gradients():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 64, 64, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    index = torch.tensor([3, 2, 1, 0])
    boxes = torch.tensor([[1, 5, 2, 8], [0, 8, 0, 8], [3, 3, 0, 8], [6, 8, 0, 1]])  # layer2 is 8x8 here
    mix = CutMix("layer2", mode="elem", generator=gen())
    with mix.attach(model):
        mix.pin(box=boxes, index=index)
        logits = model(x)
        mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, y).mean().backward()
    lam = torch.tensor([1 - 24 / 64, 0.0, 1.0, 1 - 2 / 64], dtype=torch.float64)
    assert torch.equal(mix.last.lam, lam)
    m = by_hand
    h = m.layer2(m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(x))))))
    rows = []
    for i, (y1, y2, x1, x2) in enumerate(boxes.tolist()):
        inside = torch.zeros(1, 8, 8, dtype=torch.bool)
        inside[:, y1:y2, x1:x2] = True
        rows.append(torch.where(inside, h[index[i]], h[i]))
    expected = m.fc(torch.flatten(m.avgpool(m.layer4(m.layer3(torch.stack(rows)))), 1))
    per_sample = lam * F.cross_entropy(expected, y, reduction="none")
    (per_sample + (1 - lam) * F.cross_entropy(expected, y[index], reduction="none")).mean().backward()
    assert torch.equal(logits, expected)
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_elem_mode_repeats_its_boxes_for_pin_last_and_refuses_what_does_not_fit():
    model = SmallCNN().train()
    x = torch.randn(4, 3, 8, 8)
    mix = CutMix(["input", "conv1"], mode="elem", generator=gen(7))
    assert repr(mix) == "CutMix(layer=['input', 'conv1'], alpha=1.0, prob=1.0, mode='elem')"
    with mix.attach(model):
        first = model(x)
        boxes = mix.last.info["box"]
        mix.pin_last()
        assert torch.equal(model(x), first) and torch.equal(mix.last.info["box"], boxes)
        mix.pin(layer="conv1", lam=0.5)  # one number: the same box size for every sample
        model(x)
        sides = mix.last.info["box"][:, 1] - mix.last.info["box"][:, 0]
        assert mix.last.lam.shape == (4,) and int(sides.max()) <= 4
        mix.pin(layer="conv1", box=torch.zeros(3, 4))
        with pytest.raises(
            ValueError, match=r"pinned box of shape \(3, 4\): CutMix\(mode='elem'\) takes one"
        ):
            model(x)
        mix.pin(layer="conv1", box=[[0, 9, 0, 1]] * 4)
        with pytest.raises(ValueError, match="a pinned box does not fit the 8x8 map of layer 'conv1'"):
            model(x)
    batch = CutMix("conv1")
    with batch.attach(model):
        batch.pin(lam=torch.tensor([0.2, 0.8, 0.5, 0.5]))
        with pytest.raises(
            ValueError, match=r"CutMix\(mode='batch'\) cuts one box per batch: pin one lam, not 4"
        ):
            model(x)
    with pytest.raises(ValueError, match="mode must be 'batch' or 'elem', got 'sample'"):
        CutMix("input", mode="sample")


@pytest.mark.parametrize(("height", "width"), [(32, 32), (15, 9), (7, 12)])
def test_timm_rounding_equals_timms_rand_bbox_and_paper_rounding_the_papers(height, width):
    """timm >= 1.0 ends the box at centre + (cut + 1) // 2; the paper's code (and torchvision) at
    centre + cut // 2. Both against the real functions on the same centre draws (numpy's, re-seeded)."""
    import numpy as np
    from timm.data.mixup import rand_bbox as timm_rand_bbox

    from mixhook.geometry import boxes_around

    for seed, lam in enumerate([0.05, 0.3, 0.5, 0.61, 0.9, 0.97]):
        np.random.seed(seed)
        yl, yh, xl, xh = timm_rand_bbox((3, height, width), lam)
        np.random.seed(seed)  # the same centre: rows first, then columns, as timm draws them
        cy, cx = np.random.randint(0, height), np.random.randint(0, width)
        ours = boxes_around(height, width, lam, torch.tensor([cy]), torch.tensor([cx]), "timm")[0].tolist()
        assert ours == [yl, yh, xl, xh]
        paper = boxes_around(height, width, lam, torch.tensor([cy]), torch.tensor([cx]), "paper")[0].tolist()
        cut_h, cut_w = int(height * (1 - lam) ** 0.5), int(width * (1 - lam) ** 0.5)
        assert paper == [
            max(cy - cut_h // 2, 0), min(cy + cut_h // 2, height), max(cx - cut_w // 2, 0),
            min(cx + cut_w // 2, width),
        ]  # fmt: skip


def test_cutmix_with_timm_rounding_pastes_timms_box_and_says_so():
    from mixhook.functional import sample_lam

    model, x = SmallCNN().train(), torch.randn(2, 3, 9, 9)
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    mix = CutMix("input", rounding="timm", generator=gen(4))
    assert repr(mix) == "CutMix(layer='input', alpha=1.0, prob=1.0, rounding='timm')"
    twin, odd = gen(4), 0
    with mix.attach(model):
        for _ in range(30):
            model(x)
            lam = float(sample_lam(1.0, twin))
            index = torch.randperm(2, generator=twin)
            y1, y2, x1, x2 = rand_box(9, 9, lam, twin, "timm")
            assert mix.last.info["box"] == (y1, y2, x1, x2) and torch.equal(mix.last.index, index)
            assert float(mix.last.lam) == 1 - (y2 - y1) * (x2 - x1) / 81
            expected = x.clone()
            expected[:, :, y1:y2, x1:x2] = x[index][:, :, y1:y2, x1:x2]
            assert torch.equal(seen["x"], expected)
            odd += int(9 * (1 - lam) ** 0.5) % 2 == 1
    assert odd > 0  # some boxes had an odd side, where the two roundings differ
    with pytest.raises(ValueError, match="rounding must be one of paper, timm, got 'floor'"):
        CutMix("input", rounding="floor")


def test_the_box_weights_are_made_only_when_a_dense_target_reads_them_and_are_the_box():
    """CutMix defers its own-content weights (contract.Deferred): a forward with class labels builds no
    (1, H, W) mask; a segmentation target's loss makes them, once, as the box says (False inside it), and
    weighs each label pixel by them (checked against the loss written by hand)."""
    from mixhook.engine.contract import Deferred

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 5, 3, padding=1).double()  # a segmentation head: 5 classes per pixel
    mix = CutMix("input", generator=torch.Generator().manual_seed(3))
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (4, 8, 8))
    with mix.attach(conv.train()):
        logits = conv(x)
        assert type(mix.last.__dict__["weights"]) is Deferred  # (not made by the forward)
        loss = mix.loss(lambda out, t: F.cross_entropy(out, t, reduction="none"), logits, y)
    made = mix.last.__dict__["weights"]
    assert type(made) is torch.Tensor and mix.last.weights is made  # made once, kept
    y1, y2, x1, x2 = mix.last.info["box"]
    own = torch.ones(1, 8, 8, dtype=torch.bool)
    own[:, y1:y2, x1:x2] = False
    assert torch.equal(made, own) and (y2 - y1) * (x2 - x1) > 0
    index = mix.last.index
    pixel = own.double() * F.cross_entropy(logits, y, reduction="none") + (~own).double() * F.cross_entropy(
        logits, y[index], reduction="none"
    )
    torch.testing.assert_close(loss, pixel, rtol=1e-12, atol=1e-12)

"""SaliencyMix: the box against the authors' saliency_bbox on the same saliency map, activation saliency
from the same forward and gradient saliency from a pass that leaves training untouched, each against a
hand-split forward with gradients; per-sample boxes; checkpoint replay; the refusals."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixhook import SaliencyMix
from tests.helpers import SmallCNN, gen, per_sample_ce


# From afm-shahab-uddin/SaliencyMix, SaliencyMix_CIFAR/saliencymix.py: saliency_bbox, with the OpenCV
# saliency map (computed there from the image) passed in as `saliencyMap` and `np.int` as `int`.
def reference_saliency_bbox(size, lam, saliencyMap):  # noqa: N803 (the authors' name)
    W = size[1]  # noqa: N806
    H = size[2]  # noqa: N806
    cut_rat = np.sqrt(1.0 - lam)
    cut_w = int(W * cut_rat)
    cut_h = int(H * cut_rat)
    maximum_indices = np.unravel_index(np.argmax(saliencyMap, axis=None), saliencyMap.shape)
    x = maximum_indices[0]
    y = maximum_indices[1]
    bbx1 = np.clip(x - cut_w // 2, 0, W)
    bby1 = np.clip(y - cut_h // 2, 0, H)
    bbx2 = np.clip(x + cut_w // 2, 0, W)
    bby2 = np.clip(y + cut_h // 2, 0, H)
    return bbx1, bby1, bbx2, bby2


def test_the_box_equals_the_authors_saliency_bbox_on_the_same_saliency_map():
    """At the input with a pinned (OpenCV-style) saliency: the box is centred on the first partner's
    peak, the partner's box pasted at the same place, lam the area kept: the authors' training step."""
    model = SmallCNN().train()
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    g = gen(5)
    for trial in range(30):
        x = torch.randn(4, 3, 12, 10)
        saliency = torch.rand(4, 12, 10, generator=g)
        lam = float(torch.rand((), generator=g))
        index = torch.randperm(4, generator=g)
        mix = SaliencyMix("input", saliency="gradient", generator=gen(trial))
        with mix.attach(model):
            mix.pin(saliency=saliency, lam=lam, index=index)
            model(x)
        # the authors' step: input[:, :, bbx1:bbx2, bby1:bby2] = input[rand_index, :, bbx1:bbx2, bby1:bby2]
        bbx1, bby1, bbx2, bby2 = reference_saliency_bbox(x[index[0]].size(), lam, saliency[index[0]].numpy())
        expected = x.clone()
        expected[:, :, bbx1:bbx2, bby1:bby2] = x[index, :, bbx1:bbx2, bby1:bby2]
        ref_lam = 1 - ((bbx2 - bbx1) * (bby2 - bby1) / (x.size()[-1] * x.size()[-2]))
        assert mix.last.info["box"].tolist() == [bbx1, bbx2, bby1, bby2]
        assert torch.equal(seen["x"], expected) and float(mix.last.lam) == pytest.approx(ref_lam, abs=1e-15)


def resnet(seed=0):
    torch.manual_seed(seed)
    return torchvision.models.resnet18(num_classes=3).double().train()


def stem(m, x):
    return m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(x)))))


def head(m, h):
    return m.fc(torch.flatten(m.avgpool(m.layer4(m.layer3(h))), 1))


@pytest.mark.slow
def test_activation_saliency_at_layer2_equals_a_hand_split_forward_with_gradients():
    """The saliency is mean_c |h| of layer2's own (unmixed) output, read from the same forward."""
    model = resnet()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 64, 64, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    index, lam = torch.tensor([2, 3, 1, 0]), 0.6
    mix = SaliencyMix("layer2", generator=gen())
    with mix.attach(model):
        mix.pin(lam=lam, index=index)
        logits = model(x)
        mix.loss(F.cross_entropy, logits, y).backward()
    m = by_hand
    h = m.layer2(stem(m, x))  # 8x8
    saliency = h.detach().abs().mean(1)
    torch.testing.assert_close(mix.last.info["saliency"], saliency, rtol=0, atol=0)
    peak = int(saliency[index[0]].argmax())
    cy, cx = peak // 8, peak % 8
    cut = int(8 * (1 - lam) ** 0.5)
    y1, y2, x1, x2 = (
        max(cy - cut // 2, 0),
        min(cy + cut // 2, 8),
        max(cx - cut // 2, 0),
        min(cx + cut // 2, 8),
    )
    assert mix.last.info["box"].tolist() == [y1, y2, x1, x2]
    kept = 1 - (y2 - y1) * (x2 - x1) / 64
    mixed = h.clone()
    mixed[:, :, y1:y2, x1:x2] = h[index, :, y1:y2, x1:x2]
    expected = head(m, mixed)
    (kept * F.cross_entropy(expected, y) + (1 - kept) * F.cross_entropy(expected, y[index])).backward()
    assert float(mix.last.lam) == kept and torch.equal(logits, expected)
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.slow
def test_gradient_saliency_is_the_label_loss_gradient_in_eval_mode_and_leaves_training_untouched():
    """The pass: eval mode, gradient of the summed cross-entropy w.r.t. layer1's output; no parameter
    .grad, no batch-norm statistic and no module's mode changed by it; per-sample boxes on each partner's
    peak; the training step as a hand-split forward."""
    model = resnet()
    model.layer3.eval()  # a module the user keeps in eval mode stays so
    by_hand, plain = copy.deepcopy(model), copy.deepcopy(model)
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    index, lam = torch.tensor([1, 0, 3, 2]), 0.7
    mix = SaliencyMix("layer1", saliency="gradient", mode="elem", generator=gen())
    with mix.attach(model):
        mix.pin(lam=lam, index=index)
        mix.use_targets(y)
        logits = model(x)
        assert all(p.grad is None for p in model.parameters())  # the pass touched no .grad
        assert model.training and not model.layer3.training and model.layer2.training
        mix.loss(per_sample_ce, logits, y).mean().backward()
    plain(x)  # one training forward: the statistics a single forward leaves
    assert int(model.bn1.num_batches_tracked) == 1
    torch.testing.assert_close(model.bn1.running_mean, plain.bn1.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(model.bn1.running_var, plain.bn1.running_var, rtol=0, atol=0)

    m = by_hand
    m.eval()
    h = stem(m, x).detach().requires_grad_()
    (g,) = torch.autograd.grad(F.cross_entropy(head(m, m.layer2(h)), y, reduction="sum"), [h])
    saliency = g.square().mean(1).sqrt()
    torch.testing.assert_close(mix.last.info["saliency"], saliency, rtol=1e-12, atol=0)
    m.train()
    m.layer3.eval()
    h = stem(m, x)
    boxes = mix.last.info["box"]
    assert boxes.shape == (4, 4)
    mixed, kept = h.clone(), []
    cut = int(8 * (1 - lam) ** 0.5)
    for i in range(4):
        peak = int(saliency[index[i]].argmax())
        cy, cx = peak // 8, peak % 8
        y1, y2 = max(cy - cut // 2, 0), min(cy + cut // 2, 8)
        x1, x2 = max(cx - cut // 2, 0), min(cx + cut // 2, 8)
        assert boxes[i].tolist() == [y1, y2, x1, x2]
        mixed[i, :, y1:y2, x1:x2] = h[index[i], :, y1:y2, x1:x2]
        kept.append(1 - (y2 - y1) * (x2 - x1) / 64)
    kept = torch.tensor(kept, dtype=torch.double)
    assert torch.equal(mix.last.lam, kept)
    expected = head(m, m.layer2(mixed))
    (kept * per_sample_ce(expected, y) + (1 - kept) * per_sample_ce(expected, y[index])).mean().backward()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_per_sample_boxes_sit_on_each_partners_peak():
    model = SmallCNN().train()
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    x, index = torch.randn(3, 3, 8, 8), torch.tensor([2, 0, 1])
    saliency = torch.zeros(3, 8, 8)
    peaks = [(1, 6), (4, 4), (7, 0)]  # sample k's most salient pixel
    for k, (r, c) in enumerate(peaks):
        saliency[k, r, c] = 1.0
    mix = SaliencyMix("input", saliency="gradient", mode="elem", generator=gen())
    with mix.attach(model):
        mix.pin(saliency=saliency, lam=0.75, index=index)  # side 8 * 0.5 = 4: half-sides 2
        model(x)
    expected, boxes = x.clone(), []
    for i in range(3):
        r, c = peaks[index[i]]
        y1, y2, x1, x2 = max(r - 2, 0), min(r + 2, 8), max(c - 2, 0), min(c + 2, 8)
        boxes.append([y1, y2, x1, x2])
        expected[i, :, y1:y2, x1:x2] = x[index[i], :, y1:y2, x1:x2]
    assert mix.last.info["box"].tolist() == boxes == [[5, 8, 0, 2], [0, 3, 4, 8], [2, 6, 2, 6]]
    assert torch.equal(seen["x"], expected)
    assert mix.last.lam.tolist() == [1 - 6 / 64, 1 - 12 / 64, 1 - 16 / 64]


def test_saliency_from_an_earlier_layer_is_resized_to_the_mixed_map():
    model = resnet()
    x = torch.randn(2, 3, 32, 32, dtype=torch.double)
    seen = {}
    model.layer1.register_forward_hook(lambda m, a, out: seen.__setitem__("h1", out.detach()))
    mix = SaliencyMix("layer2", saliency_layer="layer1", generator=gen())
    with mix.attach(model):
        model(x)
    expected = F.interpolate(seen["h1"].abs().mean(1, keepdim=True), size=(4, 4), mode="bilinear")[:, 0]
    torch.testing.assert_close(mix.last.info["saliency"], expected, rtol=0, atol=0)
    with pytest.raises(
        RuntimeError, match="SaliencyMix: saliency_layer 'layer3' did not run before the mixed layer 'layer2'"
    ):
        with SaliencyMix("layer2", saliency_layer="layer3").attach(model):
            model(x)


def test_a_checkpointed_gradient_saliency_mix_replays_the_same_box():
    """The segment holding the mixed layer is recomputed in backward: the same saliency, box and
    gradients as without checkpointing (the pass is not run again)."""

    class Net(nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            torch.manual_seed(0)
            self.ckpt = ckpt
            self.a = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.Tanh())
            self.b = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.Tanh())
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            h = self.a(x)
            h = checkpoint(self.b, h, use_reentrant=False) if self.ckpt else self.b(h)
            return self.fc(h.mean((2, 3)))

    x, y = torch.randn(4, 3, 8, 8, dtype=torch.double), torch.tensor([0, 1, 2, 1])
    results = []
    for ckpt in (False, True):
        model = Net(ckpt).double().train()
        mix = SaliencyMix("b.0", saliency="gradient", generator=gen(3))
        with mix.attach(model):
            for _ in range(3):
                mix.use_targets(y)
                model.zero_grad()
                mix.loss(F.cross_entropy, model(x), y).backward()
                results.append((mix.last.info["box"], [p.grad.clone() for p in model.parameters()]))
    for (box, grads), (box_c, grads_c) in zip(results[:3], results[3:], strict=True):
        assert torch.equal(box, box_c)
        torch.testing.assert_close(grads_c, grads, rtol=1e-12, atol=1e-12)


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match="SaliencyMix at 'input' with saliency='activation': the input is"):
        SaliencyMix(["input", "layer1"])
    with pytest.raises(ValueError, match="saliency must be one of activation, gradient, got 'opencv'"):
        SaliencyMix("layer1", saliency="opencv")
    with pytest.raises(ValueError, match="saliency_layer='layer1': an earlier module's name, for saliency="):
        SaliencyMix("layer2", saliency="gradient", saliency_layer="layer1")
    model, x = SmallCNN().train(), torch.randn(2, 3, 8, 8)
    mix = SaliencyMix("conv1", saliency="gradient")
    with mix.attach(model):
        with pytest.raises(
            RuntimeError, match=r"needs the batch's labels .* call use_targets\(y\) before each"
        ):
            model(x)
        mix.use_targets(torch.tensor([0, 1]))
        model(x)
        with pytest.raises(RuntimeError, match="needs the batch's labels"):  # labels serve one forward
            model(x)
        mix.use_targets(torch.tensor([0, 1, 2]))
        with pytest.raises(ValueError, match=r"use_targets\(\): \(3,\) labels for a batch of 2 logits"):
            model(x)
        mix.pin(saliency=torch.rand(2, 4, 4))
        with pytest.raises(
            ValueError, match=r"saliency of shape \(2, 4, 4\) does not fit the batch of 2 8x8"
        ):
            model(x)


def test_under_fsdp_a_gradient_pass_keeps_the_forwards_gathers_and_refuses_a_rank_alone(tmp_path):
    """FSDP2 (one process here, gloo): the gradient pass runs inside the model's forward, whose parameters
    FSDP gathered; the pass ends by sharding them again, and they are gathered again for the rest of that
    forward (else it would compute with the shards). With prob < 1 each rank decides alone whether to run
    the pass, so the ranks' all-gathers would wait forever: refused in one line at the pass."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = SmallCNN().double()
        plain = copy.deepcopy(model)
        fully_shard(model)
        x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
        outs = []
        for net in (model, plain):
            mixer = SaliencyMix("input", saliency="gradient", generator=torch.Generator().manual_seed(1))
            with mixer.attach(net):
                mixer.use_targets(y)
                outs.append(net(x))
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-14)
        lazy = SaliencyMix("input", saliency="gradient", prob=0.5, generator=torch.Generator().manual_seed(0))
        refusal = "prob=0.5 < 1 each rank decides alone"
        with lazy.attach(model), pytest.raises(RuntimeError, match=refusal) as e:
            for _ in range(20):
                lazy.use_targets(y)
                model(x)
        assert "\n" not in str(e.value)
    finally:
        dist.destroy_process_group()

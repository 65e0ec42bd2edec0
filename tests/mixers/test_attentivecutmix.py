"""Attentive CutMix: the partner's top cells against OpenMixup's top-k selection on the same feature map,
cell scores on uneven grids, a hand-split forward with gradients, the refusals."""

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision

from mixhook import AttentiveCutMix
from mixhook.mixers.attentivecutmix import cell_scores
from tests.helpers import SmallCNN, gen, per_sample_ce


# From Westlake-AI/openmixup, openmixup/models/augments/attentivemix.py: the top-k selection and the
# upsampled mask (1: the cells selected on `features`), with `.cuda()` dropped and F.upsample as
# F.interpolate.
def reference_mask(features, top_k, grid_scale):
    bs, _, att_size, _ = features.size()
    att_grid = att_size**2
    features = features.mean(1)
    _, att_idx = features.view(bs, att_grid).topk(top_k)
    att_idx = torch.cat([(att_idx // att_size).unsqueeze(1), (att_idx % att_size).unsqueeze(1)], dim=1)
    mask = torch.zeros(bs, 1, att_size, att_size)
    for i in range(bs):
        mask[i, 0, att_idx[i, 0, :], att_idx[i, 1, :]] = 1
    return F.interpolate(mask, scale_factor=grid_scale, mode="nearest")


def test_the_partners_top_cells_are_the_reference_selection_on_the_partners_features():
    model = SmallCNN().train()
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    g = gen(2)
    for _ in range(10):
        x = torch.randn(5, 3, 14, 14)
        features = torch.rand(5, 4, 7, 7, generator=g)  # a 7x7 feature map per image, as the paper's
        saliency = features.mean(1).repeat_interleave(2, 1).repeat_interleave(2, 2)  # on the 14x14 input
        index = torch.randperm(5, generator=g)
        mix = AttentiveCutMix("input", grid=7, top_k=6, saliency="gradient", generator=gen())
        with mix.attach(model):
            mix.pin(saliency=saliency, index=index)
            model(x)
        pasted = reference_mask(features[index], 6, 2)  # the partner's top cells, blown up to pixels
        expected = (1 - pasted) * x + pasted * x[index]
        torch.testing.assert_close(seen["x"], expected, rtol=0, atol=0)
        assert torch.equal(mix.last.lam, torch.full((5,), 1 - 6 / 49, dtype=torch.double))
        assert mix.last.info["cells"].shape == (5, 7, 7) and int((~mix.last.info["cells"]).sum()) == 30


def test_cells_of_uneven_size_are_scored_by_their_mean_and_weigh_lam_by_area():
    saliency = torch.arange(5 * 7, dtype=torch.double).view(1, 5, 7)
    scores = cell_scores(saliency, 2, 3)  # rows cut at 2 (0-1, 2-4), columns at 2 and 4 (0-1, 2-3, 4-6)
    assert scores[0, 0, 0] == saliency[0, :2, :2].mean() and scores[0, 1, 2] == saliency[0, 2:, 4:].mean()
    model = SmallCNN().train()
    mix = AttentiveCutMix("input", grid=(2, 3), top_k=1, saliency="gradient", generator=gen())
    with mix.attach(model):
        mix.pin(saliency=saliency.expand(2, 5, 7), index=[1, 0])
        model(torch.randn(2, 3, 5, 7))
    assert mix.last.lam.tolist() == [1 - 9 / 35] * 2  # the bottom-right cell, 3x3 pixels, is pasted


def test_attentive_cutmix_at_layer1_of_resnet18_equals_a_hand_split_forward_with_gradients():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    index = torch.tensor([3, 2, 0, 1])
    mix = AttentiveCutMix("layer1", grid=4, top_k=3, generator=gen())
    with mix.attach(model):
        mix.pin(index=index)
        logits = model(x)
        mix.loss(per_sample_ce, logits, y).mean().backward()
    m = by_hand
    h = m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(x)))))  # 8x8: 2x2 pixels a cell
    scores = torch.nn.functional.avg_pool2d(h.detach().abs().mean(1, keepdim=True), 2)[:, 0]
    keep = torch.ones(4, 16, dtype=torch.double)
    keep.scatter_(1, scores[index].flatten(1).topk(3).indices, 0.0)
    keep = keep.view(4, 1, 4, 4).repeat_interleave(2, 2).repeat_interleave(2, 3)
    lam = keep.flatten(1).mean(1)
    assert torch.equal(mix.last.lam, lam) and torch.equal(mix.last.info["mask"], keep[:, 0])
    expected = m.fc(
        torch.flatten(m.avgpool(m.layer4(m.layer3(m.layer2(keep * h + (1 - keep) * h[index])))), 1)
    )
    (lam * per_sample_ce(expected, y) + (1 - lam) * per_sample_ce(expected, y[index])).mean().backward()
    assert torch.equal(logits, expected)
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_refusals_are_one_line():
    for top_k in (0, 49, 2.0, True):
        with pytest.raises(ValueError, match=r"top_k must be an int from 1 to 48 \(the grid's cells - 1\)"):
            AttentiveCutMix("layer1", top_k=top_k)
    with pytest.raises(ValueError, match="AttentiveCutMix at 'input' with saliency='activation'"):
        AttentiveCutMix("input")
    model = SmallCNN().train()
    with pytest.raises(ValueError, match="AttentiveCutMix at 'conv1': its 8x8 map has fewer pixels than"):
        with AttentiveCutMix("conv1", grid=9).attach(model):
            model(torch.randn(2, 3, 8, 8))
    assert repr(AttentiveCutMix("conv1", grid=2, top_k=1)) == (
        "AttentiveCutMix(layer='conv1', prob=1.0, grid=(2, 2), top_k=1, saliency='activation')"
    )

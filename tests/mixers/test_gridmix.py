"""GridMix: the cells, the draw (round(lam * cells) kept, uniformly), a hand-split forward with gradients,
pinning, the refusals."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
import torchvision

from mixhook import GridMix
from mixhook.functional import sample_lam
from mixhook.geometry import cell_index, grid_mask
from tests.helpers import SmallCNN, gen


@pytest.mark.parametrize(("size", "cells"), [(8, 4), (10, 4), (7, 3), (5, 5), (32, 7)])
def test_cells_are_contiguous_and_differ_by_at_most_one_pixel(size, cells):
    index = cell_index(size, cells)
    assert index[0] == 0 and index[-1] == cells - 1 and bool((index.diff() >= 0).all())
    counts = torch.bincount(index, minlength=cells)
    assert int(counts.min()) >= 1 and int(counts.max() - counts.min()) <= 1
    for c in range(cells):  # cell c spans floor(c * size / cells) .. floor((c + 1) * size / cells) - 1
        assert torch.equal(
            (index == c).nonzero().flatten(), torch.arange(c * size // cells, (c + 1) * size // cells)
        )


def test_the_draw_keeps_round_lam_times_cells_uniformly_and_lam_is_the_kept_area():
    model, x = SmallCNN().train(), torch.randn(4, 3, 10, 9)
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    mix = GridMix("input", grid=(3, 4), generator=gen(6))
    twin = gen(6)
    hits = torch.zeros(3, 4)
    with mix.attach(model):
        for _ in range(200):
            model(x)
            lam = float(sample_lam(1.0, twin))
            index = torch.randperm(4, generator=twin)
            kept = torch.randperm(12, generator=twin)[: math.floor(lam * 12 + 0.5)]
            cells = torch.zeros(12, dtype=torch.bool)
            cells[kept] = True
            cells = cells.view(3, 4)
            assert torch.equal(mix.last.index, index) and torch.equal(mix.last.info["cells"], cells)
            mask = grid_mask(cells, 10, 9)
            assert torch.equal(mix.last.info["mask"], mask) and float(mix.last.lam) == float(mask.mean())
            m = mask.float()
            torch.testing.assert_close(seen["x"], m * x + (1 - m) * x[index], rtol=0, atol=0)
            hits += cells
    assert float(hits.min()) > 60 and float(hits.max()) < 140  # every cell kept about half the time


@pytest.mark.slow
def test_gridmix_at_layer2_of_resnet18_equals_a_hand_split_forward_with_gradients():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 64, 64, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    index = torch.tensor([3, 2, 1, 0])
    cells = torch.tensor([[1, 0, 0], [0, 1, 1]])
    mix = GridMix("layer2", grid=(2, 3), generator=gen())
    with mix.attach(model):
        mix.pin(cells=cells, index=index)
        logits = model(x)
        mix.loss(F.cross_entropy, logits, y).backward()
    m = by_hand
    h = m.layer2(m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(x))))))  # 8x8 here: columns cut at 2 and 5
    keep = torch.zeros(8, 8, dtype=torch.double)
    keep[:4, :2] = 1
    keep[4:, 2:] = 1
    lam = (8 + 24) / 64  # rows 0-3 x columns 0-1, rows 4-7 x columns 2-7
    assert float(mix.last.lam) == lam == float(keep.mean())
    expected = m.fc(torch.flatten(m.avgpool(m.layer4(m.layer3(keep * h + (1 - keep) * h[index]))), 1))
    (lam * F.cross_entropy(expected, y) + (1 - lam) * F.cross_entropy(expected, y[index])).backward()
    assert torch.equal(logits, expected)
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_pin_last_repeats_the_cells():
    model, x = SmallCNN().train(), torch.randn(4, 3, 8, 8)
    mix = GridMix(["input", "conv1"], grid=2, generator=gen(5))
    assert repr(mix) == "GridMix(layer=['input', 'conv1'], alpha=1.0, prob=1.0, grid=(2, 2))"
    with mix.attach(model):
        first = model(x)
        cells = mix.last.info["cells"]
        mix.pin_last()
        assert torch.equal(model(x), first) and torch.equal(mix.last.info["cells"], cells)


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        (0, "grid must be ints >= 1 with at least 2 cells in all, got 0"),
        (1, "grid must be ints >= 1 with at least 2 cells in all, got 1"),
        ((2, 2.5), r"grid must be ints >= 1 with at least 2 cells in all, got \(2, 2.5\)"),
        ("big", "grid must be an int or two ints \\(rows, columns\\), got 'big'"),
        (True, "grid must be an int or two ints \\(rows, columns\\), got True"),
    ],
)
def test_bad_grids_are_refused_in_one_line(grid, message):
    with pytest.raises(ValueError, match=message):
        GridMix("input", grid=grid)


def test_maps_smaller_than_the_grid_bad_cells_and_per_sample_lams_are_refused():
    model = SmallCNN().train()
    with pytest.raises(
        ValueError, match="GridMix at 'conv1': its 8x8 map has fewer pixels than the 9x2 grid"
    ):
        with GridMix("conv1", grid=(9, 2)).attach(model):
            model(torch.randn(2, 3, 8, 8))
    mix = GridMix("conv1")
    with mix.attach(model):
        mix.pin(cells=torch.ones(2, 2))
        with pytest.raises(ValueError, match=r"pinned cells must be a 4x4 tensor of 0/1, got shape \(2, 2\)"):
            model(torch.randn(2, 3, 8, 8))
        mix.pin(lam=torch.tensor([0.2, 0.8]))
        with pytest.raises(ValueError, match="GridMix cuts one grid per batch: pin one lam, not 2"):
            model(torch.randn(2, 3, 8, 8))

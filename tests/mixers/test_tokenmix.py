"""TokenMix: the block and random masks against the authors' generators on the same draws, the cells
blown up to the map, a hand-split forward with gradients, pinning, the refusals."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision

from mixhook import TokenMix
from mixhook.functional import sample_lam
from mixhook.geometry import block_token_mask, random_token_mask
from tests.helpers import SmallCNN, gen


class TorchRandom:
    """Python's ``random.uniform``/``random.randint`` and numpy's ``permutation``, drawn from a torch
    generator in the order the reference calls them, so that the reference code below runs on the draws
    mixhook makes."""

    def __init__(self, generator):
        self.g = generator

    def uniform(self, a, b):
        return a + (b - a) * float(torch.rand((), dtype=torch.float64, generator=self.g))

    def randint(self, a, b):
        return a + int(torch.randint(b - a + 1, (), generator=self.g))

    def permutation(self, n):
        return torch.randperm(n, generator=self.g).numpy()


# From Westlake-AI/openmixup, openmixup/models/augments/tokenmix.py (the authors' Sense-X/TokenMix masks):
# generate_mask and generate_mask_random, with `random`/`np.random` replaced by `rng`, the 14x14 grid by
# (width, height), and the returned mask left as the numpy array (1: the partner's token).
def reference_block_mask(rng, lam, mask_token_num_start, width=14, height=14, min_num_patches=1):
    min_aspect = 0.3
    log_aspect_ratio = (math.log(min_aspect), math.log(1 / min_aspect))
    mask = np.zeros(shape=(width, height), dtype=np.int32)
    mask_ratio = 1 - lam
    num_masking_patches = min(width * height, int(mask_ratio * width * height) + mask_token_num_start)
    max_num_patches = width * height
    mask_count = 0
    while mask_count < num_masking_patches:
        max_mask_patches = num_masking_patches - mask_count
        max_mask_patches = min(max_mask_patches, max_num_patches)
        delta = 0
        for _attempt in range(10):
            target_area = rng.uniform(min_num_patches, max_mask_patches)
            aspect_ratio = math.exp(rng.uniform(*log_aspect_ratio))
            h = int(round(math.sqrt(target_area * aspect_ratio)))
            w = int(round(math.sqrt(target_area / aspect_ratio)))
            if w < width and h < height:
                top = rng.randint(0, height - h)
                left = rng.randint(0, width - w)
                num_masked = mask[top : top + h, left : left + w].sum()
                if 0 < h * w - num_masked <= max_mask_patches:
                    for i in range(top, top + h):
                        for j in range(left, left + w):
                            if mask[i, j] == 0:
                                mask[i, j] = 1
                                delta += 1
                if delta > 0:
                    break
        if delta == 0:
            break
        else:
            mask_count += delta
    return mask


def reference_random_mask(rng, lam, mask_token_num_start=14, width=14, height=14):
    mask = np.zeros(shape=(width * height), dtype=np.int32)
    mask_ratio = 1 - lam
    num_masking_patches = min(width * height, int(mask_ratio * width * height) + mask_token_num_start)
    mask_idx = rng.permutation(width * height)[:num_masking_patches]
    mask[mask_idx] = 1
    return mask.reshape(width, width)


@pytest.mark.parametrize("extra", [0, 14])
def test_the_masks_equal_the_authors_generators_on_the_same_draws(extra):
    g, twin = gen(11), gen(11)
    for lam in (0.05, 0.3, 0.5, 0.77, 0.98):
        count = min(196, int((1 - lam) * 196) + extra)
        ours = block_token_mask(14, 14, count, g)
        theirs = reference_block_mask(TorchRandom(twin), lam, extra)
        assert np.array_equal(ours.numpy(), theirs.astype(bool)), lam
        assert int(ours.sum()) <= count
        ours = random_token_mask(14, 14, count, g)
        theirs = reference_random_mask(TorchRandom(twin), lam, extra)
        assert np.array_equal(ours.numpy(), theirs.astype(bool)) and int(ours.sum()) == count


def test_block_masks_reach_their_count_and_grow_in_blocks():
    g = gen(3)
    short, sizes = 0, []
    for count in range(1, 60):
        mask = block_token_mask(8, 8, count, g)
        short += int(mask.sum()) < count
        assert int(mask.sum()) <= count
        sizes.append(int(mask.sum()))
    assert short <= 3  # the loop gives up only when 10 tries place nothing new
    mask = block_token_mask(8, 8, 20, gen(0))
    neighbours = F.conv2d(mask.double()[None, None], torch.ones(1, 1, 3, 3, dtype=torch.double), padding=1)
    assert float((neighbours[0, 0][mask] - 1).mean()) > 2  # clustered: random tokens would average < 1


def test_the_draw_at_the_input_blows_the_cells_up_to_the_pixels_and_lam_is_the_kept_area():
    model, x = SmallCNN().train(), torch.randn(4, 3, 8, 8)
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    mix = TokenMix("input", grid=4, mask_type="random", generator=gen(4))
    twin = gen(4)
    with mix.attach(model):
        for _ in range(20):
            model(x)
            lam = float(sample_lam(1.0, twin))
            index = torch.randperm(4, generator=twin)
            cells = ~random_token_mask(4, 4, int((1 - lam) * 16), twin)
            assert torch.equal(mix.last.index, index) and torch.equal(mix.last.info["cells"], cells)
            mask = cells.repeat_interleave(2, 0).repeat_interleave(2, 1).float()  # 2x2 pixels a cell
            torch.testing.assert_close(seen["x"], mask * x + (1 - mask) * x[index], rtol=0, atol=0)
            assert float(mix.last.lam) == float(cells.double().mean())


def test_tokenmix_at_layer1_of_resnet18_equals_a_hand_split_forward_with_gradients():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    index = torch.tensor([1, 0, 3, 2])
    cells = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1]])
    mix = TokenMix("layer1", grid=3, generator=gen())
    with mix.attach(model):
        mix.pin(cells=cells, index=index)
        logits = model(x)
        mix.loss(F.cross_entropy, logits, y).backward()
    m = by_hand
    h = m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(x)))))  # 8x8: cells cut at 2 and 5 (floor(c * 8 / 3))
    keep = torch.ones(8, 8, dtype=torch.double)
    keep[0:2, 5:8] = 0
    keep[2:5, 0:2] = 0
    lam = 1 - (6 + 6) / 64
    assert float(mix.last.lam) == lam
    expected = m.fc(
        torch.flatten(m.avgpool(m.layer4(m.layer3(m.layer2(keep * h + (1 - keep) * h[index])))), 1)
    )
    (lam * F.cross_entropy(expected, y) + (1 - lam) * F.cross_entropy(expected, y[index])).backward()
    assert torch.equal(logits, expected)
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_pin_last_repeats_the_mask():
    model, x = SmallCNN().train(), torch.randn(4, 3, 8, 8)
    mix = TokenMix(["input", "conv1"], extra_tokens=2, generator=gen(5))
    assert repr(mix) == (
        "TokenMix(layer=['input', 'conv1'], alpha=1.0, prob=1.0, grid=None, mask_type='block', "
        "extra_tokens=2)"
    )
    with mix.attach(model):
        first = model(x)
        cells = mix.last.info["cells"]
        mix.pin_last()
        assert torch.equal(model(x), first) and torch.equal(mix.last.info["cells"], cells)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mask_type": "grid"}, "mask_type must be one of block, random, got 'grid'"),
        ({"extra_tokens": -1}, "extra_tokens must be an int >= 0, got -1"),
        ({"extra_tokens": 1.5}, "extra_tokens must be an int >= 0, got 1.5"),
        ({"grid": 1}, "grid must be ints >= 1 with at least 2 cells in all, got 1"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        TokenMix("input", **options)


def test_maps_smaller_than_the_grid_bad_cells_and_per_sample_lams_are_refused():
    model = SmallCNN().train()
    with pytest.raises(ValueError, match="TokenMix at 'conv1': its 8x8 map cannot hold a 9x2 grid"):
        with TokenMix("conv1", grid=(9, 2)).attach(model):
            model(torch.randn(2, 3, 8, 8))
    mix = TokenMix("conv1", grid=2)
    with mix.attach(model):
        mix.pin(cells=torch.ones(3, 2))
        with pytest.raises(ValueError, match=r"pinned cells must be a 2x2 tensor of 0/1, got shape \(3, 2\)"):
            model(torch.randn(2, 3, 8, 8))
        mix.pin(lam=[0.5, 0.5])
        with pytest.raises(ValueError, match="TokenMix cuts one mask per batch: pin one lam, not 2"):
            model(torch.randn(2, 3, 8, 8))

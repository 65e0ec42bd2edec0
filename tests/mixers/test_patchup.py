"""PatchUp: the block mask, hard and soft mixing, and the paper's target weights."""

import pytest
import torch
import torch.nn.functional as F

from mixhook import PatchUp
from mixhook.mixers.patchup import block_mask
from tests.helpers import SmallCNN, gen


def test_block_mask_is_max_pooled_bernoulli_centres_at_the_adjusted_rate():
    g = gen(2)
    twin = gen(2)
    mask = block_mask(4, 12, 10, 3, 0.5, g)
    rate = 0.5 * 12 * 10 / (9 * 10 * 8)
    centres = torch.bernoulli(torch.full((1, 4, 12, 10), rate, dtype=torch.float64), generator=twin)
    assert torch.equal(mask, F.max_pool2d(centres, 3, stride=1, padding=1)[0])
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    many = block_mask(64, 16, 16, 1, 0.3, gen(5))  # block 1: each feature altered with probability gamma
    assert abs(float(many.mean()) - 0.3) < 0.01


def setup_pinned(mode, lam=None):
    model = SmallCNN().train()
    x = torch.randn(4, 3, 8, 8)
    mask = torch.zeros(3, 8, 8)
    mask[:, 2:5, 1:4] = 1
    mask[0, 6:, 6:] = 1
    index = torch.tensor([1, 2, 3, 0])
    mix = PatchUp("input", block_size=3, gamma=0.5, mode=mode, generator=gen())
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    with mix.attach(model):
        mix.pin(mask=mask, index=index, **({"lam": lam} if lam is not None else {}))
        logits = model(x)
    return mix, x, mask, index, seen["x"], logits


def test_hard_patchup_swaps_blocks_and_weights_targets_by_the_kept_fraction():
    mix, x, m, index, mixed, logits = setup_pinned("hard")
    assert torch.equal(mixed, (1 - m) * x + m * x[index])
    p = float(m.mean())
    assert float(mix.last.lam) == pytest.approx(1 - p) and torch.equal(mix.last.info["mask"], m.double())
    y = torch.tensor([0, 1, 2, 3])
    onehot = F.one_hot(y, 5).float()
    torch.testing.assert_close(mix.targets(y, 5), (1 - p) * onehot + p * onehot[index])
    expected = (1 - p) * F.cross_entropy(logits, y) + p * F.cross_entropy(logits, y[index])
    torch.testing.assert_close(mix.loss(F.cross_entropy, logits, y), expected)


def test_soft_patchup_mixes_blocks_with_lam_and_follows_the_papers_target():
    mix, x, m, index, mixed, _ = setup_pinned("soft", lam=0.3)
    torch.testing.assert_close(mixed, (1 - m) * x + m * (0.3 * x + 0.7 * x[index]))
    p = float(m.mean())
    # the paper's target_reweighted: unchanged * t + lam * changed * t + (1 - lam) * changed * t[index]
    assert float(mix.last.lam) == pytest.approx((1 - p) + 0.3 * p)


def test_patchup_draws_fresh_masks_at_a_hidden_layer_and_trains():
    model = SmallCNN().train()
    x, y = torch.randn(6, 3, 10, 10), torch.tensor([0, 1, 2, 3, 4, 0])
    mix = PatchUp(["input", "act"], block_size=5, gamma=0.5, mode="hard", generator=gen(1))
    masks = []
    with mix.attach(model):
        for _ in range(6):
            loss = mix.loss(F.cross_entropy, model(x), y)
            loss.backward()
            masks.append(mix.last.info["mask"])
            assert mix.last.info["mask"].shape == ((3, 10, 10) if mix.last.layer == "input" else (8, 10, 10))
            assert 0 <= float(mix.last.lam) <= 1
    assert len({float(m.sum()) for m in masks}) > 1


def test_patchup_errors():
    with pytest.raises(ValueError, match="block_size must be an odd positive integer, got 4"):
        PatchUp("input", block_size=4)
    with pytest.raises(ValueError, match="mode must be 'soft' or 'hard'"):
        PatchUp("input", mode="medium")
    with pytest.raises(ValueError, match="gamma must be in \\[0, 1\\]"):
        PatchUp("input", gamma=2)
    model = SmallCNN().train()
    with PatchUp("conv2", block_size=7).attach(model):
        with pytest.raises(
            ValueError, match=r"block_size=7 is larger than the 4x4 feature map of layer 'conv2'"
        ):
            model(torch.randn(2, 3, 4, 4))

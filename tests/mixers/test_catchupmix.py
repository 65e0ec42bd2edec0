"""Catch-up Mix: the channel rule written out (relative filter influence from the activation maps' l2 norms,
the floor(lam C) own channels of lowest influence) against a hand-edited forward with gradients; CutMix at
the input; a layer drawn per batch; checkpoint replay, pin_last; the refusals."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixhook import CatchUpMix, CutMix
from tests.helpers import SmallCNN, gen


def rule(h, index, lam):
    """The rule, written out sample by sample and channel by channel (float64)."""
    b, c = h.shape[:2]
    out = h.clone()
    keep = math.floor(lam * c)
    for i in range(b):
        j = int(index[i])
        own = [float(h[i, k].norm()) for k in range(c)]
        partner = [float(h[j, k].norm()) for k in range(c)]
        rfi = [own[k] / sum(own) - partner[k] / sum(partner) for k in range(c)]
        lowest = sorted(range(c), key=lambda k: (rfi[k], k))[:keep]
        for k in range(c):
            if k not in lowest:
                out[i, k] = h[j, k]
    return out, keep / c


def test_the_channel_rule_at_a_hidden_layer_equals_the_hand_edited_forward_with_gradients():
    torch.manual_seed(0)
    model = SmallCNN().double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 4, 0])
    mix = CatchUpMix("conv1", generator=gen(3))
    with mix.attach(model):
        logits = model(x)
        mix.loss(F.cross_entropy, logits, y).backward()
    index, lam = mix.last.index, float(mix.last.lam)
    drawn = mix.last.info["kept"].sum(1)
    assert bool((drawn == drawn[0]).all()) and 0 < lam < 1
    m = by_hand
    h = m.conv1(x)
    mixed, expected_lam = rule(h.detach(), index, float(drawn[0]) / 8 + 1e-12)
    assert lam == expected_lam
    kept = mix.last.info["kept"]
    h = torch.where(kept[:, :, None, None], h, h[index])
    torch.testing.assert_close(h.detach(), mixed, rtol=0, atol=0)
    expected = m.head(m.conv2(m.act(h)).mean((2, 3)))
    assert torch.equal(logits, expected)
    (lam * F.cross_entropy(expected, y) + (1 - lam) * F.cross_entropy(expected, y[index])).backward()
    for p, q in zip(model.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_the_kept_channels_are_where_the_sample_lags_behind_its_partner():
    h = torch.zeros(2, 4, 3, 3, dtype=torch.float64)
    h[0, 0], h[0, 1], h[0, 2], h[0, 3] = 4.0, 1.0, 2.0, 1.0  # sample 0 strong in channel 0
    h[1, 0], h[1, 1], h[1, 2], h[1, 3] = 1.0, 4.0, 1.0, 2.0  # sample 1 strong in channel 1
    model = nn.Sequential(nn.Identity(), nn.Flatten(), nn.Linear(36, 2)).double().train()
    mix = CatchUpMix("0")
    with mix.attach(model):
        mix.pin(lam=0.5, index=torch.tensor([1, 0]))
        model(h)
    assert mix.last.info["kept"].tolist() == [[False, True, False, True], [True, False, True, False]]
    assert float(mix.last.lam) == 0.5


def test_at_the_input_it_is_cutmix_and_a_layer_is_drawn_per_batch():
    torch.manual_seed(0)
    model, x = SmallCNN().train(), torch.randn(4, 3, 8, 8)
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    a, b = CatchUpMix("input", generator=gen(5)), CutMix("input", generator=gen(5))
    with a.attach(model):
        model(x)
        mixed, box = seen["x"], a.last.info["box"]
    with b.attach(model):
        model(x)
    assert torch.equal(seen["x"], mixed) and b.last.info["box"] == box and torch.equal(b.last.lam, a.last.lam)
    mix = CatchUpMix(["input", "conv1", "conv2"], generator=gen(1))
    with mix.attach(model):
        layers = set()
        for _ in range(30):
            model(x)
            layers.add(mix.last.layer)
    assert layers == {"input", "conv1", "conv2"}


def test_checkpoint_replay_and_pin_last_repeat_the_mix():
    torch.manual_seed(0)
    model = SmallCNN().double().train()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    mix = CatchUpMix("conv1", generator=gen(2))
    with mix.attach(model):
        out = checkpoint(model, x, use_reentrant=False)
        out.sum().backward()
        first = mix.last
        mix.pin_last()
        torch.testing.assert_close(model(x), out, rtol=0, atol=0)
    same = CatchUpMix("conv1")
    with same.attach(plain):
        same.pin(lam=float(first.info["kept"].sum(1)[0]) / 8, index=first.index)
        plain(x).sum().backward()
        assert torch.equal(same.last.info["kept"], first.info["kept"])
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_a_single_channel_and_a_vector_are_refused_in_one_line():
    model = nn.Sequential(nn.Conv2d(3, 1, 1), nn.Flatten(), nn.Linear(16, 2)).train()
    with CatchUpMix("0").attach(model), pytest.raises(ValueError, match="one channel cannot be split"):
        model(torch.randn(2, 3, 4, 4))
    with CatchUpMix("1").attach(model), pytest.raises(TypeError, match="needs a"):
        model(torch.randn(2, 3, 4, 4))

"""OneOf (one regularizer per batch) and attach() (several hooks, one handle)."""

import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from mixhook import CutMix, GradScale, InputScale, ManifoldMixup, OneOf, attach
from tests.helpers import SmallCNN, hook_count


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_oneof_draws_with_p_and_exposes_the_chosen_ones_state():
    model = SmallCNN().train()
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    mixup, cutmix = ManifoldMixup("input", generator=gen(1)), CutMix("input", generator=gen(2))
    both = OneOf([mixup, cutmix], p=[0.3, 0.7], generator=gen(3))
    counts = [0, 0]
    with both.attach(model):
        for _ in range(600):
            logits = model(x)
            chosen = both.chosen
            counts[chosen is cutmix] += 1
            assert both.last is chosen.last and both.last is not None
            other = mixup if chosen is cutmix else cutmix
            assert other.last is None
            assert (both.last.box is not None) == (chosen is cutmix)
            torch.testing.assert_close(
                both.loss(F.cross_entropy, logits, y), chosen.loss(F.cross_entropy, logits, y)
            )
    assert stats.binomtest(counts[1], 600, 0.7).pvalue > 1e-3
    assert hook_count(model) == 0 and mixup.model is None and cutmix.model is None


def test_oneof_pin_and_validation():
    model = SmallCNN().train()
    mixup, cutmix = ManifoldMixup("conv1"), CutMix("conv1")
    both = OneOf([mixup, cutmix])
    with both.attach(model):
        both.pin(1, box=(0, 2, 0, 2))
        model(torch.randn(2, 3, 8, 8))
        assert both.chosen is cutmix and both.last.box == (0, 2, 0, 2)
        with pytest.raises(RuntimeError, match="already attached"):
            mixup.attach(model)
    with pytest.raises(ValueError, match="p must be 2 non-negative probabilities summing to 1"):
        OneOf([ManifoldMixup("input"), CutMix("input")], p=[0.5, 0.6])
    with pytest.raises(TypeError, match="two or more mixing regularizers"):
        OneOf([ManifoldMixup("input"), GradScale("input", 1.0)])
    alone = ManifoldMixup("conv1")
    with alone.attach(model):
        with pytest.raises(RuntimeError, match=r"already has a mixing regularizer attached \(ManifoldMixup"):
            OneOf([alone, CutMix("conv1")]).attach(model)


def test_attach_several_hooks_with_one_handle():
    model = SmallCNN().train()
    x = torch.randn(3, 3, 8, 8)
    mix, scale, grad = ManifoldMixup("conv2"), InputScale("input", 2.0), GradScale("conv1", 0.5)
    with attach(model, mix, scale, grad):
        model(x)
        assert mix.last is not None and float(scale.last) == 2.0 and grad.model is model
    assert hook_count(model) == 0 and mix.model is None


def test_attach_refuses_two_mixing_regularizers_and_cleans_up_on_failure():
    model = SmallCNN()
    with pytest.raises(ValueError, match=r"2 mixing regularizers \(ManifoldMixup, CutMix\).*OneOf"):
        attach(model, ManifoldMixup("input"), CutMix("input"))
    with pytest.raises(KeyError, match="nosuch"):
        attach(model, InputScale("input", 2.0), GradScale("nosuch", 1.0))
    assert hook_count(model) == 0

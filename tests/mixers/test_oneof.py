"""OneOf: one mixing regularizer of several per batch, through the mixers' public contract."""

import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from mixhook import CutMix, GradScale, ManifoldMixup, OneOf
from tests.helpers import SmallCNN, gen, hook_count


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
            assert ("box" in both.last.info) == (chosen is cutmix)
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
        assert both.chosen is cutmix and both.last.info["box"] == (0, 2, 0, 2)
        with pytest.raises(RuntimeError, match="already attached"):
            mixup.attach(model)
    with pytest.raises(ValueError, match=r"choice=0..1 \(layer 'conv1' is in 2 of them\)"):
        both.pin(layer="conv1")
    with pytest.raises(ValueError, match="p must be 2 non-negative probabilities summing to 1"):
        OneOf([ManifoldMixup("input"), CutMix("input")], p=[0.5, 0.6])
    with pytest.raises(TypeError, match="two or more mixing regularizers"):
        OneOf([ManifoldMixup("input"), GradScale("input", 1.0)])
    alone = ManifoldMixup("conv1")
    with alone.attach(model):
        with pytest.raises(RuntimeError, match=r"already has a mixing regularizer attached \(ManifoldMixup"):
            OneOf([alone, CutMix("conv1")]).attach(model)
    other = SmallCNN().train()
    with alone.attach(other):
        with pytest.raises(RuntimeError, match=r"OneOf: \['ManifoldMixup'\] already attached on their own"):
            OneOf([alone, CutMix("conv1")]).attach(model)
    with CutMix("conv1").attach(model):  # the refused OneOf left no claim on the model
        model(torch.randn(2, 3, 8, 8))


def test_a_mixer_with_global_partners_is_refused_inside_oneof():
    """OneOf chooses per rank; a cross-rank mix on some ranks only would wait forever."""
    with pytest.raises(
        ValueError, match="OneOf draws its choice on each rank, but a mixer with partners='global'"
    ):
        OneOf([ManifoldMixup("input", partners="global"), CutMix("input")])

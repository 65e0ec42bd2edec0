"""``weigh``: a per-sample metric under the mix, weighted as ``loss`` weighs a criterion but without a
method's own loss terms (the app's lam-weighted training accuracy): against a hand computation for a
blend, per-sample lams, a clean+mixed forward (2B values, RankMixup's ranking term left out), OneOf,
an unmixed forward, and the class-confidence methods' refusal of regression labels."""

import pytest
import torch
from torch import nn

from mixhook import ManifoldMixup, MixupE, OneOf, RankMixup
from mixhook.engine.card import METHODS, methods_with, traits_of
from tests.helpers import gen


def correct(logits, target):
    return (logits.argmax(1) == target).double()


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)).double().train()


X = torch.randn(8, 6, dtype=torch.float64, generator=gen(1))
Y = torch.randint(0, 4, (8,), generator=gen(2))


@pytest.mark.parametrize("mode", ["batch", "elem"])
def test_a_mixed_forward_weighs_each_sample_by_its_lam(mode):
    model, mix = net(), ManifoldMixup("1", mode=mode, generator=gen(3))
    with mix.attach(model):
        logits = model(X)
        weighed = mix.weigh(correct, logits, Y)
        last = mix.last
    pred = logits.argmax(1)
    lam = last.lam.expand(8) if last.lam.ndim == 0 else last.lam
    expected = lam * (pred == Y) + (1 - lam) * (pred == Y[last.index])
    torch.testing.assert_close(weighed, expected.double(), rtol=0, atol=1e-15)
    assert not torch.equal(weighed, correct(logits, Y))  # partners with other labels weigh


def test_a_clean_and_mixed_forward_gives_the_clean_rows_then_the_mixed_ones_without_the_methods_terms():
    for cls in (METHODS[name] for name in methods_with("clean") if "pixels" not in traits_of(METHODS[name])):
        model, mix = net(), cls("1", generator=gen(4))
        with mix.attach(model):
            logits = model(X)
            weighed = mix.weigh(correct, logits, Y)
            last = mix.last
        pred = logits.argmax(1)
        lam = last.lam
        mixed = lam * (pred[8:] == Y) + (1 - lam) * (pred[8:] == Y[last.index])
        torch.testing.assert_close(weighed, torch.cat([(pred[:8] == Y).double(), mixed.double()]))


def test_one_of_and_an_unmixed_forward():
    model = net()
    mix = OneOf([ManifoldMixup("0"), ManifoldMixup("1", mode="elem")], generator=gen(5))
    with mix.attach(model):
        logits = model(X)
        chosen = mix.last
        weighed = mix.weigh(correct, logits, Y)
        model.eval()
        plain = model(X)
        assert torch.equal(mix.weigh(correct, plain, Y), correct(plain, Y))
    pred = logits.argmax(1)
    expected = chosen.lam * (pred == Y) + (1 - chosen.lam) * (pred == Y[chosen.index])
    torch.testing.assert_close(weighed, expected.double())


def test_methods_that_compare_class_confidences_refuse_regression_labels_in_one_line():
    for cls in (RankMixup, MixupE):
        with pytest.raises(
            ValueError, match=f"{cls.__name__} compares class confidences, so its labels must"
        ):
            cls("input").check_targets(torch.randn(8))
        cls("input").check_targets(Y)

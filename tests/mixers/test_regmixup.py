"""RegMixup against its authors' code on the same draws: one forward of the clean batch and its mixup,
cross-entropy on both (FrancescoPinto/RegMixup), at the input and, edited by hand, at a hidden layer."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import RegMixup
from tests.helpers import exact, grads
from tests.toy_models import TinyConvNet


# FrancescoPinto/RegMixup, models/regmixup.py: the criterion and the lines of training_step it uses
def regmixup_criterion(criterion, pred, y_a, y_b, lam):
    return lam * criterion(pred, y_a) + (1 - lam) * criterion(pred, y_b)


def authors_step(model, x, y, lam, index):
    # models/regularizers/mixup.py mixup_data, with the draws given instead of np.random / torch.randperm
    mixup_x, part_y_a, part_y_b = lam * x + (1 - lam) * x[index], y, y[index]
    targets_a = torch.cat([y, part_y_a])
    targets_b = torch.cat([y, part_y_b])
    x = torch.cat([x, mixup_x], dim=0)
    logits = model(x)
    return regmixup_criterion(F.cross_entropy, logits, targets_a, targets_b, lam)


def test_regmixup_at_the_input_equals_the_authors_training_step_batchnorm_included():
    """The authors' model sees the concatenated batch in one forward, as the hooks make it: the same
    BatchNorm statistics, the same loss and gradients."""
    torch.manual_seed(0)
    model = TinyConvNet(3, 5).double().train()
    x, y = torch.randn(6, 3, 8, 8, dtype=torch.double), torch.tensor([0, 1, 2, 3, 4, 0])
    lam, index = 0.37, torch.tensor([2, 0, 5, 1, 4, 3])
    reg = RegMixup("input", generator=torch.Generator().manual_seed(0))
    with reg.attach(model):
        reg.pin(lam=lam, index=index)
        ours = reg.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), model(x), y).mean()
        ours.backward()
    got = grads(model)
    model.zero_grad()
    theirs = authors_step(model, x, y, lam, index)
    theirs.backward()
    exact(ours, theirs)
    for name, g in grads(model).items():
        exact(got[name], g)


def test_regmixup_at_a_hidden_layer_equals_the_forward_edited_by_hand_and_eta_weighs_the_mixed_rows():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)).double().train()
    x, y = torch.randn(5, 6, dtype=torch.double), torch.tensor([0, 1, 2, 3, 1])
    lam, index = 0.8, torch.tensor([4, 3, 2, 1, 0])
    reg = RegMixup("1", eta=0.5)
    with reg.attach(model):
        reg.pin(lam=lam, index=index)
        logits = model(x)
        ours = reg.loss(F.cross_entropy, logits, y)
    h = model[1](model[0](x))
    hand = model[2](torch.cat([h, lam * h + (1 - lam) * h[index]]))
    exact(logits, hand)
    mixup = lam * F.cross_entropy(hand[5:], y) + (1 - lam) * F.cross_entropy(hand[5:], y[index])
    exact(ours, (F.cross_entropy(hand[:5], y) + 0.5 * mixup) / 2)


def test_regmixup_draws_the_papers_large_alpha():
    reg = RegMixup("input", generator=torch.Generator().manual_seed(0))
    draws = torch.stack([reg.sample_lam(4, reg.generator) for _ in range(2000)])
    assert reg.alpha == 20.0 and abs(float(draws.mean()) - 0.5) < 0.01
    assert abs(float(draws.std()) - (1 / (4 * 41)) ** 0.5) < 0.01  # Beta(20, 20): sd = sqrt(1/164)
    with pytest.raises(ValueError, match="alpha must be"):
        RegMixup("input", alpha=0)

"""RankMixup's mixup ranking loss (MRL) against its authors' code on the same draws
(cvlab-yonsei/RankMixup), at the input and at a hidden layer, and where the two differ, why."""

import pytest
import torch
import torch.nn.functional as F

from mixhook import RankMixup
from tests.helpers import StemHead, exact, grads


# cvlab-yonsei/RankMixup, calibrate/losses/rankmixup.py: RankMixup_MRL.forward (its 2-D path)
def mrl(inputs, targets, mixup, target_re, margin, alpha):
    loss_ce = F.cross_entropy(inputs, targets)
    self_mixup_mask = (target_re == 1.0).sum(dim=1).reshape(1, -1)
    self_mixup_mask = self_mixup_mask.sum(dim=0) == 0.0
    max_values = inputs.max(dim=1)[0].unsqueeze(dim=1)
    max_values_mixup = mixup.max(dim=1)[0].unsqueeze(dim=1)
    diff = max_values_mixup - max_values
    loss_mixup = (self_mixup_mask * F.relu(diff + margin)).mean()
    return loss_ce + alpha * loss_mixup


# calibrate/net/resnet_mixup.py: mixup_process and to_one_hot, with the draws given
def mixup_process(out, target_reweighted, lam, indices):
    out = out * lam + out[indices] * (1 - lam)
    target_reweighted = target_reweighted * lam + target_reweighted[indices] * (1 - lam)
    return out, target_reweighted


def authors(model, x, y, lam, index, layer, margin, alpha):
    """The trainer's step: a clean forward, then forward_multimixup (num_mixup=1) mixing at ``layer``."""
    outputs = model(x)
    onehot = F.one_hot(y, 4).double()
    if layer == "input":
        mixed, target_re = mixup_process(x, onehot, lam, index)
        mixup = model(mixed)
    else:
        h, target_re = mixup_process(model.stem(x), onehot, lam, index)
        mixup = model.head(torch.tanh(h))
    return mrl(outputs, y, mixup, target_re, margin, alpha)


@pytest.mark.parametrize("layer", ["input", "stem"])
def test_rankmixup_equals_the_authors_loss_and_gradients_when_every_partner_has_another_label(layer):
    torch.manual_seed(0)
    model = StemHead().double().train()
    x, y = torch.randn(6, 6, dtype=torch.double), torch.tensor([0, 1, 2, 3, 0, 1])
    lam, index = 0.25, torch.tensor([1, 2, 3, 4, 5, 0])  # every pair of two labels
    rank = RankMixup(layer, margin=2.0, weight=0.1)
    with rank.attach(model):
        rank.pin(lam=lam, index=index)
        ours = rank.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), model(x), y)
        assert ours.shape == (6,)
        ours.mean().backward()
    got = grads(model)
    model.zero_grad()
    theirs = authors(model, x, y, lam, index, layer, 2.0, 0.1)
    theirs.backward()
    exact(ours.mean(), theirs)
    for name, g in grads(model).items():
        exact(got[name], g)


def test_a_partner_of_the_same_label_is_masked_per_sample_where_the_authors_code_broadcasts():
    """With a same-label pair the authors' (B,) mask times (B, 1) hinge is a (B, B) product: their term
    is mean(mask) * mean(hinge). Ours masks each sample's own hinge, as the paper writes the loss."""
    torch.manual_seed(0)
    model = StemHead().double().train()
    x, y = torch.randn(4, 6, dtype=torch.double), torch.tensor([0, 0, 1, 2])
    lam, index = 0.25, torch.tensor([1, 0, 3, 2])  # samples 0 and 1: the same label
    rank = RankMixup("input", margin=2.0, weight=0.1)
    with rank.attach(model):
        rank.pin(lam=lam, index=index)
        logits = model(x)
        ours = rank.loss(F.cross_entropy, logits, y)
    clean, mixed = logits[:4], logits[4:]
    hinge = F.relu(mixed.max(1)[0] - clean.max(1)[0] + 2.0)
    mask = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.double)
    exact(ours, F.cross_entropy(clean, y) + 0.1 * (mask * hinge).mean())
    theirs = mrl(
        clean, y, mixed, lam * F.one_hot(y, 4).double() + (1 - lam) * F.one_hot(y[index], 4), 2.0, 0.1
    )
    exact(theirs, F.cross_entropy(clean, y) + 0.1 * mask.mean() * hinge.mean())
    assert not torch.allclose(ours, theirs)
    with rank.attach(model):  # lam = 1 keeps one label: masked too
        rank.pin(lam=1.0, index=index)
        logits = model(x)
        exact(rank.loss(F.cross_entropy, logits, y), F.cross_entropy(logits[:4], y))


def test_rankmixup_refuses_what_it_cannot_rank():
    model = StemHead().double().train()
    rank = RankMixup("input")
    x = torch.randn(4, 6, dtype=torch.double)
    with rank.attach(model):
        logits = model(x)
        with pytest.raises(ValueError, match="class indices"):
            rank.loss(F.mse_loss, logits, torch.randn(4, dtype=torch.double))
        with pytest.raises(ValueError, match="no criterion of mixed targets; train with its loss"):
            rank.targets(torch.tensor([0, 1, 2, 3]), 4, logits=logits)  # BCE on them would drop the ranking
    with pytest.raises(ValueError, match="margin must be"):
        RankMixup("input", margin=-1.0)

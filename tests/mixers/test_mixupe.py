"""MixupE against its authors' code on the same draws (oneHuster/MixupE, mixup.py, mixupe_version 3):
the loss and its gradients, at the input and at a hidden layer."""

import math

import pytest
import torch
import torch.nn.functional as F

from mixhook import MixupE
from tests.helpers import StemHead, exact, grads


# oneHuster/MixupE, mixup.py: training_method's 'mixupe' branch, mixupe_version == 3, with the draws given
# (mixup_data's np.random.beta and torch.randperm) and the mixed forward at ``layer``
def authors(model, input, target, lam, index, alpha, eta, threshold, num_classes, layer):
    bs = target.size(0)
    lamba_mod_mean = (alpha + 1) / ((alpha + 1) + alpha)  # beta_mean(alpha + 1, alpha)
    if layer == "input":
        output = model(lam * input + (1 - lam) * input[index, :])
    else:
        h = model.stem(input)
        output = model.head(torch.tanh(lam * h + (1 - lam) * h[index]))
    loss = lam * F.cross_entropy(output, target) + (1 - lam) * F.cross_entropy(output, target[index])
    loss_scale = torch.abs(loss.detach().data.clone())
    y_onehot = torch.zeros(bs, num_classes, dtype=output.dtype)
    y_onehot.scatter_(1, target.view(bs, 1), 1)
    x = input.clone().detach().requires_grad_(True)
    f = model(x)
    b = y_onehot - torch.softmax(f, dim=1)
    loss_new = torch.sum(f * b, dim=1)
    negative_index = torch.nonzero(loss_new.data < threshold).squeeze().detach().data.clone()
    loss_new = (1.0 - lamba_mod_mean) * torch.sum(loss_new[negative_index]) / bs
    loss = loss - (eta * loss_new)
    loss_new_scale = torch.abs(loss.detach().data.clone())
    return (loss_scale / loss_new_scale) * loss


@pytest.mark.parametrize("layer", ["input", "stem"])
@pytest.mark.parametrize("threshold", [1.0, 0.05, math.inf])
def test_mixupe_equals_the_authors_loss_and_gradients(layer, threshold):
    torch.manual_seed(0)
    model = StemHead().double().train()
    x, y = torch.randn(6, 6, dtype=torch.double), torch.tensor([0, 1, 2, 3, 0, 1])
    lam, index = 0.3, torch.tensor([1, 2, 3, 4, 5, 0])
    eta = 0.5  # large enough for the term to matter in the comparison (the authors' CIFAR-100: 0.001)
    for reduce in (True, False):
        mix = MixupE(layer, alpha=2.0, eta=eta, threshold=threshold)
        model.zero_grad()
        with mix.attach(model):
            mix.pin(lam=lam, index=index)
            logits = model(x)
            criterion = F.cross_entropy if reduce else (lambda o, t: F.cross_entropy(o, t, reduction="none"))
            ours = mix.loss(criterion, logits, y)
            assert ours.shape == (() if reduce else (6,))
            ours = ours.mean()
            ours.backward()
        got = grads(model)
        model.zero_grad()
        theirs = authors(model, x, y, lam, index, 2.0, eta, threshold, 4, layer)
        theirs.backward()
        exact(ours, theirs)
        for name, g in grads(model).items():
            exact(got[name], g)


def test_the_term_changes_the_gradient_and_the_threshold_selects_samples():
    torch.manual_seed(0)
    model = StemHead().double().train()
    x, y = torch.randn(6, 6, dtype=torch.double), torch.tensor([0, 1, 2, 3, 0, 1])
    results = []
    for eta, threshold in ((0.0, 1.0), (0.5, 1.0), (0.5, -math.inf)):
        mix = MixupE("stem", eta=eta, threshold=threshold)
        model.zero_grad()
        with mix.attach(model):
            mix.pin(lam=0.3, index=[1, 2, 3, 4, 5, 0])
            logits = model(x)
            loss = mix.loss(F.cross_entropy, logits, y)
            loss.backward()
        results.append((loss.detach(), grads(model)["stem.weight"]))
    (plain, g0), (_, g1), (none, g2) = results
    mixed = logits[6:]
    exact(plain, 0.3 * F.cross_entropy(mixed, y) + 0.7 * F.cross_entropy(mixed, y[[1, 2, 3, 4, 5, 0]]))
    assert not torch.allclose(g0, g1)  # the term moves the gradient
    exact(g2, g0)  # no sample under the threshold: the mixup loss alone
    with pytest.raises(ValueError, match="threshold must be"):
        MixupE("stem", threshold=float("nan"))

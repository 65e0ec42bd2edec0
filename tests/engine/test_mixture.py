"""Mixes of more than two samples per row (``Mixed.mixture``): ``loss``, ``targets`` and ``weigh`` take the
K labels and their weights (one per term, or one per row), with the clean rows kept, against hand-written
sums in float64; a loss policy's two-label weights, dense targets and a malformed mixture refused in one
line."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import Mixed, Mixer
from mixhook.policies import LocalWeights

INDICES = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0], [3, 0, 1, 2]])


class ThreeWay(Mixer):
    """A mix of three samples per row at the input: ``sum_k w[k] * x[INDICES[k]]``, with weights one per
    term (``per_row=False``) or one per row."""

    def __init__(self, per_row=False, mixture=None, **kwargs):
        super().__init__("input", alpha=1.0, **kwargs)
        self.per_row, self.given = per_row, mixture

    def mix(self, leaves, draw):
        h = leaves[0].tensor
        weights = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
        if self.per_row:
            weights = torch.tensor([[0.6, 0.5, 0.4, 0.7], [0.3, 0.25, 0.4, 0.1], [0.1, 0.25, 0.2, 0.2]])
            weights = weights.double()
        w = weights.to(h.dtype).view(3, -1, *[1] * (h.ndim - 1))
        mixed = sum(w[k] * h[INDICES[k]] for k in range(3))
        mixture = (INDICES, weights) if self.given is None else self.given
        return Mixed({leaves[0].path: mixed}, lam=weights[0], index=INDICES[1], mixture=mixture)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double().train()


X, Y = torch.randn(4, 6, dtype=torch.double), torch.tensor([0, 2, 1, 2])


@pytest.mark.parametrize("per_row", [False, True])
def test_the_loss_targets_and_weigh_are_the_sums_over_the_k_labels(per_row):
    model, mix = net(), ThreeWay(per_row=per_row)
    with mix.attach(model):
        logits = model(X)
        loss = mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, Y)
        soft = mix.targets(Y, 3, smoothing=0.1, dtype=torch.double, logits=logits)
        hits = mix.weigh(lambda o, t: (o.argmax(1) == t).double(), logits, Y)
    _, weights = mix.last.mixture
    w = weights if per_row else weights[:, None].expand(3, 4)
    expected = sum(w[k] * F.cross_entropy(logits, Y[INDICES[k]], reduction="none") for k in range(3))
    torch.testing.assert_close(loss, expected, rtol=1e-14, atol=1e-15)
    one_hot = F.one_hot(Y, 3).double() * 0.9 + 0.1 / 3
    torch.testing.assert_close(soft, sum(w[k, :, None] * one_hot[INDICES[k]] for k in range(3)))
    expected_hits = sum(w[k] * (logits.argmax(1) == Y[INDICES[k]]).double() for k in range(3))
    torch.testing.assert_close(hits, expected_hits, rtol=0, atol=1e-15)
    mixed = sum(w[k, :, None] * X[INDICES[k]] for k in range(3))
    torch.testing.assert_close(logits, net()(mixed), rtol=0, atol=1e-14)  # (the forward is the mix)


def test_weights_one_per_term_take_a_reducing_criterion_and_the_gradients_are_the_hand_sums():
    model, hand = net(), net()
    mix = ThreeWay()
    with mix.attach(model):
        mix.loss(F.cross_entropy, model(X), Y).backward()
    mixed = 0.5 * X[INDICES[0]] + 0.3 * X[INDICES[1]] + 0.2 * X[INDICES[2]]
    logits = hand(mixed)
    sum(w * F.cross_entropy(logits, Y[INDICES[k]]) for k, w in enumerate((0.5, 0.3, 0.2))).backward()
    for a, b in zip(model.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-13, atol=1e-15)


def test_with_the_clean_batch_kept_the_mixed_rows_take_the_k_labels():
    model, mix = net(), ThreeWay()
    mix.clean = True
    with mix.attach(model):
        logits = model(X)
        loss = mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, Y)
        soft = mix.targets(Y, 3, dtype=torch.double, logits=logits)
    clean, mixed = logits[:4], logits[4:]
    sums = sum(
        w * F.cross_entropy(mixed, Y[INDICES[k]], reduction="none") for k, w in enumerate((0.5, 0.3, 0.2))
    )
    torch.testing.assert_close(loss, torch.cat([F.cross_entropy(clean, Y, reduction="none"), sums]))
    assert soft.shape == (8, 3) and torch.equal(soft[:4], F.one_hot(Y, 3).double())


def test_refusals_are_one_line():
    model = net()
    mix = ThreeWay(per_row=True)
    with mix.attach(model):
        logits = model(X)
        with pytest.raises(
            ValueError, match=r"^loss\(\): the mix weighs each of its 3 labels by one weight per"
        ):
            mix.loss(F.cross_entropy, logits, Y)  # (a mean: no weight per sample can enter it)
        with pytest.raises(
            ValueError, match=r"^targets\(\): ThreeWay mixed 3 samples per row with one weight"
        ):
            mix.targets(torch.zeros(4, 2, 2, dtype=torch.int64), 3, logits=logits)

    class Declared(ThreeWay):
        samples_per_row = 3

    with pytest.raises(
        TypeError, match="^LocalWeights weighs two labels per row, and Declared mixes up to 3"
    ):
        Declared().use(LocalWeights(sigma=1.0))  # (declared: refused when used, before training)
    weighted = ThreeWay().use(LocalWeights(sigma=1.0))  # (undeclared: refused at the loss)
    with weighted.attach(model):
        weighted.use_features(X)
        logits = model(X)
        with pytest.raises(
            ValueError, match=r"^loss\(\): ThreeWay mixed 3 samples per row, which the two-label"
        ):
            weighted.loss(F.cross_entropy, logits, Y)
    for mixture, message in (
        ((INDICES[:1], torch.ones(1)), r"returned a mixture of indices \(1, 4\) .* K >= 2"),
        ((INDICES, torch.ones(3, 2)), r"returned a mixture of indices \(3, 4\) and weights \(3, 2\)"),
        ((INDICES, torch.tensor([0.5, 0.5, 0.5])), "mixture weights that do not sum to one for every row"),
    ):
        with ThreeWay(mixture=mixture).attach(model), pytest.raises(ValueError, match=message):
            model(X)

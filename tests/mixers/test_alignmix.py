"""AlignMix against its authors' code on the same draws (shashankvkt/AlignMixup_CVPR22): the Sinkhorn plan,
both alignment directions, logits and gradients in float64; what it refuses."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import AlignMix
from mixhook.mixers.alignmix import sinkhorn_plan
from tests.helpers import exact as helpers_exact
from tests.helpers import grads

exact = partial(helpers_exact, rtol=1e-10, atol=1e-12)  # (this file's tolerance)


# shashankvkt/AlignMixup_CVPR22, cifar10_100/utils/OT.py: SinkhornDistance.forward, with .cuda() dropped
# and the marginals in the features' dtype (theirs: float32) so that the two compare in float64
def authors_sinkhorn(x, y, eps=0.1, max_iter=100):
    def M(C, u, v):
        return (-C + u.unsqueeze(-1) + v.unsqueeze(-2)) / eps

    C = torch.sum((torch.abs(x.unsqueeze(-2) - y.unsqueeze(-3))) ** 2, -1)
    x_points, y_points, batch_size = x.shape[-2], y.shape[-2], x.shape[0]
    mu = torch.empty(batch_size, x_points, dtype=x.dtype).fill_(1.0 / x_points).squeeze()
    nu = torch.empty(batch_size, y_points, dtype=x.dtype).fill_(1.0 / y_points).squeeze()
    u, v = torch.zeros_like(mu), torch.zeros_like(nu)
    thresh = 1e-1
    for _ in range(max_iter):
        u1 = u
        u = eps * (torch.log(mu + 1e-8) - torch.logsumexp(M(C, u, v), dim=-1)) + u
        v = eps * (torch.log(nu + 1e-8) - torch.logsumexp(M(C, u, v).transpose(-2, -1), dim=-1)) + v
        err = (u - u1).abs().sum(-1).mean()
        if err.item() < thresh:
            break
    return torch.exp(M(C, u, v))


# cifar10_100/models/resnet18_classifier.py: mixup_aligned, with the permutation and direction given
def mixup_aligned(out, lam, indices, align_mix):
    feat1 = out.view(out.shape[0], out.shape[1], -1)
    feat2 = out[indices].view(out.shape[0], out.shape[1], -1)
    P = authors_sinkhorn(feat1.permute(0, 2, 1), feat2.permute(0, 2, 1)).detach()
    P = P * (out.size(2) * out.size(3))
    if align_mix == 0:
        f1 = torch.matmul(feat2, P.permute(0, 2, 1)).view(out.shape)
        final = feat1.view(out.shape) * lam + f1 * (1 - lam)
    else:
        f2 = torch.matmul(feat1, P).view(out.shape)
        final = f2 * lam + feat2.view(out.shape) * (1 - lam)
    return final


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.stage = nn.Conv2d(6, 8, 3, stride=2, padding=1)  # 4x4 maps, as the authors' layer4
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.stage(torch.relu(self.conv(x))).mean((2, 3)))


def test_the_plan_equals_the_authors_sinkhorn_and_is_a_transport_plan():
    torch.manual_seed(0)
    x, y = torch.randn(3, 16, 8, dtype=torch.double), torch.randn(3, 16, 8, dtype=torch.double)
    plan = sinkhorn_plan(x, y)
    exact(plan, authors_sinkhorn(x, y))
    uniform = torch.full((3, 16), 1 / 16, dtype=torch.double)
    near = dict(rtol=1e-6, atol=0)  # (the authors' log(mu + 1e-8): marginals 1.6e-7 off by design)
    torch.testing.assert_close(plan.sum(1), uniform, **near)  # the last update (v's) makes this one exact
    rows = float((plan.sum(2) - 1 / 16).abs().max())  # the sample's: as far as the authors' rule stops
    full = sinkhorn_plan(x, y, tol=0)  # every iteration: both marginals close
    torch.testing.assert_close(full.sum(1), uniform, **near)
    assert float((full.sum(2) - 1 / 16).abs().max()) < rows
    # eps 0.1 against squared distances of about 16: far from converged, as in the authors' runs (their
    # rows are off by up to half); on a cost of order 1 both marginals meet
    small = sinkhorn_plan(x / 8, y / 8, tol=0)
    torch.testing.assert_close(small.sum(2), uniform, **near)


@pytest.mark.parametrize("read_every", [3, 10, 100])
def test_reading_the_stopping_test_rarely_gives_the_same_plan_bit_for_bit(read_every):
    """A GPU reads the stopping test every 10 iterations; the iterations after the stop leave the plan as
    it was: the plan of a read at every iteration (the authors' loop), whichever iteration stops (here the
    4th, the 24th and the 35th)."""
    torch.manual_seed(1)
    stops = []
    for scale in (0.3, 0.7, 1.0):
        x, y = (
            torch.randn(4, 9, 5, dtype=torch.double) * scale,
            torch.randn(4, 9, 5, dtype=torch.double) * scale,
        )
        every = sinkhorn_plan(x, y, read_every=1)
        exact(every, authors_sinkhorn(x, y))
        assert torch.equal(sinkhorn_plan(x, y, read_every=read_every), every)
        stops.append(next(k for k in range(1, 101) if torch.equal(sinkhorn_plan(x, y, max_iter=k), every)))
    assert stops == [4, 24, 35] and any(k % read_every for k in stops)  # (stops between two reads too)


@pytest.mark.parametrize("direction", [0, 1])
def test_alignmix_equals_the_authors_mix_logits_and_gradients(direction):
    torch.manual_seed(0)
    model = Net().double().train()
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.double), torch.tensor([0, 1, 2, 3])
    lam, index = 0.35, torch.tensor([2, 3, 1, 0])
    mix = AlignMix("stage", generator=torch.Generator().manual_seed(0))
    with mix.attach(model):
        mix.pin(lam=lam, index=index, direction=direction)
        logits = model(x)
        loss = mix.loss(F.cross_entropy, logits, y)
        loss.backward()
    assert mix.last.info["direction"] == direction and float(mix.last.lam) == lam
    got = grads(model)
    model.zero_grad()
    out = model.stage(torch.relu(model.conv(x)))
    theirs = model.head(mixup_aligned(out, lam, index, direction).mean((2, 3)))
    exact(logits, theirs)
    (lam * F.cross_entropy(theirs, y) + (1 - lam) * F.cross_entropy(theirs, y[index])).backward()
    for name, g in grads(model).items():
        exact(got[name], g)


def test_the_direction_is_drawn_and_repeated_by_pin_last():
    torch.manual_seed(0)
    model = Net().double().train()
    x = torch.randn(4, 3, 8, 8, dtype=torch.double)
    mix = AlignMix("stage", generator=torch.Generator().manual_seed(1))
    with mix.attach(model):
        directions = set()
        for _ in range(12):
            first = model(x)
            directions.add(mix.last.info["direction"])
        mix.pin_last()
        exact(model(x), first)
    assert directions == {0, 1}


def test_alignmix_refuses_what_it_cannot_align():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).double()
    x = torch.randn(2, 3, 5, 5, dtype=torch.double)
    with AlignMix("1").attach(model.train()), pytest.raises(ValueError, match="fewer than 2 positions"):
        model(x)
    with AlignMix("2").attach(model), pytest.raises(TypeError, match=r"needs a \(B, C, ...\) map"):
        model(x)
    with pytest.raises(ValueError, match="max_iter must be"):
        AlignMix("1", max_iter=0)
    mix = AlignMix("0")
    with mix.attach(model):
        mix.pin(direction=2)
        with pytest.raises(ValueError, match="direction is 0 or 1"):
            model(x)

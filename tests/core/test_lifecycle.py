"""Hook lifecycle, as a property: over randomly built models, layer choices and hook sets, an exception
anywhere (in forward, in a hook, in backward, in the training loop) leaves no hook registered, and the
same hooks attach again cleanly afterwards."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from mixhook import CutMix, GradClip, GradScale, InputScale, ManifoldMixup, OneOf, PatchUp, attach
from tests.helpers import hook_count

C = 4  # channels everywhere, so that any block can follow any other


class Boom(Exception):
    pass


class Residual(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


class Tripwire(nn.Module):
    """Identity that raises in forward, or whose gradient raises in backward, when armed."""

    def __init__(self):
        super().__init__()
        self.armed: str | None = None

    def forward(self, x):
        if self.armed == "forward":
            raise Boom("forward")
        return _RaiseInBackward.apply(x) if self.armed == "backward" else x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise Boom("backward")


def block(draw, depth: int) -> nn.Module:
    leaves = ["conv", "conv_relu_", "bn", "relu"]
    kind = draw(st.sampled_from([*leaves, "seq", "res"] if depth < 2 else leaves))
    if kind == "conv":
        return nn.Conv2d(C, C, 3, padding=1)
    if kind == "conv_relu_":  # an in-place ReLU where PyTorch allows one: after a conv
        return nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.ReLU(inplace=True))
    if kind == "bn":
        return nn.BatchNorm2d(C)
    if kind == "relu":
        return nn.ReLU()
    body = nn.Sequential(*(block(draw, depth + 1) for _ in range(draw(st.integers(1, 3)))))
    return body if kind == "seq" else Residual(body)


@st.composite
def cases(draw):
    blocks = [block(draw, 0) for _ in range(draw(st.integers(1, 4)))]
    trip = draw(st.integers(0, len(blocks)))
    blocks.insert(trip, Tripwire())
    model = nn.Sequential(nn.Conv2d(3, C, 3, padding=1), *blocks, nn.Flatten(), nn.Linear(C * 36, 5))
    names = [n for n, m in model.named_modules() if n and not isinstance(m, (nn.Flatten, nn.Linear))]
    pick = st.sampled_from(names)
    makers = {
        "manifold": lambda: ManifoldMixup(draw(st.lists(st.sampled_from(["input", *names]), min_size=1, unique=True))),  # noqa: E501
        "cutmix": lambda: CutMix(draw(pick)),
        "patchup": lambda: PatchUp(draw(pick), block_size=3),
        "oneof": lambda: OneOf([ManifoldMixup(draw(pick)), CutMix("input")]),
        "input_scale": lambda: InputScale(draw(pick), factor=[0.5, 1.5]),
        "grad_scale": lambda: GradScale(draw(pick), factor=-0.5),
        "grad_clip": lambda: GradClip(draw(pick), max_norm=0.1),
    }  # fmt: skip
    mixer = draw(st.sampled_from(["manifold", "cutmix", "patchup", "oneof", None]))
    others = draw(
        st.lists(
            st.sampled_from(["input_scale", "grad_scale", "grad_clip"]),
            min_size=0 if mixer else 1,
            unique=True,
        )
    )
    hooks = [makers[k]() for k in ([mixer] if mixer else []) + others]
    where = draw(
        st.sampled_from(["forward", "backward", "loop", "hook"] if mixer else ["forward", "backward", "loop"])
    )
    return model, hooks, where, draw(st.integers(0, 2**31 - 1))


def step(model, hooks, x, y, optimizer):
    mixers = [h for h in hooks if callable(getattr(h, "loss", None))]
    logits = model(x)
    loss = mixers[0].loss(F.cross_entropy, logits, y) if mixers else F.cross_entropy(logits, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@pytest.mark.slow
@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_an_exception_anywhere_leaves_no_hook_registered(case):
    model, hooks, where, seed = case
    torch.manual_seed(seed)
    x, y = torch.randn(6, 3, 6, 6), torch.randint(0, 5, (6,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trip = next(m for m in model.modules() if isinstance(m, Tripwire))
    trip.armed = where if where in ("forward", "backward") else None
    with pytest.raises((Boom, ValueError)):
        with attach(model, *hooks):
            assert hook_count(model) > 0
            if where == "hook":  # the mixer itself refuses: a pinned index that does not fit the batch
                mixer = next(h for h in hooks if callable(getattr(h, "pin", None)))
                mixer.pin(0, index=[0, 1]) if isinstance(mixer, OneOf) else mixer.pin(index=[0, 1])
            step(model, hooks, x, y, optimizer)
            raise Boom("loop")
    assert hook_count(model) == 0
    assert all(getattr(h, "model", None) is None for h in hooks)
    trip.armed = None
    with attach(model, *hooks):  # the same objects attach again and train
        step(model, hooks, x, y, optimizer)
    assert hook_count(model) == 0

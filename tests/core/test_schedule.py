"""Mixing schedules: ramps of prob and alpha, timm's mixup_off_epoch, per-layer draw weights."""

import math

import pytest
import torch

from mixhook import CutMix, ManifoldMixup, MixSchedule, OneOf, Ramp, SmoothMix
from tests.helpers import mlp


def test_ramps_move_every_step_and_then_hold():
    linear, cosine = Ramp(0.0, 1.0, epochs=4), Ramp(2.0, 0.5, epochs=2, shape="cosine")
    assert [linear.at(t) for t in (0, 1, 2.5, 4, 9)] == [0.0, 0.25, 0.625, 1.0, 1.0]
    assert cosine.at(0) == 2.0 and cosine.at(2) == 0.5
    assert cosine.at(1) == pytest.approx(1.25)  # halfway
    assert cosine.at(0.5) == pytest.approx(2.0 - 1.5 * (1 - math.cos(math.pi / 4)) / 2)


def test_schedule_sets_prob_alpha_and_switches_off_like_timm():
    mixer = ManifoldMixup(["0", "2"], alpha=2.0, prob=0.9)
    schedule = MixSchedule(mixer, prob=Ramp(0.0, 1.0, epochs=2), alpha=Ramp(0.5, 2.0, 2), off_epoch=3)
    schedule.set(1, 0.5)
    assert mixer.prob == 0.25 and mixer.alpha == 0.875
    schedule.set(3, 0.9)
    assert mixer.prob == 1.0 and mixer.alpha == 2.0
    schedule.set(4, 0.0)  # timm: `if epoch >= mixup_off_epoch` (0-based) -> our 1-based epoch 4 is off
    assert mixer.prob == 0.0
    model = mlp().double().train()
    with mixer.attach(model):
        model(torch.randn(4, 6, dtype=torch.double))
    assert mixer.last is None
    constant = MixSchedule(ManifoldMixup("0", prob=0.7), off_epoch=1)  # prob left as constructed
    constant.set(1)
    assert constant.members[0].prob == 0.7
    constant.set(2)
    assert constant.members[0].prob == 0.0


def test_layer_weights_draw_the_layers_in_proportion():
    model = mlp().double().train()
    mixer = ManifoldMixup(["input", "0", "2"], generator=torch.Generator().manual_seed(0))
    MixSchedule(mixer, layer_weights=[0, 3, 1]).set(1)
    counts = {"input": 0, "0": 0, "2": 0}
    with mixer.attach(model):
        for _ in range(2000):
            model(torch.randn(4, 6, dtype=torch.double))
            counts[mixer.last.layer] += 1
    assert counts["input"] == 0 and abs(counts["0"] / 2000 - 0.75) < 0.03
    mixer.layer_weights = None  # back to the paper's uniform draw, the same stream as a new mixer
    fresh = ManifoldMixup(["input", "0", "2"], generator=torch.Generator().manual_seed(5))
    mixer.generator.manual_seed(5)
    layers = []
    with mixer.attach(model):
        for _ in range(20):
            model(torch.randn(4, 6, dtype=torch.double))
            layers.append(mixer.last.layer)
    fresh_layers = []
    with fresh.attach(model):
        for _ in range(20):
            model(torch.randn(4, 6, dtype=torch.double))
            fresh_layers.append(fresh.last.layer)
    assert layers == fresh_layers


def test_a_oneof_is_scheduled_through_each_mixer():
    both = OneOf([ManifoldMixup("0"), CutMix("input")])
    MixSchedule(both, prob=Ramp(0.2, 0.6, 1)).set(1, 0.5)
    assert [m.prob for m in both.mixers] == [pytest.approx(0.4)] * 2


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Ramp(0, 1, epochs=0), "Ramp epochs must be > 0"),
        (lambda: Ramp(0, 1, 2, shape="exp"), "Ramp shape must be one of linear, cosine, got 'exp'"),
        (lambda: MixSchedule(ManifoldMixup("0"), prob=Ramp(0, 1.5, 2)), r"the ramp must stay in \[0, 1\]"),
        (lambda: MixSchedule(ManifoldMixup("0"), alpha=Ramp(0, 1, 2)), "the ramp must stay > 0"),
        (lambda: MixSchedule(ManifoldMixup("0"), off_epoch=-1), "off_epoch must be an int >= 0"),
        (lambda: MixSchedule(SmoothMix("input"), alpha=1.0), "SmoothMix draws no lam from alpha"),
        (
            lambda: MixSchedule(ManifoldMixup(["0", "2"]), layer_weights=[1]),
            r"layer_weights=\[1\]: one weight >= 0 per layer of \['0', '2'\], not all 0",
        ),
        (lambda: MixSchedule(ManifoldMixup(["0", "2"]), layer_weights=[0, 0]), "not all 0"),
        (
            lambda: MixSchedule(OneOf([ManifoldMixup("0"), CutMix("input")]), layer_weights=[1, 1]),
            "weights one mixer's layers; not a OneOf",
        ),
    ],
)
def test_bad_schedules_are_refused_in_one_line(make, message):
    with pytest.raises(ValueError, match=message):
        make()

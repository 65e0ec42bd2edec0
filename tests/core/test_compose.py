"""attach(): several hooks, one handle; at most one mixing regularizer."""

import pytest
import torch

from mixhook import CutMix, GradScale, InputScale, ManifoldMixup, attach
from tests.helpers import SmallCNN, hook_count


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

"""The shared attach/remove mechanism: handles, context managers, exceptions, double attach."""

import pytest
import torch
import torchvision
from torch import nn

from mixhook import HookHandle, LayerHook, ManifoldMixup


def hook_count(model):
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()
    )


def test_handle_removes_every_hook_once_and_is_idempotent():
    model = torchvision.models.resnet18()
    before = hook_count(model)
    mix = ManifoldMixup(["input", "layer1", "layer2.0.bn1"])
    handle = mix.attach(model)
    assert isinstance(handle, HookHandle) and handle.attached and mix.model is model
    assert hook_count(model) > before
    handle.remove()
    handle.remove()
    assert hook_count(model) == before and not handle.attached and mix.model is None


def test_with_block_removes_hooks_even_when_forward_raises():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)).train()
    mix = ManifoldMixup("1")
    with pytest.raises(RuntimeError, match="shape"):
        with mix.attach(model):
            model(torch.randn(4, 5))  # wrong width: the Linear raises inside forward
    assert hook_count(model) == 0
    with pytest.raises(KeyError, match="raised in the loop"):
        with mix.attach(model):
            model(torch.randn(4, 3)).sum().backward()
            raise KeyError("raised in the loop")
    assert hook_count(model) == 0
    with mix.attach(model):  # and it can be attached again afterwards
        model(torch.randn(4, 3))
    assert mix.last is not None


def test_attaching_twice_is_refused_and_leaves_one_set_of_hooks():
    model = nn.Sequential(nn.Linear(3, 3))
    other = nn.Sequential(nn.Linear(3, 3))
    mix = ManifoldMixup("0")
    with mix.attach(model):
        count = hook_count(model)
        with pytest.raises(RuntimeError, match="already attached to a Sequential"):
            mix.attach(model)
        with pytest.raises(RuntimeError, match="already attached"):
            mix.attach(other)
        assert hook_count(model) == count and hook_count(other) == 0


def test_unknown_layer_registers_nothing():
    model = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(KeyError, match="nosuch"):
        ManifoldMixup(["0", "nosuch"]).attach(model)
    assert hook_count(model) == 0


def test_a_failing_registration_removes_what_it_had_registered():
    class Fails(LayerHook):
        def _register(self, model, modules, handles):
            for module in modules.values():
                handles.append(module.register_forward_hook(lambda *a: None))
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    hook = Fails(["0", "1"])
    with pytest.raises(RuntimeError, match="boom"):
        hook.attach(model)
    assert hook_count(model) == 0 and hook.model is None


def test_attach_needs_a_module():
    with pytest.raises(TypeError, match="needs an nn.Module, got function"):
        ManifoldMixup("input").attach(lambda x: x)

"""The checks before the first training step: the hooks attach to the model, and one sample batch (and a
batch of one, where the data can give one) runs through it with every hook: a layer that does not run, a
map a mixer cannot cut, a BatchNorm that would see one value per channel are refused in one line."""

from __future__ import annotations

import contextlib
import logging
import math
import re

import torch
from torch import nn

from mixhook.engine.card import traits_of
from mixhook.engine.contract import members
from mixhook.layers import UnknownLayerError, trace_outputs
from mixhook.mixers import MixingHook

from .data import Data
from .errors import ConfigError

log = logging.getLogger("mixhook")


ARGUMENTS = ("attention", "features", "classifier")  # a method's layer arguments beside ``layer``


def layer_key(hook, err: Exception) -> str:
    """The config key an error about a layer is about: ``layer``, or a method's other layer argument the
    error names (TransMix's and MixPro's ``attention``, SnapMix's ``features`` and ``classifier``, the
    saliency methods' ``saliency_layer``)."""
    named = re.search(r"^(?:unknown )?layer '([^']+)'", str(err))  # (a real name's, or a spec's refusal)
    for argument in ARGUMENTS:
        value = getattr(hook, argument, None)
        if isinstance(value, str) and (
            (named and value == named[1]) or (not named and f"{argument}={value!r}" in str(err))
        ):
            return argument
    if named and getattr(getattr(hook, "saliency", None), "layer", None) == named[1]:
        return "saliency_layer"
    return "layer"


def attach_and_check(model: nn.Module, hooks: list[tuple[str, object]], data: Data) -> list:
    """Attach every hook (resolving layer names) and run one sample batch through the model in eval
    mode, checking that it runs on this data and that each mixing layer returns what its regularizer
    can mix. Returns the handles; on any failure, what was attached is removed again."""
    handles: list = []
    try:
        for key, hook in hooks:
            handles.append(attach(model, key, hook, data))
        check_sample_batch(model, hooks, data)
    except BaseException:
        for handle in handles:
            if callable(getattr(handle, "remove", None)):
                handle.remove()
        raise
    return [h for h in handles if callable(getattr(h, "remove", None))]


def attach(model: nn.Module, key: str, hook, data: Data):
    """``hook.attach(model)``, its layer arguments refused in one line (:class:`ConfigError` naming the
    config key, ``{key}.layer`` or the argument it is about) where the model has no such layer."""
    try:
        return hook.attach(model)
    except UnknownLayerError as err:
        readers = [m for m in members(hook) if "attention" in traits_of(m)]  # (its card's trait)
        if readers and layer_key(hook, err) == "attention" and not _has_attention(model):
            raise ConfigError(f"{key}.attention: {_needs_attention(readers[0], model, data)}") from err
        raise ConfigError(
            f"{key}.{layer_key(hook, err)}: {err}. `mixhook-layers` with this run's model "
            "and data overrides lists every layer with its output and whether it can be mixed"
        ) from err
    except (TypeError, ValueError) as err:  # a layer argument of the wrong kind (not attention...)
        raise ConfigError(f"{key}.{layer_key(hook, err)}: {err}") from err


def _has_attention(model: nn.Module) -> bool:
    """Whether ``model`` holds an attention module (``nn.MultiheadAttention``, or a class named so: timm's
    and HuggingFace's ``Attention``/``*SelfAttention``)."""
    return any(
        isinstance(m, nn.MultiheadAttention) or "Attention" in type(m).__name__ for m in model.modules()
    )


def _needs_attention(hook, model: nn.Module, data: Data) -> str:
    """What a method that reads a ViT's attention (its card's trait ``"attention"``) says on a model without
    any: the model option that has one, sized for this data's images."""
    side = data.image_size
    patch = 2 if side <= 16 else 4  # digits' 8x8: a 4x4 grid of patches; CIFAR's 32x32: 8x8
    vit = (  # (on digits, the app's ViT recipe: the ViT with the optimizer that trains it)
        "experiment=vit_digits"
        if data.name == "digits"
        else f"model=timm model.name=vit_tiny_patch16_224 +model.img_size={side} +model.patch_size={patch}"
    )
    return (
        f"{type(hook).__name__} reads a ViT's attention ({hook.attention!r}), "
        f"and {type(model).__name__} has no attention module; train a ViT: {vit}"
    )


def check_sample_batch(model: nn.Module, hooks: list[tuple[str, object]], data: Data) -> None:
    x, y = (t[:2] for t in next(iter(data.test)))
    for key, hook in hooks:
        if isinstance(hook, MixingHook):
            try:
                hook.check_targets(y)
            except (TypeError, ValueError) as err:
                # class labels refused: the method trains on other targets (the app's regression data)
                fix = (
                    "" if y.is_floating_point() else "; train it on regression data: data=diabetes model=mlp"
                )
                raise ConfigError(f"{key}: {err}; data={data.name} has {y.dtype} labels{fix}") from err
    checks = [(key, hook) for key, hook in hooks if callable(getattr(hook, "check_output", None))]
    layers = list(dict.fromkeys(name for _, hook in checks for name in hook.layers))
    norms = _batchnorm_inputs(model) if one_sample_batches(data) else None
    try:
        with norms or contextlib.nullcontext():
            outputs = trace_outputs(model, layers, x)
    except Exception as err:  # whatever the model raises on this input is a model/data mismatch
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        hint = "" if data.images else f" (data={data.name} is tabular: train it with model=mlp)"
        raise ConfigError(
            f"model: {type(model).__name__} fails on a {data.name} batch of shape {tuple(x.shape)}{hint}: "
            f"{type(err).__name__}: {reason}"
        ) from err
    if norms is not None:
        check_one_sample(model, norms.shapes, x.shape[0], data)
    for key, hook in checks:
        for name in hook.layers:
            if name not in outputs:
                resolved = getattr(hook, "resolved", {})
                spec = next((s for s, names in resolved.items() if name in names and s != name), None)
                named = f"{name!r} ({spec})" if spec else repr(name)
                raise ConfigError(f"{key}.layer: {named} does not run in {type(model).__name__}.forward()")
            try:
                hook.check_output(name, outputs[name], x.shape[0], model_input=x)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"{key}.{layer_key(hook, err)}: {err}") from err


def one_sample_batches(data: Data) -> bool:
    """Whether a training batch can hold a single sample: ``trainer.batch_size=1``, or a training share of
    one sample (the sampler leaves out a last batch of one only when there are others)."""
    return data.train.batch_size == 1 or len(data.train.sampler) == 1


class _batchnorm_inputs:
    """While entered, the input shape of every BatchNorm layer of ``model`` the forward reaches, by name
    (``shapes``), recorded by forward pre-hooks that it removes on exit."""

    def __init__(self, model: nn.Module):
        self.model, self.shapes, self.handles = model, {}, []

    def __enter__(self):
        for name, module in self.model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                self.handles.append(module.register_forward_pre_hook(self._record(name)))
        return self

    def _record(self, name: str):
        def hook(module, args):
            if args and isinstance(args[0], torch.Tensor):
                self.shapes.setdefault(name, tuple(args[0].shape))

        return hook

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return False


def check_one_sample(model: nn.Module, shapes: dict[str, tuple], batch: int, data: Data) -> None:
    """Refuse, before training, a run whose batches of one sample a BatchNorm layer cannot train on: in
    training mode it needs more than one value per channel (torch raises in the first step otherwise);
    ``shapes`` are the layers' inputs for a sample batch of ``batch`` samples."""
    for name, shape in shapes.items():
        if len(shape) >= 2 and math.prod(shape) // (batch * shape[1]) == 1:
            one = data.train.batch_size == 1
            what = "trainer.batch_size=1" if one else "a training set of one sample (data.train_size)"
            raise ConfigError(
                f"{what}: {type(model).__name__}'s BatchNorm layer {name!r} would see one value per channel "
                f"(its input for one sample is {(1, *shape[1:])}), which it cannot train on; use "
                "trainer.batch_size=2 or more"
            )

"""Backward hooks: rescale, reverse or clip the gradient flowing through a layer.

How, and why this way. ``register_full_backward_hook`` wraps a module's inputs and outputs in
``BackwardHookFunction`` nodes (two identity autograd nodes per call) whose outputs are views; when the
next module modifies the output in place (``bn1`` followed by ``ReLU(inplace=True)`` in torchvision's
ResNets) autograd refuses ("Output 0 of BackwardHookFunction is a view and is being modified
inplace"). So:

- :class:`GradScale` works on the layer's *input*: a forward pre-hook passes the layer
  ``_ScaleGrad(x)``, an identity whose backward multiplies the gradient by ``factor``. Only the
  gradient that flows from this layer into ``x`` is scaled (``x``'s other consumers, such as a skip
  connection, are not), the layer's own parameter gradients are untouched, and nothing is copied:
  ``_ScaleGrad`` returns a view. A view cannot be modified in place by the layer itself, so for a layer
  that contains an ``inplace=True`` module (``ReLU(inplace=True)``, or a block holding one) it returns a
  copy instead.
- :class:`GradClip` works on the layer's *output*: a forward hook registers a tensor hook on it. No node
  is added, nothing is copied, and the hook sees the gradient with respect to the output as the layer
  produced it, even when a later module modifies that output in place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import packing
from .engine.card import HookCard
from .functional import per_sample
from .hooks import LayerHook
from .sites import INPUT, Inputs, batch_leaves, replace_leaves, select


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float, copy: bool) -> torch.Tensor:
        ctx.factor = factor
        return x.clone() if copy else x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None, None


class GradScale(LayerHook):
    """Multiply the gradient a layer passes upstream (with respect to its inputs) by ``factor``.

    The forward pass is unchanged, and so are the layer's own parameter gradients and everything
    downstream of the layer. ``factor < 0`` is a gradient reversal layer (Ganin & Lempitsky 2015,
    "Unsupervised Domain Adaptation by Backpropagation", ICML); ``0 < factor < 1`` slows the learning of
    everything before the layer. Every tensor input that requires grad is scaled, positional or
    keyword (``layer(hidden_states=h)`` like ``layer(h)``), or those a selector picks (``"block[x]"``).
    ``layer="input"`` scales the gradient with respect to the model's input. Training mode only.
    See the module docstring for the mechanism.

    Args:
        layer: a module name, ``"input"``, or a list of names (each is scaled); each may carry a selector
            of the layer's arguments.
        factor: a finite number.
    """

    card = HookCard(
        signature="GradScale(layer, factor)",
        hook="backward, via an identity autograd function on the layer's input",
        formula=(
            "gradient passed upstream × `factor` (`< 0`: reversal); the layer's own parameter gradients "
            "unchanged"
        ),
        paper="Ganin & Lempitsky 2015",
        commands="`grad_scale.layer=layer3 grad_scale.factor=-1.0`",
    )

    def __init__(self, layer: str | Sequence[str], factor: float):
        super().__init__(layer)
        self.factor = _finite("factor", factor)

    def __repr__(self) -> str:
        return f"GradScale(layer={self._layer_spec!r}, factor={self.factor})"

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        for spec, module in modules.items():
            inner = self.sites[spec].layer != INPUT
            copy = inner and any(getattr(m, "inplace", False) is True for m in module.modules())
            handles.append(module.register_forward_pre_hook(self._pre_hook(spec, copy), with_kwargs=True))

    def _pre_hook(self, spec: str, copy: bool):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            if not self._model.training:
                return None
            if not torch.is_grad_enabled():  # a reentrant checkpoint's forward: its recomputation scales
                self._note(spec, True)
                return None
            if not kwargs and self.sites[spec].paths is None:  # positional only, nothing selected
                if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                    return None
                scaled = tuple(
                    _ScaleGrad.apply(a, self.factor, copy)
                    if isinstance(a, torch.Tensor) and a.requires_grad
                    else a
                    for a in args
                )
                return scaled, kwargs
            inputs = Inputs(module, args, kwargs)
            found = [
                (path, t)
                for path, t in select(inputs, self.sites[spec], "its input")
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if not found:
                return None
            return inputs.rebuild(
                replace_leaves(inputs, {p: _ScaleGrad.apply(t, self.factor, copy) for p, t in found})
            )

        return hook


def clip_per_sample(grad: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale each sample's slice ``grad[i]`` to L2 norm at most ``max_norm``; return it and the norms
    before clipping (computed in float32 at least)."""
    flat = grad.reshape(grad.shape[0], -1)
    norms = flat.float().norm(dim=1) if flat.dtype in (torch.float16, torch.bfloat16) else flat.norm(dim=1)
    scale = (max_norm / norms.clamp_min(torch.finfo(norms.dtype).tiny)).clamp(max=1.0)
    return grad * per_sample(scale, grad), norms


class GradClip(LayerHook):
    """Clip, per sample, the gradient arriving at a layer's output to L2 norm at most ``max_norm``,
    before it flows into the layer (and so into its parameters and everything upstream).

    For each sample ``i``, ``g_i`` becomes ``g_i * min(1, max_norm / ||g_i||)``. Forward is unchanged.
    ``.last_norms`` holds the per-sample norms seen by the last backward (before clipping). Training
    mode only. See the module docstring for the mechanism (a tensor hook on the output).

    Every tensor in the layer's output that carries the batch is clipped per sample along its own
    batch dimension (see :mod:`mixhook.sites`), or those a selector picks (``"lstm[0]"``).

    Args:
        layer: a module name or a list of names (``"input"`` has no output gradient to clip).
        max_norm: a finite number > 0.
        batch_dim: where mixhook cannot find the batch dimension itself.
    """

    card = HookCard(
        signature="GradClip(layer, max_norm)",
        hook="backward, via a tensor hook on the layer's output",
        formula="per sample `g_i ← g_i * min(1, max_norm/‖g_i‖)` before it enters the layer",
        commands="`grad_clip.layer=layer3 grad_clip.max_norm=0.01`",
    )

    def __init__(self, layer: str | Sequence[str], max_norm: float, batch_dim: int | dict | None = None):
        super().__init__(layer, batch_dim)
        if any(site.layer == INPUT for site in self.sites.values()):
            raise ValueError(
                "GradClip clips the gradient at a layer's output; 'input' (the model's input) is not a "
                "layer with an output: name a module"
            )
        self.max_norm = _finite("max_norm", max_norm)
        if self.max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
        self.last_norms: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"GradClip(layer={self._layer_spec!r}, max_norm={self.max_norm})"

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        why = "a sample's norm would be a whole row's, over several sequences"
        handles.append(
            model.register_forward_pre_hook(
                packing.refusing("GradClip", why, with_grad=True), with_kwargs=True
            )
        )
        for spec, module in modules.items():
            handles.append(module.register_forward_hook(self._forward_hook(spec)))

    def _forward_hook(self, spec: str):
        def hook(module: nn.Module, args: tuple, output) -> None:
            if not self._model.training:
                return
            if not torch.is_grad_enabled():  # a reentrant checkpoint's forward: its recomputation clips
                self._note(spec, True)
                return
            found, _ = batch_leaves(output, self.sites[spec], self._dims[spec], "GradClip")
            for i, leaf in enumerate(found):
                if leaf.tensor.requires_grad:
                    leaf.tensor.register_hook(self._clipper(leaf.dim, first=i == 0))

        return hook

    def _clipper(self, dim: int, first: bool):
        def clip(grad: torch.Tensor) -> torch.Tensor:
            clipped, norms = clip_per_sample(grad.movedim(dim, 0), self.max_norm)
            if first:
                self.last_norms = norms
            return clipped.movedim(0, dim)

        return clip


def _finite(name: str, value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return number

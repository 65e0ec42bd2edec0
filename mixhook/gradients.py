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

from .hooks import LayerHook
from .layers import INPUT
from .mixing import per_sample


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
    everything before the layer. Every positional tensor input that requires grad is scaled.
    ``layer="input"`` scales the gradient with respect to the model's input. Training mode only.
    See the module docstring for the mechanism.

    Args:
        layer: a module name, ``"input"``, or a list of names (each is scaled).
        factor: a finite number.
    """

    def __init__(self, layer: str | Sequence[str], factor: float):
        super().__init__(layer)
        self.factor = _finite("factor", factor)

    def __repr__(self) -> str:
        return f"GradScale(layer={self._layer_spec!r}, factor={self.factor})"

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        for name, module in modules.items():
            copy = name != INPUT and any(getattr(m, "inplace", False) is True for m in module.modules())
            handles.append(module.register_forward_pre_hook(self._pre_hook(copy)))

    def _pre_hook(self, copy: bool):
        def hook(module: nn.Module, args: tuple):
            if not self._model.training or not torch.is_grad_enabled():
                return None
            if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                return None
            return tuple(
                _ScaleGrad.apply(a, self.factor, copy)
                if isinstance(a, torch.Tensor) and a.requires_grad
                else a
                for a in args
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

    Args:
        layer: a module name or a list of names (``"input"`` has no output gradient to clip).
        max_norm: a finite number > 0.
    """

    def __init__(self, layer: str | Sequence[str], max_norm: float):
        super().__init__(layer)
        if INPUT in self.layers:
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
        for module in modules.values():
            handles.append(module.register_forward_hook(self._forward_hook))

    def _forward_hook(self, module: nn.Module, args: tuple, output) -> None:
        if not self._model.training or not torch.is_grad_enabled():
            return
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad and tensor.ndim >= 1:
                tensor.register_hook(self._clip)

    def _clip(self, grad: torch.Tensor) -> torch.Tensor:
        clipped, self.last_norms = clip_per_sample(grad, self.max_norm)
        return clipped


def _finite(name: str, value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return number

"""Forward pre-hooks: rescale a layer's input before the layer runs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import packing, recompute
from .engine.card import HookCard
from .functional import along, per_sample
from .hooks import LayerHook
from .sites import Inputs, batch_leaves, blendable, replace_leaves, select
from .transfer import to_device


class InputScale(LayerHook):
    """Multiply a layer's first input by ``factor`` before the layer runs (a forward pre-hook).

    The first input is the first argument the layer was called with, positional or keyword
    (``layer(hidden_states=h)`` is scaled like ``layer(h)``); a selector picks others by name or position
    (``"block[x,meta]"``), and every floating-point tensor in what it picks is scaled.
    ``factor`` is a number, or a pair ``(low, high)``: then each sample of each training batch gets its
    own factor drawn uniformly from ``[low, high)`` (a per-sample intensity or feature-scale
    augmentation). ``layer="input"`` scales the model's own input. Applies in training mode only,
    unless ``in_eval=True``; in eval a range applies its midpoint ``(low + high) / 2``, so evaluation
    stays deterministic. ``.last`` is the factor tensor the last scaled forward used (``None`` when it
    scaled nothing). Under activation checkpointing a recomputed layer gets the same factors.

    Args:
        layer: a module name, ``"input"``, or a list of names (all of them are scaled); each may carry a
            selector of the layer's arguments.
        factor: a finite number, or ``(low, high)`` with ``low <= high``.
        in_eval: also scale in eval mode.
        generator: the ``torch.Generator`` for per-sample factors (as :class:`~mixhook.ManifoldMixup`).
        batch_dim: where mixhook cannot find the batch dimension of a per-sample factor's tensors itself
            (see :mod:`mixhook.sites`).
    """

    card = HookCard(
        signature="InputScale(layer, factor, in_eval=False)",
        hook="forward pre-hook",
        formula=(
            "layer input `x' = factor * x`; `factor=(low, high)`: one U(low, high) per sample (eval: the "
            "midpoint)"
        ),
        commands="`input_scale.layer=layer1 input_scale.factor=0.5`",
    )

    def __init__(
        self,
        layer: str | Sequence[str],
        factor: float | Sequence[float],
        in_eval: bool = False,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
    ):
        super().__init__(layer, batch_dim)
        self.factor = _check_factor(factor)
        self.in_eval = bool(in_eval)
        self._draw_from(generator)
        self.last: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"InputScale(layer={self._layer_spec!r}, factor={self.factor}, in_eval={self.in_eval})"

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        if not isinstance(self.factor, float):  # per-sample factors: a packed row is not a sample
            why = "each factor would be shared by a row's sequences"
            check = packing.refusing("InputScale", why, with_grad=False)  # it scales without too
            handles.append(model.register_forward_pre_hook(check, with_kwargs=True, prepend=True))
        for spec, module in modules.items():  # "input" resolves to the model itself: its pre-hook
            hook = recompute.hook(self._hook(spec), self._again(spec))
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def _hook(self, spec: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            training = self._model.training
            if not (training or self.in_eval):
                return None
            per_sample_draw = training and not isinstance(self.factor, float)
            if per_sample_draw:
                self._seed_for_rank()
            generator = self.generator
            self._note(spec, (lambda: recompute.generator_state(generator)) if per_sample_draw else None)
            scaled, factor = self._scale(spec, module, args, kwargs, training, generator)
            if factor is not None:
                self.last = factor
            return scaled

        return hook

    def _again(self, spec: str):
        def again(module: nn.Module, args: tuple, kwargs: dict):
            """In a recomputation (activation checkpointing): the forward's factors again."""
            training = self._model.training
            if not (training or self.in_eval):
                return None
            state = self._replayed(spec)
            if training and not isinstance(self.factor, float) and state is None:
                raise recompute.RecomputeError(
                    f"InputScale at {spec!r}: the factors of the recomputed forward were not recorded"
                )
            generator = recompute.replay_generator(self.generator, state) if state is not None else None
            return self._scale(spec, module, args, kwargs, training, generator)[0]

        return again

    def _scale(self, spec, module, args, kwargs, training, generator):
        site = self.sites[spec]
        inputs = name = None
        if site.paths is None and args:  # the common call: no argument binding (nor, compiled, its cache)
            value = args[0]
        else:
            inputs = Inputs(module, args, kwargs)
            if site.paths is None:
                if not len(inputs):
                    return None, None
                name, value = inputs.first()
            else:
                value = inputs
        if isinstance(self.factor, float) or not training:
            number = self.factor if isinstance(self.factor, float) else sum(self.factor) / 2
            factor = torch.tensor(number, dtype=torch.float64)
            found = [(p, t) for p, t in select(value, site, "its input") if blendable(t)]
            if not found:
                raise TypeError(f"InputScale at {spec!r}: no floating-point tensor to scale in its input")
            new = {p: t * to_device(factor, t.device, t.dtype) for p, t in found}
        else:
            found, n = batch_leaves(value, site, self._dims[spec], "InputScale", inputs=True)
            low, high = self.factor
            u = torch.rand(n, generator=generator, device=generator.device, dtype=torch.float64)
            factor = low + (high - low) * u
            new = {f.path: along(f.dim, lambda t: t * per_sample(factor, t), f.tensor) for f in found}
        changed = replace_leaves(value, new)
        if inputs is None:
            return ((changed, *args[1:]), kwargs), factor
        return inputs.rebuild({name: changed} if site.paths is None else changed), factor


def _check_factor(factor) -> float | tuple[float, float]:
    values = factor if isinstance(factor, (list, tuple)) else None
    try:
        numbers = [float(v) for v in values] if values is not None else [float(factor)]
    except (TypeError, ValueError):
        raise TypeError(f"factor must be a number or a pair (low, high), got {factor!r}") from None
    if values is not None and len(numbers) != 2:
        raise ValueError(f"factor must be a number or a pair (low, high), got {factor!r}")
    if not all(math.isfinite(v) for v in numbers):
        raise ValueError(f"factor must be finite, got {factor!r}")
    if len(numbers) == 2:
        if numbers[0] > numbers[1]:
            raise ValueError(f"factor range (low, high) needs low <= high, got {factor!r}")
        return (numbers[0], numbers[1])
    return numbers[0]

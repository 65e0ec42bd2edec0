"""Forward pre-hooks: rescale a layer's input before the layer runs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .hooks import LayerHook, own_generator
from .mixing import per_sample


class InputScale(LayerHook):
    """Multiply a layer's first positional input by ``factor`` before the layer runs (a forward pre-hook).

    ``factor`` is a number, or a pair ``(low, high)``: then each sample of each training batch gets its
    own factor drawn uniformly from ``[low, high)`` (a per-sample intensity or feature-scale
    augmentation). ``layer="input"`` scales the model's own input. Applies in training mode only,
    unless ``in_eval=True``; in eval a range applies its midpoint ``(low + high) / 2``, so evaluation
    stays deterministic. ``.last`` is the factor tensor the last scaled forward used (``None`` when it
    scaled nothing).

    Args:
        layer: a module name, ``"input"``, or a list of names (all of them are scaled).
        factor: a finite number, or ``(low, high)`` with ``low <= high``.
        in_eval: also scale in eval mode.
        generator: the ``torch.Generator`` for per-sample factors (as :class:`~mixhook.ManifoldMixup`).
    """

    def __init__(
        self,
        layer: str | Sequence[str],
        factor: float | Sequence[float],
        in_eval: bool = False,
        generator: torch.Generator | None = None,
    ):
        super().__init__(layer)
        self.factor = _check_factor(factor)
        self.in_eval = bool(in_eval)
        self.generator = own_generator(generator)
        self.last: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"InputScale(layer={self._layer_spec!r}, factor={self.factor}, in_eval={self.in_eval})"

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        for module in modules.values():  # "input" resolves to the model itself: its pre-hook
            handles.append(module.register_forward_pre_hook(self._scale))

    def _scale(self, module: nn.Module, args: tuple):
        training = self._model.training
        if not (training or self.in_eval) or not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        if isinstance(self.factor, float):
            factor = torch.tensor(self.factor, dtype=torch.float64)
        elif training:
            low, high = self.factor
            u = torch.rand(
                x.shape[0], generator=self.generator, device=self.generator.device, dtype=torch.float64
            )
            factor = low + (high - low) * u
        else:
            factor = torch.tensor(sum(self.factor) / 2, dtype=torch.float64)
        self.last = factor
        return (x * per_sample(factor, x), *args[1:])


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

"""The Mixup family: sampling (lam, index), the blend, mixed targets and the mixed loss.

Papers:
    - Zhang, Cisse, Dauphin, Lopez-Paz. "mixup: Beyond Empirical Risk Minimization." ICLR 2018.
      https://arxiv.org/abs/1710.09412 (mixing at the input)
    - Verma, Lamb, Beckham, Najafi, Mitliagkas, Lopez-Paz, Bengio. "Manifold Mixup: Better
      Representations by Interpolating Hidden States." ICML 2019. https://arxiv.org/abs/1806.05236
      (mixing at a hidden layer drawn per batch)

The math is a handful of small pure functions (:func:`sample_lam`, :func:`blend`, :func:`smooth_one_hot`,
:func:`mix_targets`); :class:`ManifoldMixup` puts them on a model through forward hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .hooks import LayerHook
from .layers import INPUT


def sample_lam(alpha: float, generator: torch.Generator) -> torch.Tensor:
    """Draw ``lam ~ Beta(alpha, alpha)`` from ``generator`` as a 0-d float64 tensor.

    ``torch.distributions.Beta`` cannot take a generator, so this draws the same Dirichlet(alpha, alpha)
    sample it would (Beta is its first coordinate) through the generator-aware kernel. lam is kept in
    float64 and cast to the activation's (or the loss's) dtype where it is used.
    """
    concentration = torch.tensor([alpha, alpha], dtype=torch.float64, device=generator.device)
    return torch._sample_dirichlet(concentration, generator=generator)[0]


def blend(h: torch.Tensor, lam: torch.Tensor | float, index: torch.Tensor) -> torch.Tensor:
    """``lam * h + (1 - lam) * h[index]``, computed in ``h``'s dtype on ``h``'s device.

    Differentiable in ``h`` through both terms, exactly like the hand-edited forward of the papers.
    """
    if isinstance(lam, torch.Tensor):
        lam = lam.to(device=h.device, dtype=h.dtype)
    return lam * h + (1 - lam) * h[index.to(h.device)]


def smooth_one_hot(target: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """One-hot class probabilities with label smoothing (timm's convention).

    The true class gets ``1 - smoothing + smoothing / num_classes``, every other class
    ``smoothing / num_classes``; rows sum to 1.
    """
    off = smoothing / num_classes
    out = torch.full((target.shape[0], num_classes), off, device=target.device)
    return out.scatter_(1, target.unsqueeze(1), 1.0 - smoothing + off)


def mix_targets(
    target: torch.Tensor,
    num_classes: int,
    lam: torch.Tensor | float,
    index: torch.Tensor,
    smoothing: float = 0.0,
) -> torch.Tensor:
    """``lam * s(target) + (1 - lam) * s(target[index])`` with ``s`` = :func:`smooth_one_hot`."""
    soft = smooth_one_hot(target, num_classes, smoothing)
    return blend(soft, lam, index)


@dataclass(frozen=True)
class MixState:
    """What one training forward mixed: the layer's name, ``lam`` (0-d float64 tensor) and ``index``
    (1-D int64 tensor: sample ``i`` was mixed with sample ``index[i]``)."""

    layer: str
    lam: torch.Tensor
    index: torch.Tensor


@dataclass
class _Draw:
    """A mix decided at the start of a forward and applied when its layer runs."""

    layer: str
    lam: torch.Tensor
    index: torch.Tensor | None
    batch: int | None
    done: bool = False


class ManifoldMixup(LayerHook):
    """Manifold Mixup (Verma et al. 2019) at any named layer of any model, through forward hooks.

    On each forward in training mode (``model.training``), with probability ``prob``: one layer is drawn
    uniformly from ``layer``, ``lam ~ Beta(alpha, alpha)`` and a uniformly random permutation ``index``
    of the batch are drawn, and that layer's output ``h`` is replaced by
    ``lam * h + (1 - lam) * h[index]``. ``layer="input"`` mixes the model's input (its first positional
    argument): classic input mixup (Zhang et al. 2018). Gradients flow through ``h`` and ``h[index]``
    exactly as in a hand-edited ``forward()``. In eval mode nothing is mixed.

    Train with :meth:`loss` (the mixed criterion) or :meth:`targets` (mixed soft targets)::

        mix = ManifoldMixup(["input", "layer1", "layer2"], alpha=2.0)
        with mix.attach(model):
            logits = model(x)
            loss = mix.loss(F.cross_entropy, logits, y)

    Args:
        layer: a module name as ``model.named_modules()`` spells it, ``"input"``, or a list of names
            (one is drawn per training batch).
        alpha: the Beta distribution's concentration, > 0 (the paper uses 2.0; input mixup 1.0).
        prob: the probability that a training batch is mixed at all, in [0, 1].
        generator: the ``torch.Generator`` every draw comes from. By default a CPU generator seeded from
            ``torch.initial_seed()``, so ``torch.manual_seed(s)`` makes the draws reproducible without
            consuming the global random stream.

    A layer called several times in one forward is mixed at its first call only.
    """

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 2.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
    ):
        super().__init__(layer)
        self.alpha = _check_alpha(alpha)
        self.prob = _check_prob(prob)
        if generator is None:
            generator = torch.Generator().manual_seed(torch.initial_seed())
        elif not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.generator = generator
        self.last: MixState | None = None
        self._draw: _Draw | None = None
        self._pinned: dict | None = None

    def __repr__(self) -> str:
        layers = self.layers[0] if len(self.layers) == 1 else list(self.layers)
        return f"{type(self).__name__}(layer={layers!r}, alpha={self.alpha}, prob={self.prob})"

    # ----------------------------------------------------------------------------------- user API

    def pin(
        self,
        layer: str | None = None,
        lam: float | torch.Tensor | None = None,
        index: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        """Make the next training forward mix with exactly these values (and mix, whatever ``prob``).

        What is left out is drawn as usual. Sampling resumes after that forward. ``index`` is any 1-D
        integer index of the batch's length (a permutation, or e.g. a reversal to reproduce timm's
        ``flip`` pairing); its length is checked against the batch when it is used.
        """
        if layer is not None and layer not in self.layers:
            raise ValueError(
                f"pin(layer={layer!r}): not one of this regularizer's layers {list(self.layers)}"
            )
        if lam is not None:
            lam_value = float(lam)
            if not 0.0 <= lam_value <= 1.0:
                raise ValueError(f"pin(lam={lam_value}): lam must be in [0, 1]")
            lam = torch.tensor(lam_value, dtype=torch.float64)
        if index is not None:
            index = torch.as_tensor(index)
            if index.ndim != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
                raise ValueError(
                    f"pin(index=...): needs a 1-D integer index, got {index.dtype} {tuple(index.shape)}"
                )
            index = index.to(torch.int64)
        self._pinned = {"layer": layer, "lam": lam, "index": index}

    def loss(
        self,
        criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        logits: torch.Tensor,
        target: torch.Tensor,
    ) -> torch.Tensor:
        """``lam * criterion(logits, target) + (1 - lam) * criterion(logits, target[index])`` for the
        last training forward, or ``criterion(logits, target)`` when it did not mix."""
        last = self.last
        if last is None:
            return criterion(logits, target)
        index = self._index_for(target, "loss")
        loss_a = criterion(logits, target)
        loss_b = criterion(logits, target[index])
        lam = last.lam.to(device=loss_a.device, dtype=loss_a.dtype)
        return lam * loss_a + (1 - lam) * loss_b

    def targets(self, target: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
        """Soft targets ``lam * s(target) + (1 - lam) * s(target[index])`` for the last training forward
        (``s(target)`` when it did not mix), where ``s`` puts ``1 - smoothing + smoothing/num_classes``
        on the true class and ``smoothing/num_classes`` elsewhere. They drop into
        ``nn.CrossEntropyLoss``, which accepts class probabilities."""
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        if target.ndim != 1 or target.dtype.is_floating_point or target.dtype == torch.bool:
            raise ValueError(
                f"targets() needs 1-D integer class indices, got {target.dtype} {tuple(target.shape)}"
            )
        if target.numel() and (int(target.min()) < 0 or int(target.max()) >= num_classes):
            raise ValueError(
                f"targets(): class indices must lie in [0, {num_classes}), "
                f"got values from {int(target.min())} to {int(target.max())}"
            )
        if self.last is None:
            return smooth_one_hot(target, num_classes, smoothing)
        return mix_targets(target, num_classes, self.last.lam, self._index_for(target, "targets"), smoothing)

    # ---------------------------------------------------------------------------------- the hooks

    def _register(
        self, model: nn.Module, modules: dict[str, nn.Module], handles: list[RemovableHandle]
    ) -> None:
        handles.append(model.register_forward_pre_hook(self._on_model_input, with_kwargs=True))
        for name, module in modules.items():
            if name != INPUT:
                handles.append(module.register_forward_hook(self._layer_hook(name)))
        handles.append(model.register_forward_hook(self._on_model_output))

    def _reset(self) -> None:
        self._draw = None

    def _on_model_input(self, model: nn.Module, args: tuple, kwargs: dict):
        if not model.training:
            self._draw = None
            return None
        self.last = None
        self._draw = self._decide(_batch_size(args, kwargs))
        if self._draw is None or self._draw.layer != INPUT:
            return None
        if not args:
            raise TypeError(
                f"mixup layer 'input' mixes the model's first positional argument, but "
                f"{type(model).__name__} was called without one"
            )
        mixed = self._apply(INPUT, args[0])
        return (mixed, *args[1:]), kwargs

    def _layer_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output):
            draw = self._draw
            if draw is None or draw.done or draw.layer != name:
                return None
            return self._apply(name, output)

        return hook

    def _on_model_output(self, model: nn.Module, args: tuple, output) -> None:
        draw, self._draw = self._draw, None
        if draw is not None and not draw.done:
            raise RuntimeError(
                f"mixup layer {draw.layer!r} did not run during {type(model).__name__}.forward(), "
                f"so nothing was mixed; choose a layer that forward() calls"
            )

    # ----------------------------------------------------------------------------------- sampling

    def _decide(self, batch: int | None) -> _Draw | None:
        pinned, self._pinned = self._pinned, None
        g = self.generator
        if pinned is None:
            if self.prob < 1.0 and float(torch.rand((), generator=g, device=g.device)) >= self.prob:
                return None
            pinned = {"layer": None, "lam": None, "index": None}
        layer = pinned["layer"]
        if layer is None:
            k = (
                int(torch.randint(len(self.layers), (), generator=g, device=g.device))
                if len(self.layers) > 1
                else 0
            )
            layer = self.layers[k]
        lam = pinned["lam"] if pinned["lam"] is not None else sample_lam(self.alpha, g)
        return _Draw(layer=layer, lam=lam, index=pinned["index"], batch=batch)

    def _apply(self, name: str, h) -> torch.Tensor:
        draw = self._draw
        assert draw is not None  # only called with a live draw
        check_mixable(name, h, draw.batch)
        n = h.shape[0]
        if draw.index is None:
            draw.index = torch.randperm(n, generator=self.generator, device=self.generator.device)
        elif draw.index.shape[0] != n or (n and (int(draw.index.min()) < -n or int(draw.index.max()) >= n)):
            raise ValueError(
                f"pinned index of length {draw.index.shape[0]} (values {draw.index.tolist()[:8]}...) "
                f"does not index the batch of {n} at layer {name!r}"
            )
        draw.done = True
        self.last = MixState(layer=name, lam=draw.lam, index=draw.index)
        return blend(h, draw.lam, draw.index)

    def _index_for(self, target: torch.Tensor, what: str) -> torch.Tensor:
        index = self.last.index
        if target.shape[0] != index.shape[0]:
            raise ValueError(
                f"{what}(): target has {target.shape[0]} rows but the last forward mixed a batch of "
                f"{index.shape[0]}"
            )
        return index.to(target.device)


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.shape[0] if value.ndim else None
    return None


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(
            _describe(v) if isinstance(v, torch.Tensor) else type(v).__name__ for v in value[:4]
        )
        return f"a {type(value).__name__} of {len(value)} ({inner}{', ...' if len(value) > 4 else ''})"
    return f"a {type(value).__name__}"


def check_mixable(name: str, h, batch: int | None) -> None:
    """Raise ``TypeError`` unless ``h`` (what layer ``name`` returned) is a tensor of batch size ``batch``."""
    ok = isinstance(h, torch.Tensor) and h.ndim >= 1 and (batch is None or h.shape[0] == batch)
    if not ok:
        want = f"the batch size {batch}" if batch is not None else "the batch size"
        raise TypeError(
            f"cannot mix layer {name!r}: it returned {_describe(h)}, but mixing needs a tensor whose "
            f"first dimension is {want}"
        )


def _check_alpha(alpha: float) -> float:
    try:
        value = float(alpha)
    except (TypeError, ValueError):
        raise TypeError(f"alpha must be a number > 0, got {alpha!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"alpha must be a finite number > 0 (Beta(alpha, alpha)), got {alpha!r}")
    return value


def _check_prob(prob: float) -> float:
    try:
        value = float(prob)
    except (TypeError, ValueError):
        raise TypeError(f"prob must be a number in [0, 1], got {prob!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"prob must be in [0, 1], got {prob!r}")
    return value

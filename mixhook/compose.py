"""Composition: one mixing regularizer of several per batch (:class:`OneOf`), and attaching several
hooks at once (:func:`attach`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import recompute
from .hooks import HookHandle, LayerHook, own_generator
from .mixing import _MIXING, Mixer, MixState
from .sites import BatchDims


class OneOf(LayerHook):
    """Use one of several mixing regularizers per training batch, drawn with probabilities ``p``
    (timm's switch between mixup and CutMix: ``OneOf([ManifoldMixup("input", 0.8), CutMix("input")])``).

    The chosen regularizer then decides, as it would alone, whether (its ``prob``) and where to mix.
    ``loss``, ``targets`` and ``last`` are the chosen one's; ``chosen`` is the regularizer drawn for the
    last training forward.

    Args:
        mixers: two or more :class:`~mixhook.mixing.Mixer` instances (ManifoldMixup, CutMix, PatchUp,
            NoisyFeatureMixup), not attached elsewhere.
        p: their probabilities (non-negative, summing to 1); uniform by default.
        generator: the generator for the choice (as :class:`~mixhook.ManifoldMixup`).
    """

    def __init__(
        self,
        mixers: Sequence[Mixer],
        p: Sequence[float] | None = None,
        generator: torch.Generator | None = None,
    ):
        mixers = list(mixers)
        if len(mixers) < 2 or not all(isinstance(m, Mixer) for m in mixers):
            raise TypeError(
                "OneOf needs two or more mixing regularizers (ManifoldMixup, CutMix, PatchUp, "
                f"NoisyFeatureMixup), got {[type(m).__name__ for m in mixers]}"
            )
        if len({id(m) for m in mixers}) != len(mixers):
            raise ValueError("OneOf got the same regularizer twice")
        layers = list(dict.fromkeys(name for m in mixers for name in m.layers))
        super().__init__(layers)
        p = [1.0 / len(mixers)] * len(mixers) if p is None else [float(v) for v in p]
        if (
            len(p) != len(mixers)
            or any(not (v >= 0) for v in p)
            or not math.isclose(sum(p), 1.0, abs_tol=1e-6)
        ):
            raise ValueError(f"p must be {len(mixers)} non-negative probabilities summing to 1, got {p}")
        self.mixers = mixers
        self.p = p
        self.generator = own_generator(generator)
        self.chosen: Mixer | None = None
        self._pinned_choice: int | None = None

    def __repr__(self) -> str:
        return f"OneOf({self.mixers!r}, p={self.p})"

    @property
    def last(self) -> MixState | None:
        """The chosen regularizer's :class:`~mixhook.MixState`, or ``None`` when nothing was mixed."""
        return self.chosen.last if self.chosen is not None else None

    def pin(self, choice: int, **values) -> None:
        """The next training forward uses ``mixers[choice]``, pinned with ``values`` (see its ``pin``)."""
        if not 0 <= choice < len(self.mixers):
            raise ValueError(f"pin(choice={choice}): choose 0..{len(self.mixers) - 1}")
        self.mixers[choice].pin(**values)
        self._pinned_choice = choice

    def loss(self, criterion: Callable, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The chosen regularizer's ``loss`` (``criterion(logits, target)`` before any forward)."""
        return self.chosen.loss(criterion, logits, target) if self.chosen else criterion(logits, target)

    def targets(self, target: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
        """The chosen regularizer's ``targets``."""
        return (self.chosen or self.mixers[0]).targets(target, num_classes, smoothing)

    def check_output(self, spec: str, value, batch: int | None = None) -> None:
        """Each regularizer that may mix ``spec`` must accept what it returned."""
        for mixer in self.mixers:
            if spec in mixer.layers:
                mixer.check_output(spec, value, batch)

    def _check_attach(self, model: nn.Module) -> None:
        Mixer._check_attach(self, model)

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        busy = [type(m).__name__ for m in self.mixers if m.model is not None]
        if busy:
            raise RuntimeError(f"OneOf: {busy} already attached on their own; remove them first")
        handles.append(model.register_forward_pre_hook(self._on_model_input, with_kwargs=True))
        for mixer in self.mixers:
            mixer._dims = {s: BatchDims(model, mixer.sites[s], mixer._explicit(s)) for s in mixer.layers}
            mixer._register(model, {n: modules[n] for n in mixer.layers}, handles, root=False)
        handles.append(model.register_forward_hook(self._on_model_output))
        for mixer in self.mixers:  # only once everything is registered: a failure leaves them detached
            mixer._model, mixer._tracker = model, recompute.acquire(model)
        _MIXING[model] = self

    def _reset(self) -> None:
        for mixer in self.mixers:
            if mixer._tracker is not None:
                recompute.release(mixer._model, mixer._tracker)
            mixer._model, mixer._tracker = None, None
            mixer._reset()
        for model, hook in list(_MIXING.items()):
            if hook is self:
                del _MIXING[model]

    def _on_model_input(self, model: nn.Module, args: tuple, kwargs: dict):
        if recompute.in_backward():  # the whole model is recomputed: each mixer replays its own input mix
            for mixer in self.mixers:
                result = mixer._replay_input(model, args, kwargs)
                if result is not None:
                    return result
            return None
        if not model.training:
            for mixer in self.mixers:
                mixer._draw = None
            return None
        choice, self._pinned_choice = self._pinned_choice, None
        if choice is None:
            probs = torch.tensor(self.p, dtype=torch.float64)
            choice = int(torch.multinomial(probs, 1, generator=self.generator))
        self.chosen = self.mixers[choice]
        for mixer in self.mixers:
            if mixer is not self.chosen:
                mixer._begin(model, args, kwargs, None)
        return self.chosen._begin(model, args, kwargs, self.chosen._decide())

    def _on_model_output(self, model: nn.Module, args: tuple, output) -> None:
        if self.chosen is not None and model.training and not recompute.in_backward():
            self.chosen._on_model_output(model, args, output)


def mixers_of(hooks: Sequence) -> list:
    """The mixing regularizers among ``hooks``: those with a ``loss`` method, as the training loop takes
    its loss from them (a :class:`OneOf` counts as one; a user's own mixing class counts too)."""
    return [h for h in hooks if callable(getattr(h, "loss", None))]


def attach(model: nn.Module, *hooks: LayerHook) -> HookHandle:
    """Attach several regularizers and probes to ``model``; return one handle that removes them all.

    At most one mixing regularizer may be among them (two would both mix every batch): combine several
    with :class:`OneOf`. If any attach fails, those already attached are removed before the error
    propagates.
    """
    mixing = mixers_of(hooks)
    if len(mixing) > 1:
        names = ", ".join(type(m).__name__ for m in mixing)
        raise ValueError(
            f"attach() got {len(mixing)} mixing regularizers ({names}), which would each mix every batch "
            "and leave no single loss; combine them with OneOf([...]) to use one per batch"
        )
    handles: list[HookHandle] = []
    try:
        for hook in hooks:
            if not callable(getattr(hook, "attach", None)):
                raise TypeError(
                    f"attach() takes hooks with an attach(model) method, got {type(hook).__name__}"
                )
            handles.append(hook.attach(model))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return HookHandle([], on_remove=lambda: [h.remove() for h in reversed(handles)])

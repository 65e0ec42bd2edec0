"""One training forward of a mixer as one object: what the user pinned for it (:class:`Pins`), and what
it decided and drew (:class:`Forward`), carried from the model's pre-hook through the mixed layer's hook to
the mark on the model's output that ``loss()`` reads (:mod:`.binding`).

A forward's lam and partner index are drawn once, where the layer runs, and kept here typed: never written
into the user's pins and read back. What a repeat of the mix needs (``pin_last``, a recomputation under
activation checkpointing) is the :class:`Pins` that :meth:`Forward.repeat` returns: the same layer and
values, lam and the index as drawn, and the generator's state before the method's own draws.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..functional import is_permutation
from .contract import Draw, MixState, cached


@dataclass(frozen=True)
class Pins:
    """What :meth:`~mixhook.engine.mixer.Mixer.pin`, ``pin_last`` or ``skip_next`` fixed for the next
    training forward (:attr:`~mixhook.engine.mixer.Mixer.pins`); what is ``None`` is drawn as usual.

    Attributes:
        layer: the layer spec to mix.
        lam: float64 on the CPU: a 0-d tensor, or one per sample.
        index: the partners, int64 on the CPU (negative values count from the end, as indexing does).
        values: the method's own pinned values (its ``pin_keys``: CutMix's ``box``), and what its
            ``before_forward``/``before_mix`` computed for this forward (a saliency map).
        skip: the forward mixes nothing (``skip_next``).
        span: ``index``'s smallest and largest value, read once when it was pinned (checked against the
            batch when the forward mixes).
        permutation: whether ``index`` holds each of ``0..n-1`` once.
        state: for a repeat (``pin_last``, a recomputation), the generator's state the repeated mix's own
            draws (a box, a mask, noise) came from; ``None``: it drew nothing beyond lam and the index.
    """

    layer: str | None = None
    lam: torch.Tensor | None = None
    index: torch.Tensor | None = None
    values: Mapping[str, Any] = field(default_factory=dict)
    skip: bool = False
    span: tuple[int, int] | None = None
    permutation: bool = False
    state: torch.Tensor | None = None

    @cached
    def given(self) -> Mapping[str, Any]:
        """What :attr:`~mixhook.engine.contract.Draw.pinned` shows a method: lam and the index where they
        are pinned, and :attr:`values`."""
        given = {"lam": self.lam, "index": self.index}
        return {**{k: v for k, v in given.items() if v is not None}, **self.values}

    def joined(self, extra: Mapping[str, Any]) -> Pins:
        """These pins with ``extra`` (what a method's ``before_forward``/``before_mix`` returned) joined: a
        ``lam`` or an ``index`` there are this forward's (an index a method drew is in range by
        construction and a permutation only where it says so, ``"permutation": True``)."""
        extra = dict(extra)
        changes = {"lam": extra.pop("lam", self.lam), "skip": False}
        index, permutation = extra.pop("index", None), extra.pop("permutation", False)
        if index is not None:
            changes.update(index=index, span=(0, index.shape[0] - 1), permutation=bool(permutation))
        return replace(self, values={**self.values, **extra}, **changes)


NO_PINS = Pins()
SKIP = Pins(skip=True)


def given_index(index, where: str) -> dict:
    """A partner index given to ``pin`` or ``draw_for`` as a 1-D int64 CPU tensor, with its span and whether
    it is a permutation (read once here, not in the forward), as :class:`Pins` fields; else one line."""
    index = torch.as_tensor(index)
    if index.ndim != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
        raise ValueError(
            f"{where}(index=...): needs a 1-D integer index, got {index.dtype} {tuple(index.shape)}"
        )
    index = index.to(device="cpu", dtype=torch.int64)
    span = (int(index.min()), int(index.max())) if index.numel() else (0, -1)
    return {"index": index, "span": span, "permutation": is_permutation(index)}


@dataclass(eq=False)
class Forward:
    """One training forward of a mixer: decided at the model's pre-hook (whether, and at which layer),
    mixed when that layer runs, read at the model's end and by ``loss()``.

    Attributes:
        layer: the layer spec it mixes.
        pins: what was pinned for it (:data:`NO_PINS`: nothing), with what the method's
            ``before_forward``/``before_mix`` added.
        batch: the batch size of the model's input, where it can be told (each mixed layer is checked
            against it).
        drawn: the :class:`~mixhook.engine.contract.Draw` of lam and the partner index, once drawn (before
            ``mix()``, for a method that draws nothing else).
        state: the generator's state before ``mix()`` drew (a method that draws in ``mix()``).
        mixed: once the layer ran: the :class:`~mixhook.engine.contract.MixState` of what it mixed.
        replay: a recomputation's (activation checkpointing): the forward's mix made again from ``pins``
            (:meth:`repeat`), nothing drawn anew, computed before it or recorded.
    """

    layer: str
    pins: Pins = NO_PINS
    batch: int | None = None
    drawn: Draw | None = None
    state: torch.Tensor | None = None
    mixed: MixState | None = None
    replay: bool = False

    @property
    def done(self) -> bool:
        """Whether its layer has mixed."""
        return self.mixed is not None

    def kept(self, recomputed: frozenset[str] = frozenset()) -> Forward:
        """This forward as the mixer keeps it once its output carries the mix (what ``pin_last`` repeats):
        its layer, pins and draws, every tensor among them that carries a ``grad_fn`` detached (a repeat
        computes anew what it needs with gradients), the values named in ``recomputed`` left out (the
        method's :attr:`~mixhook.engine.mixer.Mixer.computed_each_forward`), and no
        :class:`~mixhook.engine.contract.MixState`."""
        values = {k: detached(v) for k, v in self.pins.values.items() if k not in recomputed}
        drawn = None if self.drawn is None else replace(self.drawn, pinned={})
        return Forward(self.layer, replace(self.pins, values=values), self.batch, drawn, self.state)

    def repeat(self) -> Pins:
        """The pins that repeat this forward's mix exactly (``pin_last``; a recomputation replays them):
        its layer and values, lam and the index as drawn, and the generator's state before the method's
        own draws."""
        pins = replace(self.pins, layer=self.layer, skip=False, state=self.state)
        if self.drawn is None:
            return pins
        lam, index, permutation = self.drawn.lam, self.drawn.index, self.drawn.permutation
        span = pins.span if pins.index is not None else (0, index.shape[0] - 1)
        return replace(pins, lam=lam, index=index, span=span, permutation=permutation)


def detached(value):
    """``value`` with every tensor in it (in tuples, lists and dicts) that carries a ``grad_fn`` detached."""
    if isinstance(value, torch.Tensor):
        return value.detach() if value.grad_fn is not None else value
    if isinstance(value, tuple | list):
        return type(value)(detached(v) for v in value)
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    return value

"""How mixing changes over training: timm's ``mixup_off_epoch``, ramps of ``prob`` and ``alpha``, and
per-layer draw weights, as one plain object that the training loop calls before each step.

    schedule = MixSchedule(mixer, prob=Ramp(0.0, 1.0, epochs=5), off_epoch=90, layer_weights=[1, 2, 2])
    for epoch in range(1, epochs + 1):
        for step, (x, y) in enumerate(loader):
            schedule.set(epoch, step / len(loader))
            ...

A schedule holds no state of its own: what it sets depends only on ``(epoch, fraction)``, so a run
resumed from a checkpoint at any step sets the same values as the uninterrupted run (the app tests
this). It writes the mixers' ``prob`` and ``alpha`` attributes and :attr:`Mixer.layer_weights`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .engine.checks import check_fraction, check_layer_weights, check_positive
from .engine.contract import MixingHook
from .engine.mixer import Mixer
from .hooks import StateError

SHAPES = ("linear", "cosine")


@dataclass(frozen=True)
class Ramp:
    """A value going from ``start`` to ``end`` over the first ``epochs`` epochs of training (fractional
    epochs count: it moves every step), then staying at ``end``; ``shape`` ``"linear"`` or ``"cosine"``
    (``start + (end - start) * (1 - cos(pi * t)) / 2``)."""

    start: float
    end: float
    epochs: float
    shape: str = "linear"

    def __post_init__(self):
        for name in ("start", "end", "epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"Ramp {name} must be a finite number, got {value!r}")
        if self.epochs <= 0:
            raise ValueError(f"Ramp epochs must be > 0, got {self.epochs!r}")
        if self.shape not in SHAPES:
            raise ValueError(f"Ramp shape must be one of {', '.join(SHAPES)}, got {self.shape!r}")

    def at(self, elapsed: float) -> float:
        """The value after ``elapsed`` epochs of training (0 at the first step)."""
        t = min(max(elapsed / self.epochs, 0.0), 1.0)
        if self.shape == "cosine":
            t = (1.0 - math.cos(math.pi * t)) / 2.0
        return self.start + (self.end - self.start) * t


def _members(mixer: MixingHook) -> list[Mixer]:
    """The :class:`Mixer` objects a schedule sets: the mixer, or each of a ``OneOf``'s."""
    members = list(getattr(mixer, "mixers", [mixer]))
    if not all(isinstance(m, Mixer) for m in members):
        names = ", ".join(type(m).__name__ for m in members)
        raise TypeError(f"MixSchedule sets mixhook Mixers (or a OneOf of them), got {names}")
    return members


class MixSchedule:
    """Set ``mixer``'s ``prob`` and ``alpha`` (each a number or a :class:`Ramp`; ``None``: left as
    constructed), switch mixing off after epoch ``off_epoch`` (timm's ``mixup_off_epoch``: epochs
    ``1..off_epoch`` mix, later ones do not; 0: never off; to stop for the last ``N`` of ``E`` epochs,
    ``off_epoch = E - N``), and weight the draw of the mixed layer (``layer_weights``, one non-negative
    weight per layer of the mixer, in its order). With a ``OneOf``, ``prob`` and ``alpha`` apply to each
    of its mixers; ``layer_weights`` needs a single mixer.

    Refused at construction (one line): an ``alpha`` for a method that draws no lam from alpha
    (SmoothMix, ResizeMix, Attentive CutMix), a prob ramp outside [0, 1], an alpha ramp that reaches 0.
    """

    def __init__(
        self,
        mixer: MixingHook,
        prob: float | Ramp | None = None,
        alpha: float | Ramp | None = None,
        off_epoch: int = 0,
        layer_weights: Sequence[float] | None = None,
    ):
        self.mixer, self.members = mixer, _members(mixer)
        self.prob, self.alpha = _value("prob", prob), _value("alpha", alpha)
        if self.alpha is not None:
            fixed = [type(m).__name__ for m in self.members if "alpha" not in _parameters(type(m))]
            if fixed:
                names = ", ".join(fixed)
                raise ValueError(
                    f"MixSchedule(alpha=...): {names} draws no lam from alpha: nothing to schedule"
                )
        if isinstance(off_epoch, bool) or not isinstance(off_epoch, int) or off_epoch < 0:
            raise ValueError(f"off_epoch must be an int >= 0 (0: never off), got {off_epoch!r}")
        self.off_epoch = off_epoch
        self.layer_weights = None
        if layer_weights is not None:
            if len(self.members) != 1 or self.members[0] is not mixer:
                raise ValueError("MixSchedule(layer_weights=...) weights one mixer's layers; not a OneOf")
            self.layer_weights = check_layer_weights(mixer.specs, layer_weights)
        self._base = [m.prob for m in self.members]

    def __repr__(self) -> str:
        return (
            f"MixSchedule(prob={self.prob!r}, alpha={self.alpha!r}, off_epoch={self.off_epoch}, "
            f"layer_weights={self.layer_weights})"
        )

    def state_dict(self) -> dict:
        """The schedule holds no state (what it sets is a function of the epoch and step; the draws are
        the mixer's, in the mixer's own :meth:`~mixhook.Mixer.state_dict`): its state dict is its
        settings, which :meth:`load_state_dict` checks, so a run resumed with another schedule is refused
        in one line."""
        return {"type": "MixSchedule", "settings": repr(self)}

    def load_state_dict(self, state) -> None:
        if not isinstance(state, dict) or state.get("type") != "MixSchedule":
            raise StateError(f"MixSchedule.load_state_dict(): not a MixSchedule's state: {state!r:.80}")
        if state.get("settings") != repr(self):
            raise StateError(
                f"MixSchedule.load_state_dict(): the state is of {state.get('settings')}, this is {self!r}"
            )

    def set(self, epoch: int, fraction: float = 0.0) -> None:
        """Set the mixers for the step ``fraction`` (in [0, 1)) of the way through ``epoch`` (from 1)."""
        elapsed = epoch - 1 + fraction
        off = bool(self.off_epoch) and epoch > self.off_epoch
        for member, prob in zip(self.members, self._base, strict=True):
            value = prob if self.prob is None else _at(self.prob, elapsed)
            member.prob = 0.0 if off else check_fraction("prob", value)
            if self.alpha is not None:
                member.alpha = check_positive("alpha", _at(self.alpha, elapsed))
        if self.layer_weights is not None:
            self.members[0].layer_weights = self.layer_weights


def _parameters(cls) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters)


def _value(name: str, value):
    if value is None or isinstance(value, Ramp):
        if isinstance(value, Ramp):
            low, high = sorted((value.start, value.end))
            if name == "prob" and not (0.0 <= low and high <= 1.0):
                raise ValueError(f"MixSchedule(prob=...): the ramp must stay in [0, 1], got {value}")
            if name == "alpha" and not low > 0:
                raise ValueError(f"MixSchedule(alpha=...): the ramp must stay > 0, got {value}")
        return value
    return check_fraction(name, value) if name == "prob" else check_positive(name, value)


def _at(value, elapsed: float) -> float:
    return value.at(elapsed) if isinstance(value, Ramp) else value

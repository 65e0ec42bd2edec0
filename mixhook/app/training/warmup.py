"""Gradual warm-up of the learning rate (Goyal et al. 2017, "Accurate, Large Minibatch SGD", Section 2.2):
over the first ``epochs`` epochs the learning rate rises linearly, step by step, from ``start_factor``
times the scheduled rate to the scheduled rate itself, as the ImageNet mixup recipe of Zhang et al. 2018
trains (0.1 to 0.4 over 5 epochs at a batch of 1,024: ``start_factor=0.25``).

It multiplies the rate the epoch scheduler gives (``scheduler=multistep``, ``cosine``, any other) for
one optimizer step and puts the scheduled rate back right after it, so the scheduler never sees the
factor (a scheduler that computes its next rate from the current one, as torch's do, would otherwise
carry it on) and a checkpoint holds the scheduled rate. The factor depends on the run's step count
alone, so a resumed run warms up exactly as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Warmup:
    """Linear warm-up over ``epochs`` epochs, from ``start_factor`` (in ``[0, 1]``) times the scheduled
    learning rate at the run's first step to the scheduled rate once ``epochs`` epochs of steps are
    done (``epochs=0``: none, a factor of 1 throughout)."""

    epochs: int
    start_factor: float
    _scheduled: list = field(default_factory=list, repr=False)

    def factor(self, step: int, steps: int) -> float:
        """The factor of the run's ``step``-th optimizer step (counted from 0 over all epochs) in epochs
        of ``steps`` steps."""
        total = self.epochs * steps
        if step >= total:
            return 1.0
        return self.start_factor + (1.0 - self.start_factor) * step / total

    def apply(self, optimizer: torch.optim.Optimizer, step: int, steps: int) -> None:
        """Before the run's ``step``-th optimizer step: every parameter group's rate times :meth:`factor`
        (nothing once the warm-up is over). Applied again before it was restored (a step replayed to
        name a non-finite layer), it starts from the scheduled rates again."""
        self.restore(optimizer)
        factor = self.factor(step, steps)
        if factor == 1.0:
            return
        self._scheduled = [group["lr"] for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, self._scheduled, strict=True):
            group["lr"] = lr * factor

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """After the step: the scheduled rates back (nothing if :meth:`apply` changed none)."""
        if not self._scheduled:
            return
        for group, lr in zip(optimizer.param_groups, self._scheduled, strict=True):
            group["lr"] = lr
        self._scheduled = []

"""A momentum copy of a model: an exponential moving average of its parameters, made when a method is
attached and updated once per optimizer step (AutoMix's and SAMix's momentum encoder ``k``).

:class:`MomentumCopy` is the machinery a method needs for one, apart from the method: making the copy (a
whole one on every rank where FSDP2 shards the model: :func:`mixhook.copies.whole_copy`), keeping it on the
model's device, dtype and mode, noticing an optimizer step without a hook in the user's loop (the
parameters' versions change), updating it with OpenMixup's cosine momentum schedule
(``core/hooks/momentum_hook.py``, ``CosineScheduleHook``), reading FSDP2's shards as the optimizer steps
them, and saving it. The update of a step is made at the next training forward (or by :meth:`catch_up`),
as OpenMixup's hook makes it after the runner's iteration.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .copies import whole_copy
from .sharding import sharded


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter whole (an FSDP2 shard, a ``DTensor``, gathered)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _same_shapes(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape for k in sa)


class MomentumCopy:
    """A momentum copy of a model, for a method (``owner``, in its errors) that reads one.

    Args:
        momentum, end_momentum: the update's momentum, ``k = m * k + (1 - m) * q``: ``momentum`` at first,
            cosine-scheduled to ``end_momentum`` over ``scope`` of ``total_steps`` (OpenMixup's
            ``CosineScheduleHook`` with ``warming_up="constant"``); constant without ``total_steps``.
        scope: ``(low, high)``, the fractions of the run between which the momentum moves.
        total_steps: the run's optimizer steps (``None``: until :meth:`span` is told them).
        owner: the method's name, for its errors.

    Attributes:
        model: the copy (``None`` until :meth:`make`), its parameters without gradients.
        updates: the updates made so far (the schedule's step).
    """

    _TRANSIENT = ("_versions", "_also_versions", "_copied_from", "_shards", "_first_step")

    def __init__(
        self,
        momentum: float = 0.999,
        end_momentum: float = 0.999999,
        scope: tuple[float, float] = (0.1, 1.0),
        total_steps: int | None = None,
        owner: str = "MomentumCopy",
    ):
        if not 0 <= momentum <= end_momentum <= 1:
            raise ValueError(
                f"{owner}: need 0 <= momentum <= end_momentum <= 1, got {momentum!r} and {end_momentum!r}"
            )
        low, high = scope
        if not 0 <= low <= high <= 1:
            raise ValueError(
                f"{owner}: momentum_scope must be (low, high) with 0 <= low <= high <= 1, got {scope!r}"
            )
        if total_steps is not None and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1
        ):
            raise ValueError(f"{owner}: total_steps must be an integer >= 1 or None, got {total_steps!r}")
        self.momentum, self.end_momentum = float(momentum), float(end_momentum)
        self.scope, self.total_steps, self.owner = (float(low), float(high)), total_steps, owner
        self.model: nn.Module | None = None
        self.updates = 0
        self._fresh()

    def _fresh(self) -> None:
        self._versions: tuple | None = None  # the model's parameters' versions at the last look
        self._also_versions: tuple | None = None  # and those of the parameters stepped with them
        self._copied_from = None  # a weak reference to the model the copy was made of
        self._shards: list | None = None  # under FSDP2: the model's parameters as its optimizer steps them
        # (inside a forward FSDP registers the gathered ones in their place)
        self._first_step = None  # sharded after make(): the hook that reads them at the first step

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle) keeps the copy and its schedule, not what it knew of a model."""
        return {k: v for k, v in self.__dict__.items() if k not in self._TRANSIENT}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fresh()

    def span(self, steps: int) -> None:
        """The schedule over a run of ``steps`` optimizer steps, where ``total_steps`` was not given."""
        if self.total_steps is None:
            self.total_steps = int(steps)

    def momentum_at(self, step: int) -> float:
        """The momentum of the update after optimizer step ``step`` (0-based)."""
        total = self.total_steps
        if total is None:
            return self.momentum
        low, high = self.scope
        top = int(total * high) if high < 1 else total
        bottom = int(total * low) if low > 0 else 0
        if step < bottom:
            return self.momentum
        step = min(step, top)  # (after the scope: the last value set stays)
        return (
            self.end_momentum
            - (self.end_momentum - self.momentum) * (math.cos(math.pi * step / float(top)) + 1) / 2
        )

    def make(self, model: nn.Module) -> nn.Module:
        """The copy of ``model`` (kept where it was made of this same model before, or came with a copy
        or an unpickling of its owner, with the same parameters' names and shapes: a detach and attach
        continue it), its parameters without gradients."""
        before = self._copied_from() if self._copied_from is not None else None
        kept = (self._copied_from is None or before is model) and self.model is not None
        if not (kept and _same_shapes(self.model, model)):
            self.model = whole_copy(model)  # (under FSDP2 a whole copy on each rank)
            self.updates = 0
        self._copied_from = weakref.ref(model)
        self._shards = list(model.parameters()) if sharded(model) else None
        for p in self.model.parameters():
            p.requires_grad_(False)
        return self.model

    def follow(self, model: nn.Module, *others: nn.Module) -> nn.Module:
        """The copy (and ``others``: the owner's own modules) on ``model``'s device, in its dtype (as one
        made now would be: a model cast after :meth:`make`) and in its mode."""
        here = next(model.parameters(), None)
        there = next(self.model.parameters(), None)
        moved = (
            here is not None
            and there is not None
            and (there.device, there.dtype) != (here.device, here.dtype)
        )
        for module in (self.model, *others):
            if moved:
                module.to(here.device, here.dtype if here.is_floating_point() else None)
            module.train(model.training)
        return self.model

    def step_if_stepped(
        self,
        model: nn.Module,
        also: Sequence[torch.Tensor] = (),
        also_name: str = "",
        lockstep: Callable[[nn.Module, str], None] | None = None,
    ) -> None:
        """The update, once per optimizer step: at the first training forward after ``model``'s
        parameters changed. ``also``: parameters the same optimizer must step with the model (the owner's
        own, ``also_name``): refused in one line where they had gradients and did not change. ``lockstep``:
        called with the model and what it runs before an update of a sharded model (every rank gathers at
        once)."""
        if self._versions is None and self._shards is None and self._first_step is None and sharded(model):
            self._await_first_step(model)  # (sharded after make())
        if self._first_step is not None:
            return  # (nothing to update before it)
        versions = tuple(p._version for p in self._stepped(model))
        others = tuple(p._version for p in also)
        if self._versions is not None and versions != self._versions:
            if self._also_versions == others and any(p.grad is not None for p in also):
                raise RuntimeError(
                    f"{self.owner}: the optimizer stepped the model but not {also_name}, which has "
                    "gradients: add the mixer's parameters to it, e.g. SGD([*model.parameters(), "
                    "*mix.parameters()], ...)"
                )
            if self._shards is not None and lockstep is not None:
                lockstep(model, "a gather of the parameters (its momentum copy's update)")
            self.update(model)
        self._versions, self._also_versions = versions, others

    def _await_first_step(self, model: nn.Module) -> None:
        """A model sharded by FSDP2 after :meth:`make`: its forward (where this runs) holds the root's
        gathered parameters in place of the shards its optimizer steps, so the shards are read after the
        first optimizer step that holds them (a hook on every optimizer's step, removed then), and the
        next training forward makes that step's update."""

        def after_step(optimizer, args, kwargs) -> None:
            shards = list(model.parameters())
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if not any(id(p) in held for p in shards):
                return  # (another model's optimizer)
            self._shards, self._versions, self._also_versions = shards, (-1,) * len(shards), None
            self._first_step.remove()
            self._first_step = None

        self._first_step = register_optimizer_step_post_hook(after_step)

    def _stepped(self, model: nn.Module) -> list:
        """The model's parameters as its optimizer steps them (under FSDP2 the shards, read at
        :meth:`make` or, sharded after it, at the first optimizer step)."""
        return self._shards if self._shards is not None else list(model.parameters())

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One update from ``model``'s parameters, with the schedule's momentum (FSDP2's shards gathered)."""
        m = self.momentum_at(self.updates)
        qs = [_whole(q) for q in self._stepped(model)]
        ks = list(self.model.parameters())
        torch._foreach_copy_(
            ks, torch._foreach_add(torch._foreach_mul(ks, m), torch._foreach_mul(qs, 1.0 - m))
        )
        self.updates += 1

    def seen(self) -> bool:
        """Whether the copy has looked at its model's parameters since it was made or loaded (an update
        may then be owed: :meth:`step_if_stepped`)."""
        return self._versions is not None and self.model is not None

    def detach(self) -> None:
        """Forget the model (its owner was detached): the first-step hook removed."""
        if self._first_step is not None:
            self._first_step.remove()
            self._first_step = None

    def state_dict(self) -> dict:
        """The copy's state and the updates made."""
        state = {"updates": self.updates}
        if self.model is not None:
            state["momentum_model"] = self.model.state_dict()
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """What :meth:`state_dict` gave (the copy once made: :meth:`make`)."""
        if "momentum_model" in state:
            self.model.load_state_dict(state["momentum_model"])
        self.updates = int(state.get("updates", 0))
        self._versions = self._also_versions = None

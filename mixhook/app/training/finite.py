"""The stop on a non-finite loss: no step whose loss is NaN or infinite is ever applied, and the run
stops naming the first layer whose output was non-finite.

Checking a loss on the host (``bool(torch.isfinite(loss))``) waits for the device to finish the
forward: on a CPU that costs nothing (it computes synchronously), on a GPU it empties the launch queue
every step. So :class:`FiniteCheck` works in one of two ways:

- ``every=1``: the host reads each step's loss before the step's backward (as it always did);
- ``every=N > 1``: the check stays on the device. A flag is raised by the first non-finite loss and
  stays raised; while it is, the optimizer skips its step on the device (the ``found_inf`` tensor
  torch's fused optimizers take, the way ``torch.amp.GradScaler`` makes them skip an overflowed step),
  so that step and every later one change nothing: the model and the optimizer stay exactly as they
  were before the first non-finite step. The host reads the flag every ``N`` steps, before any
  checkpoint is written and at the end of the epoch. The first non-finite step's batch is kept on the
  device, and the mixer's generator states before each step on the host, so that the step can be
  replayed to name the layer.

Only an optimizer that skips a step on the device can be checked lazily (``fused=True`` for
``torch.optim.SGD``, ``Adam``, ``AdamW``): any other would apply the non-finite step before the host
sees it. Torch's fused SGD fills its momentum with uninitialised memory when it skips its *first* step
(LibreYOLO/libreyolo#771), so while an SGD has no momentum buffer yet, its step is read on the host.
"""

from __future__ import annotations

import torch
import torch.distributed
from torch import nn

from mixhook.engine.contract import members
from mixhook.engine.partners import crosses_ranks
from mixhook.mixers import MixingHook

from .checkpoint import hook_generators
from .distributed import Dist

LAZY_EVERY = 100  # steps between host reads on CUDA when not configured (trainer.check_finite_every)


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or infinite; nothing of that step was applied or saved. ``step``: the step
    of the epoch (1-based) that went non-finite."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` takes a ``found_inf`` tensor and skips on the device (fused)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def check_every(every: int | None, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """The steps between host reads of the finite check: ``every`` as configured (``None``: 1 on a CPU or
    with an optimizer that cannot skip on the device, :data:`LAZY_EVERY` otherwise). ``ValueError``
    for ``every > 1`` with an optimizer that cannot skip a step on the device."""
    if every is None:
        return LAZY_EVERY if device.type != "cpu" and skips_on_device(optimizer) else 1
    if every < 1:
        raise ValueError(f"trainer.check_finite_every={every}: must be at least 1 (1: every step)")
    if every > 1 and not skips_on_device(optimizer):
        raise ValueError(
            f"trainer.check_finite_every={every} needs an optimizer that skips a step on the device, "
            f"so that no non-finite step is applied before the host reads it: +optim.fused=true "
            f"(torch.optim.SGD, Adam, AdamW); {type(optimizer).__name__} here is not fused; "
            "or check every step: trainer.check_finite_every=1"
        )
    return every


class FiniteCheck:
    """One run's stop on a non-finite loss (see the module's docstring); ``every``: steps between the
    host's reads (1: each step, before its backward). Per step, :meth:`before_forward`,
    :meth:`after_loss`, :meth:`step` (the optimizer's step, skipped on the device when flagged), and
    :meth:`read` when :meth:`due`, before a checkpoint and at the epoch's end.
    :meth:`for_epoch` gives the model, mixer, autocast dtype and schedule the replay needs."""

    def __init__(
        self, every: int = 1, optimizer: torch.optim.Optimizer | None = None, dist: Dist | None = None
    ):
        if every < 1:
            raise ValueError(f"FiniteCheck(every={every}): must be at least 1")
        if every > 1:
            check_every(every, optimizer, torch.device("cpu"))  # refused unless it skips on the device
        self.every, self.dist = every, dist or Dist()
        self._context = (None, None, None, None)
        self._generators: dict[str, torch.Generator] = {}
        self._momentum_ready = False
        self._flag = None  # float 0/1 on the device, every rank's: a non-finite loss since the last read
        self._first = None  # int64: this rank's first non-finite step of the epoch (-1: none)
        self._value = self._x = self._y = self._n = None  # that step's loss and batch
        self._draws: dict[int, dict] = {}  # step -> the mixer's generator states before its forward

    @property
    def lazy(self) -> bool:
        return self.every > 1

    def for_epoch(self, model: nn.Module, mixup: MixingHook | None, dtype, before_step=None) -> None:
        self._context = (model, mixup, dtype, before_step)
        self._generators = hook_generators([mixup]) if mixup is not None and self.lazy else {}

    def due(self, done: int) -> bool:
        """Whether the host reads after ``done`` steps of the epoch."""
        return done % self.every == 0

    def before_forward(self, done: int) -> None:
        """Lazily: keep the mixer's generator states, to replay step ``done`` if it goes non-finite."""
        if self._generators:
            self._draws[done] = {k: g.get_state() for k, g in self._generators.items()}

    def after_loss(self, value: torch.Tensor, x: torch.Tensor, y: torch.Tensor, done: int) -> None:
        """Check the loss of step ``done`` (0-based): on the host now (``every=1``; raises
        :class:`NonFiniteLoss` before anything of the step is applied), or on the device."""
        value = value.detach()
        if not self.lazy:
            bad = not bool(torch.isfinite(value))
            if self.dist.any(bad):  # every rank stops at the same step, before any of them applies it
                raise self._located(float(value), done, x) if bad else self._elsewhere(done)
            return
        if self._x is not None and (x.shape[1:] != self._x.shape[1:] or x.shape[0] > self._x.shape[0]):
            kept = self._draws.pop(done, None)
            self.read()  # a batch of another shape: settle what the kept one holds, then keep anew
            self._x = None
            if kept is not None:
                self._draws[done] = kept
        if self._x is None:
            self._x, self._y = torch.zeros_like(x), torch.zeros_like(y)
        if self._flag is None:
            self._flag = torch.zeros((), device=value.device)
            self._first = torch.full((), -1, dtype=torch.int64, device=value.device)
            self._value = torch.zeros((), dtype=value.dtype, device=value.device)
            self._n = torch.zeros((), dtype=torch.int64, device=value.device)
        bad = ~torch.isfinite(value)
        new = bad & (self._first < 0)  # this rank's first non-finite step
        n = x.shape[0]
        self._x[:n].copy_(torch.where(new, x, self._x[:n]))
        self._y[:n].copy_(torch.where(new, y, self._y[:n]))
        self._n.copy_(torch.where(new, n, self._n))
        self._value.copy_(torch.where(new, value, self._value))
        self._first.copy_(torch.where(new, done, self._first))
        flag = torch.maximum(self._flag, bad.to(self._flag.dtype))
        if self.dist.enabled:  # queued on the device like the gradients' all-reduce: no host wait
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        self._flag = flag

    def step(self, optimizer: torch.optim.Optimizer, scaler=None) -> None:
        """The optimizer's step (through ``scaler`` under fp16), skipped on the device while flagged."""
        if self.lazy and not self._momentum_ready:
            if _fresh_momentum(optimizer):
                self.read()  # fused SGD must not skip a first step (see the module's docstring)
            else:
                self._momentum_ready = True
        if scaler is not None:
            if self.lazy:  # non-finite gradients make the scaler skip the fused step on the device
                poison = torch.where(self._flag > 0, float("nan"), 1.0).to(self._flag.device)
                grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                torch._foreach_mul_(grads, poison)
            scaler.step(optimizer)
            scaler.update()
        elif self.lazy:
            optimizer.grad_scale, optimizer.found_inf = None, self._flag
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf
        else:
            optimizer.step()

    def read(self) -> None:
        """Lazily: read the device's flag (a host sync); raise :class:`NonFiniteLoss` for the first
        non-finite step since the last read, after replaying it to name the layer."""
        if not self.lazy or self._flag is None or not bool(self._flag):
            self._draws.clear()
            return
        first = int(self._first)
        steps = [s for s in self.dist.gather(first) if s >= 0]  # every rank's first, to name the step
        if first < 0:
            raise self._elsewhere(min(steps))
        n = int(self._n)
        x, y, value = self._x[:n], self._y[:n], float(self._value)
        model, mixup, dtype, before_step = self._context
        if mixup is not None and not crosses_ranks(mixup):  # draw that step's mix again, then repeat it
            for key, g in self._generators.items():
                g.set_state(self._draws[first][key])  # kept before each step's forward
            if before_step is not None:
                before_step(first)
            mixup.use_targets(y)
            with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
                _eager(model)(x)
        raise self._located(value, first, x)

    def _elsewhere(self, done: int) -> NonFiniteLoss:
        advice = _advice(self._context[1])
        return NonFiniteLoss(
            f"the loss became non-finite on another rank than {self.dist.rank}{advice}", done + 1
        )

    def _located(self, value: float, done: int, x: torch.Tensor) -> NonFiniteLoss:
        """The error for step ``done`` of this rank, naming the first non-finite layer of ``x``'s replay
        (and what the mixer says to try, where it says)."""
        model, mixup, dtype, _ = self._context
        rank = f" on rank {self.dist.rank}" if self.dist.enabled else ""
        where = locate_nonfinite(model, x, mixup, dtype)
        return NonFiniteLoss(f"the loss became {value}{rank}; {where}{_advice(mixup)}", done + 1)


def _advice(mixup) -> str:
    """What a mixer that trains parameters of its own says to try when the loss goes non-finite (its
    ``if_non_finite``: the config's knobs that tame it; inside a ``OneOf`` too), as the tail of the one
    line."""
    said = [
        f"; {type(m).__name__}: {m.if_non_finite}"
        for m in (members(mixup) if mixup is not None else ())
        if isinstance(getattr(m, "if_non_finite", None), str) and m.if_non_finite
    ]
    return "".join(said)


def _fresh_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a momentum SGD is about to take its first step for some parameter with a gradient."""
    return any(
        group.get("momentum", 0) and "momentum_buffer" not in optimizer.state.get(p, {})
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    )


def _eager(model: nn.Module) -> nn.Module:
    """The model itself, to replay eagerly: through what torch.compile wraps, without DDP's collectives
    (the other ranks do not replay)."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


@torch.no_grad()
def locate_nonfinite(model: nn.Module, x: torch.Tensor, mixup: MixingHook | None = None, dtype=None) -> str:
    """Replay the forward of ``x`` (in training mode, repeating the mixer's last mix) with a forward
    hook on every module, and say which module first returned a non-finite value, in call order, and
    which parameters are non-finite."""
    model = _eager(model)
    first: list[str] = []
    names = {module: name for name, module in model.named_modules()}

    def hook(module, args, output):
        if isinstance(output, dict):
            output = list(output.values())
        items = output if isinstance(output, (tuple, list)) else [output]
        tensors = [t for t in items if isinstance(t, torch.Tensor)]
        bad = any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors)
        if bad and not first and module is not model:
            first.append(f"{names[module]} ({type(module).__name__})")

    if crosses_ranks(mixup):
        mixup.skip_next()  # its partners were on the other ranks, which do not replay: unmixed
    elif mixup is not None:
        mixup.pin_last()  # the same mix as the step that went non-finite
    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    params = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    where = f"first non-finite layer output: {first[0]}" if first else "every layer output is finite"
    if params:
        more = f" and {len(params) - 1} more" if len(params) > 1 else ""
        where += f"; non-finite parameters: {params[0]}{more}"
    return where

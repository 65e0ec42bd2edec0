"""Batch norm over the clean rows and the mixed rows apart, a collaborator of a :class:`~.mixer.Mixer`
whose method says ``batch_norm_apart = True``: what two forwards give, run as one.

A method trained on the clean batch beside its mix (:attr:`~.mixer.Mixer.clean`) runs both in one forward
of ``2B`` rows: the clean samples, then their mixes. Every layer that computes each row alone gives the
same rows as two forwards would; batch norm does not: in training it normalises by the batch's statistics,
so one batch of ``2B`` normalises the clean rows by statistics shared with their mixes, and its running
statistics follow the doubled batch. Where the method's authors train with two forwards (OpenMixup's
AutoMix and SAMix: ``backbone_q(x)``, then ``backbone_q(mixed_x)``), that one forward is another training:
on the app's digits experiment AutoMix diverged within three epochs in one forward and trained in two.

So, while a training forward of such a method carries ``2B`` rows after its mix, each batch-norm layer it
reaches normalises the clean half by the clean half's statistics and the mixed half by its own, and
updates its running statistics with the clean half's, then the mixed half's: the two forwards' values,
gradients and running statistics. The layer's own call on the whole batch runs first (a hook cannot stop
it) and its result is dropped, its running statistics put back; a layer before the mix (``B`` rows) and
an evaluation forward are left alone. A recomputation under activation checkpointing normalises apart
again where its forward did (:mod:`mixhook.recompute`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import recompute


class NormsApart:
    """The batch-norm hooks of one mixer (:meth:`register`).

    Args:
        under_way: the training forward under way (:attr:`~.path.Path.current`), called at each layer's.
        note, replayed: the mixer's channel to activation-checkpoint replay
            (:meth:`~mixhook.hooks.LayerHook._note`, :meth:`~mixhook.hooks.LayerHook._replayed`).
    """

    def __init__(self, under_way: Callable, note: Callable, replayed: Callable):
        self._under_way, self._note, self._replayed = under_way, note, replayed
        self._saved: dict[nn.Module, list[torch.Tensor]] = {}  # running statistics before the whole call

    def register(self, model: nn.Module, handles: list[RemovableHandle]) -> None:
        """Hook every batch-norm layer of ``model`` (its forward hook first among the layer's, so that it
        runs before a wrapper's, FSDP's, puts the parameters away)."""
        for name, module in model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                key = f"batch norm {name}"
                pre = recompute.hook(self._before(key), self._again(key))
                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(self._after, prepend=True))

    def _before(self, key: str):
        """In a training forward that emitted its clean rows: a layer given the ``2B`` rows (``3B`` with a
        method's own rows) keeps its running statistics as they were before the call (the hook after it
        normalises apart)."""

        def pre(module: nn.Module, args: tuple):
            forward = self._under_way()
            mixed = None if forward is None else forward.mixed
            apart = bool(
                module.training
                and mixed is not None
                and mixed.clean
                and args
                and isinstance(args[0], torch.Tensor)
                and args[0].shape[0] == (1 + mixed.groups) * mixed.index.shape[0]
            )
            parts = 1 + mixed.groups if apart else None
            self._note(key, parts)
            if apart:
                self._keep(module, parts)

        return pre

    def _again(self, key: str):
        """In a recomputation: apart where the forward was."""

        def pre(module: nn.Module, args: tuple):
            parts = self._replayed(key)  # (the forward's groups of rows, or None: not apart)
            if parts:
                self._keep(module, parts)

        return pre

    def _keep(self, module: nn.Module, parts: int) -> None:
        self._saved[module] = (parts, [b.clone() for b in _statistics(module)])

    def _after(self, module: nn.Module, args: tuple, output):
        """The layer's output for the clean rows and each group after them (the mixed rows; a method's own
        rows before them, :attr:`~.contract.MixState.groups`) apart, its running statistics updated by
        each in turn from where they were (the whole call's result and update dropped)."""
        kept = self._saved.pop(module, None)
        if kept is None:
            return None
        parts, saved = kept
        with torch.no_grad():
            for buffer, value in zip(_statistics(module), saved, strict=True):
                buffer.copy_(value)
        return torch.cat([module.forward(rows) for rows in args[0].chunk(parts)])


def _statistics(module: nn.Module) -> list[torch.Tensor]:
    """A batch-norm layer's running statistics (none where it tracks none)."""
    names = ("running_mean", "running_var", "num_batches_tracked")
    return [b for b in (getattr(module, n, None) for n in names) if isinstance(b, torch.Tensor)]

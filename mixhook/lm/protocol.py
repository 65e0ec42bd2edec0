"""The contract of the hooks that bring a loss of their own (SFTMix, NoiseFiT), apart from the mixers'.

A mixer changes a forward and leaves the loss to the caller's criterion: ``mixer.loss(criterion, logits,
target)`` mixes the criterion's terms for the forward it mixed. A loss hook runs the forwards itself and
*is* the loss: :meth:`LossHook.loss` takes the model and the batch (``labels`` in it, ``-100`` where no
loss) and returns ``(loss, outputs)``, the outputs those of its clean forward, so a Trainer's
``compute_loss`` returns them as its own. ``counts`` makes its means a step's: :meth:`LossHook.counts` of
each micro-batch's labels, added over the step's micro-batches and processes (as the HuggingFace Trainer
counts ``num_items_in_batch``), divide its sums, so that under gradient accumulation and DDP each token
weighs the same; without them each call's means are its batch's own. ``.last`` is one :class:`LossState`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@dataclass(frozen=True)
class LossState:
    """What a loss hook's last training :meth:`~LossHook.loss` drew and computed, detached.

    Attributes:
        terms: the loss's parts by name, before their weights (SFTMix: ``ntp``, ``mixup``; NoiseFiT:
            ``ce``, ``soft``, ``consistency``); with ``counts`` given, this batch's shares of the step's
            means.
        draws: what it drew, by name (SFTMix: ``lam``, ``(B,)``; NoiseFiT: each noised block's noise scale
            in the last noisy forward, by layer).
        tokens: the tokens its means count in this batch (SFTMix: the mixed ones, each pair's for both
            its rows; NoiseFiT: the labelled ones).
    """

    terms: Mapping[str, torch.Tensor]
    draws: Mapping[str, torch.Tensor]
    tokens: torch.Tensor


@runtime_checkable
class LossHook(Protocol):
    """A hook with a loss of its own (:class:`~mixhook.SFTMix`, :class:`~mixhook.NoiseFiT`): attached as any
    hook, trained through :meth:`loss` (in a loop, or by its Trainer mixin in
    :mod:`mixhook.integrations.lm`)."""

    last: LossState | None

    def counts(self, labels: torch.Tensor) -> torch.Tensor:
        """What divides the sums of the loss of a batch of ``labels``: a 1-d tensor on their device, one
        count per mean, added over a step's micro-batches and processes before :meth:`loss` gets it."""
        ...

    def loss(
        self, model: nn.Module, inputs: Mapping[str, torch.Tensor], counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, object]:
        """The forwards of ``inputs`` and their loss: ``(loss, outputs)``, the outputs the clean forward's.
        ``counts``: the step's (:meth:`counts` added up); by default this batch's own."""
        ...

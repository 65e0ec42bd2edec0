"""Packed and padding-free batches: several sequences in one row of the batch.

Language-model fine-tuning packs short sequences into long rows (TRL's ``packing=True``) or flattens a
whole batch into one row without padding (HuggingFace's ``DataCollatorWithFlattening``, TRL's
``padding_free=True``). The model is told where each sequence starts, so that attention and rotary
positions restart there; a hook that treats a row as one sample would be wrong: a mix would blend each
row with a partner row of other sequences, at the wrong positions, and a row of one packed batch has no
partner at all. What the model is called with says it (:func:`packing`):

- the varlen keywords of flash and sdpa attention: ``cu_seq_lens_q``/``cu_seq_lens_k`` (``cu_seqlens``),
  ``max_length_q``/``max_length_k``, and Mamba-2's ``seq_idx``;
- ``position_ids`` that restart inside a row: a position no greater than the one before it, where both
  tokens are real (by the ``attention_mask``, where one is given: the positions of left or right padding
  repeat without starting a sequence).

Reading ``position_ids`` is a host sync, made only for a call that is given them (padded batches usually
are not: the model counts the positions itself).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from . import recompute
from .sites import Inputs

VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "max_length_q", "max_length_k", "seq_idx")
_TELLS = frozenset((*VARLEN, "position_ids"))


class PackedBatchError(ValueError):
    """A packed batch where a hook cannot act on packed sequences: refused, never mixed across them."""


def may_pack(module: nn.Module) -> bool:
    """Whether ``module``'s ``forward`` can be given a packed batch at all: it takes one of the arguments
    that tell packing (:data:`VARLEN`, ``position_ids``), or any keyword (``**kwargs``) or any number of
    positional arguments. Read once, where a hook is attached: a call of a module that cannot be given
    them needs no look at its arguments (:func:`packing`)."""
    forward = getattr(module.forward, "__func__", module.forward)
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return True  # (no signature to read: look at every call)
    return any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or p.name in _TELLS for p in params)


def packing(module: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """How the call of ``module`` with ``(args, kwargs)`` packs several sequences into a row (in words,
    for a message), or ``None`` where it does not."""
    found = packed(module, args, kwargs)
    return None if found is None else found[0]


def packed(module: nn.Module, args: tuple, kwargs: dict) -> tuple[str, Inputs, torch.Tensor | None] | None:
    """:func:`packing`'s words, the call's :class:`~mixhook.sites.Inputs` and, where the ``position_ids``
    told it, their :func:`restarts` (``None`` where a varlen keyword did); ``None`` for a call that does
    not pack. For a hook that goes on to read the segments (:func:`starts`), each read once."""
    if len(args) < 3 and _TELLS.isdisjoint(kwargs):  # (the usual call: tensors by keyword)
        return None
    inputs = Inputs(module, args, kwargs)
    for key in VARLEN:
        if inputs.get(key) is not None:
            return f"{key} is given", inputs, None
    found = restarts(inputs)
    return None if found is None else ("its position_ids restart inside a row", inputs, found)


def restarts(inputs: Inputs) -> torch.Tensor | None:
    """Where a new sequence starts inside a row, ``(..., T)`` booleans (the first token is not counted), or
    ``None`` where no position restarts (or no ``position_ids`` are given)."""
    positions = inputs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.ndim < 2 or positions.shape[-1] < 2:
        return None
    if positions.is_floating_point():
        return None
    starts = torch.zeros_like(positions, dtype=torch.bool)
    starts[..., 1:] = positions[..., 1:] <= positions[..., :-1]
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[-1] == positions.shape[-1]:
        real = mask.to(positions.device) != 0
        starts[..., 1:] &= real[..., 1:] & real[..., :-1]
    return starts if bool(starts.any()) else None


def starts(inputs: Inputs, found: torch.Tensor | None = None) -> torch.Tensor | None:
    """Where each packed sequence starts in its row, ``(rows, T)`` booleans: from the ``position_ids``
    (``found``: their :func:`restarts`, where read already), ``seq_idx`` or ``cu_seq_lens_q`` (one row)."""
    found = found if found is not None else restarts(inputs)
    if found is not None:
        return found
    seq_idx = inputs.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor) and seq_idx.ndim == 2:
        found = torch.zeros_like(seq_idx, dtype=torch.bool)
        found[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
        return found
    cumulative = inputs.get("cu_seq_lens_q")
    if cumulative is None:
        cumulative = inputs.get("cu_seqlens")
    if isinstance(cumulative, torch.Tensor) and cumulative.ndim == 1:
        total = int(cumulative[-1])
        found = torch.zeros(1, total, dtype=torch.bool, device=cumulative.device)
        inner = cumulative[1:-1].long()
        found[0, inner[inner < total]] = True
        return found
    return None


PARTNERS = "a row's partner would be other sequences"  # what a mix of a packed batch would do


def refuse(kind: str, module: nn.Module, args: tuple, kwargs: dict, why: str = PARTNERS) -> None:
    """Refuse, in one line, a packed batch given to ``module`` under a hook of ``kind`` that treats a row
    as one sample (``why``: what would go wrong)."""
    how = packing(module, args, kwargs)
    if how is not None:
        raise PackedBatchError(
            f"{kind}: the batch given to {type(module).__name__} is packed ({how}: several sequences share "
            f"a row), so {why}; train on padded batches (HuggingFace: DataCollatorWithPadding, not "
            "DataCollatorWithFlattening; TRL: packing=False, padding_free=False)"
        )


def refusing(kind: str, why: str, with_grad: bool):
    """A forward pre-hook for the model (``with_kwargs=True``) that refuses a packed batch in the forwards
    where a per-sample hook of ``kind`` acts: training forwards (``with_grad``: with gradients only), not
    an activation-checkpoint recomputation."""

    def check(model: nn.Module, args: tuple, kwargs: dict) -> None:
        if model.training and (torch.is_grad_enabled() or not with_grad):
            refuse(kind, model, args, kwargs, why)

    return recompute.hook(check)  # (a recomputation was checked as its forward)

"""The token helpers the language-model hooks share: a model's logits and its labels (``IGNORE``), each
position's next-token loss, the weighted one that SFTMix's loss runs over the clean and mixed logits with
its gradient made in the forward, and the one ``(B, L, d)`` tensor of a layer's output and its putting back.
No hook's module imports from another's: what two of them use is here."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ..sites import batch_leaves, describe, replace_leaves

IGNORE = -100  # the labels' mark of a position without a loss (PyTorch's ignore_index)


def logits_of(out) -> torch.Tensor:
    """The logits of a model's output: ``.logits``, ``["logits"]``, the first of a tuple, or the tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        return out["logits"]
    if hasattr(out, "logits"):
        return out.logits
    return out[0]


def next_labels(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target, ``(B, T)``: the label at ``t + 1`` (a causal model's logits at ``t`` predict
    it), ``-100`` at the last position. The labels are moved, not the logits: no copy of the ``(B, T, V)``
    logits is made to score them, as the HuggingFace causal LM loss does."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def predicted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many labelled tokens a causal model predicts (all but one at position 0, which no token
    precedes): the count a next-token loss's mean divides by, 0-d on the labels' device."""
    return (labels[:, 1:] != IGNORE).sum()


def next_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of each position's prediction of the next label (a causal model's: position
    ``t``'s logits predict label ``t + 1``), ``(B, T - 1)``, 0 where that label is ``-100``; half-precision
    logits in float32: the perplexity of :mod:`.confidence`, and SFTMix's evaluation loss."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    flat = F.cross_entropy(
        logits.flatten(0, 1), next_labels(labels).flatten(), ignore_index=IGNORE, reduction="none"
    )
    return flat.view(labels.shape[0], -1)[:, :-1]


CHUNK = 1 << 22  # token_losses' working set: rows of logits of at most this many numbers at a time


class _TokenLosses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, weights):
        rows, vocab = logits.shape
        wide = torch.promote_types(logits.dtype, torch.float32)
        losses = logits.new_empty(rows, dtype=wide)
        grad = torch.empty_like(logits)
        step = max(1, CHUNK // max(1, vocab))
        for start in range(0, rows, step):
            z = logits[start : start + step].to(wide)
            y, w = targets[start : start + step], weights[start : start + step].to(wide)
            total = w.sum(-1)
            used = total != 0  # (a position without a target: selected out, whatever its logits hold)
            lse = torch.logsumexp(z, -1)
            losses[start : start + step] = torch.where(used, total * lse - (w * z.gather(-1, y)).sum(-1), 0)
            g = torch.softmax(z, -1).mul_(total[:, None]).scatter_add_(-1, y, -w)
            grad[start : start + step] = g.masked_fill_(~used[:, None], 0)
        ctx.save_for_backward(grad)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        if torch.is_grad_enabled():  # (a backward with create_graph: its second order would be lost)
            raise RuntimeError(
                "SFTMix's loss has no second derivative (its gradient is computed in the forward): "
                "differentiate it without create_graph=True"
            )
        (grad,) = ctx.saved_tensors
        return grad * grad_losses[:, None].to(grad.dtype), None, None


def token_losses(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``-sum_k weights[:, k] * log_softmax(logits)[targets[:, k]]`` for each row of ``logits`` ``(R, V)``
    (``targets`` ``(R, K)`` ids, ``weights`` ``(R, K)``; a row whose weights are all 0 is 0, whatever its
    logits hold): ``(R,)``, in float32 at least. The gradient of the logits is computed in the forward, a
    chunk of rows at a time, and kept in the logits' dtype for the backward: no log-softmax of the
    ``(R, V)`` logits, nor a float32 copy of bf16 ones, is kept, so a step holds about two copies of the
    logits where a cross-entropy holds three (Liger-Kernel's cross-entropy does the same). Its gradient is
    not differentiable again: a backward with ``create_graph=True`` is refused in one line."""
    return _TokenLosses.apply(logits, targets, weights)


def sequence_of(output, site, dims, where: str, hint: str) -> tuple:
    """The one ``(B, L, d)`` tensor of a layer's ``output`` (its leaf, and the tensor batch first), or a
    one-line ``TypeError`` (``where``: the hook and layer; ``hint``: what to name instead)."""
    found, _ = batch_leaves(output, site, dims, where.split(" ")[0])
    if len(found) != 1 or found[0].tensor.ndim != 3:
        raise TypeError(f"{where}: the layer returned {describe(output)}; {hint}")
    leaf = found[0]
    return leaf, (leaf.tensor if leaf.dim == 0 else leaf.tensor.movedim(leaf.dim, 0))


def put_back(output, leaf, h: torch.Tensor):
    """``output`` with ``leaf``'s tensor replaced by ``h`` (batch first, as :func:`sequence_of` gave it)."""
    if leaf.dim != 0:
        h = h.movedim(0, leaf.dim)
    return h if leaf.path == () else replace_leaves(output, {leaf.path: h})

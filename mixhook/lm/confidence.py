"""SFTMix's data side: each example's confidence from a reference run, the split into a confident and a
relatively unconfident half, and batches that pair them.

Paper: Xiao, Zhang, Zhou, Ghassemi, Zhao. "SFTMix: Elevating Language Model Instruction Tuning with Mixup
Recipe." ACL 2026. https://arxiv.org/abs/2410.05248 (no code is public; docs/language-models.md gives the
method as far as it is known). A reference model is fine-tuned with plain next-token prediction on the
same data, saving ``C`` checkpoints (:class:`~mixhook.integrations.lm.ReferenceCheckpoints`);
each example's confidence is the negative mean, over the checkpoints, of the perplexity of its response
given its instruction (:func:`confidence`); the examples are split at the median (:func:`split`); and
each training batch holds as many of each half, each confident example paired with an unconfident one at
random (:class:`PairedSampler`).

An example is a mapping with ``input_ids`` and which of its tokens are the response: ``completion_mask``
(TRL's prompt-completion rows), ``assistant_masks`` (TRL's conversations with ``assistant_only_loss``) or
``labels`` (``-100`` where there is no loss), as a data set row or a plain dict. Every response token
counts (a conversation's every assistant turn). The library's core imports torch only: this module too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import Sampler

from .tokens import IGNORE, logits_of, next_token_losses

MASKS = ("completion_mask", "assistant_masks")


def response_mask(row: Mapping, i: int = 0) -> tuple[list[int], list[bool]]:
    """Example ``i``'s token ids and, for each token, whether it is a response token (one line where the
    example says neither, marks a different number of tokens, or is padded: an ``attention_mask`` with
    zeros, whose pads would be scored as text)."""
    ids = row.get("input_ids") if isinstance(row, Mapping) else None
    if ids is None:
        keys = sorted(row) if isinstance(row, Mapping) else row
        raise KeyError(f"example {i} needs input_ids, got {keys!r}")
    ids = [int(t) for t in _listed(ids)]
    attention = row.get("attention_mask")
    if attention is not None and not all(_listed(attention)):
        raise ValueError(f"example {i} is padded (its attention_mask has zeros): give it unpadded")
    for key in MASKS:
        if row.get(key) is not None:
            mask = [bool(m) for m in _listed(row[key])]
            break
    else:
        if row.get("labels") is None:
            raise KeyError(
                f"example {i} needs its response tokens marked: one of {', '.join(MASKS)} or labels (-100 "
                f"elsewhere); got the keys {sorted(row)}"
            )
        key, mask = "labels", [int(t) != IGNORE for t in _listed(row["labels"])]
    if len(mask) != len(ids):
        raise ValueError(f"example {i}: {key} marks {len(mask)} tokens, its input_ids has {len(ids)}")
    return ids, mask


def _listed(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def _predicted(mask: list[bool]) -> list[bool]:
    """The response tokens a causal model predicts: all but one at position 0 (no token before it)."""
    return [False, *mask[1:]]


@torch.no_grad()
def response_perplexity(
    model: nn.Module, examples: Sequence[Mapping], batch_size: int = 8, pad_id: int = 0
) -> torch.Tensor:
    """The perplexity of each example's response given what precedes it, ``exp`` of the mean negative
    log-likelihood of its response tokens (position ``t``'s logits predict token ``t + 1``), under
    ``model`` (a causal language model returning ``.logits`` or logits) in eval mode and its own dtype:
    ``(N,)`` float64. Batched ``batch_size`` at a time, the examples ordered by length (padded on the right
    with ``pad_id`` under an attention mask), and returned in their own order. An example without a
    response token is refused in one line."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"response_perplexity: batch_size must be an int >= 1, got {batch_size!r}")
    rows = [response_mask(row, i) for i, row in enumerate(examples)]
    for i, (_, mask) in enumerate(rows):
        if not any(_predicted(mask)):
            raise ValueError(f"example {i} has no response token after its first position: nothing to score")
    device = next(model.parameters()).device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    means = []  # (each batch's, on the device: one copy to the host at the end, no sync per batch)
    modes = [(m, m.training) for m in model.modules()]  # (each module's own mode, given back after)
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            chosen = order[start : start + batch_size]
            length = max(len(rows[i][0]) for i in chosen)
            ids = torch.full((len(chosen), length), pad_id, dtype=torch.long)
            attention = torch.zeros((len(chosen), length), dtype=torch.long)
            scored = torch.zeros((len(chosen), length), dtype=torch.bool)
            for k, i in enumerate(chosen):
                tokens, mask = rows[i]
                ids[k, : len(tokens)] = torch.tensor(tokens)
                attention[k, : len(tokens)] = 1
                scored[k, : len(tokens)] = torch.tensor(_predicted(mask))
            ids, attention, scored = ids.to(device), attention.to(device), scored.to(device)
            logits = logits_of(model(input_ids=ids, attention_mask=attention))
            nll = next_token_losses(logits, torch.where(scored, ids, IGNORE)).double()
            means.append(nll.sum(1) / scored[:, 1:].sum(1))
    finally:
        for module, training in modes:
            module.training = training
    out = torch.empty(len(rows), dtype=torch.float64)
    if means:
        out[torch.tensor(order, dtype=torch.long)] = torch.cat(means).exp().cpu()
    return out


def confidence(
    models: Iterable[nn.Module | Callable[[], nn.Module]],
    examples: Sequence[Mapping],
    batch_size: int = 8,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SFTMix's confidence of each example: ``-mean_c Perp_c(response | instruction)`` over the reference
    checkpoints ``models`` (each a model, or a function that loads one: loaded one at a time, and let go
    before the next), ``(N,)`` float64; and the perplexities ``(C, N)``."""
    perplexities = []
    for model in models:
        net = model() if callable(model) and not isinstance(model, nn.Module) else model
        perplexities.append(response_perplexity(net, examples, batch_size, pad_id))
        del net
    if not perplexities:
        raise ValueError("confidence: no reference checkpoint given")
    stacked = torch.stack(perplexities)
    return -stacked.mean(0), stacked


def split(confidence: torch.Tensor) -> torch.Tensor:
    """The confident half: ``True`` for the ``N // 2`` examples of highest confidence (the median split;
    equal confidences by their order, the earlier first), ``False`` for the others (one more of them where
    ``N`` is odd)."""
    confidence = torch.as_tensor(confidence)
    if confidence.ndim != 1:
        raise ValueError(f"split: one confidence per example, got the shape {tuple(confidence.shape)}")
    bad = (~torch.isfinite(confidence)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"split: the confidence of examples {bad[:8]} is not finite")
    order = torch.sort(confidence, descending=True, stable=True).indices
    confident = torch.zeros(confidence.shape[0], dtype=torch.bool)
    confident[order[: confidence.shape[0] // 2]] = True
    return confident


class PairedSampler(Sampler[int]):
    """The examples' indices in batches of ``batch_size``, each its first half confident examples and its
    second half unconfident ones, row ``k`` paired with row ``k + batch_size // 2`` (SFTMix's pairs: each
    confident example with an unconfident one at random). Each epoch shuffles each half anew from
    ``seed`` and the epoch (``set_epoch``, which the HuggingFace Trainer and accelerate call), so a
    resumed epoch draws the batches of the uninterrupted one; a batch per step under DDP (accelerate hands
    each process whole batches in turn); an epoch ends when either half has too few examples left for a
    batch (those left wait for a later epoch's shuffle).

    Args:
        confident: one flag per example (:func:`split`'s).
        batch_size: the rows per batch (per device), even, at least 2.
        seed: the shuffles' seed.
    """

    def __init__(self, confident: Sequence[bool] | torch.Tensor, batch_size: int, seed: int = 0):
        flags = torch.as_tensor(list(confident) if not isinstance(confident, torch.Tensor) else confident)
        if flags.ndim != 1 or flags.dtype != torch.bool:
            raise ValueError("PairedSampler: confident must be one True/False flag per example")
        if (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, int)
            or batch_size < 2
            or batch_size % 2
        ):
            raise ValueError(
                "PairedSampler: batch_size must be even and at least 2 (half confident, half not), "
                f"got {batch_size!r}"
            )
        self.confident = flags.nonzero().flatten()
        self.unconfident = (~flags).nonzero().flatten()
        self.batch_size, self.seed, self.epoch = batch_size, int(seed), 0
        if len(self) == 0:
            raise ValueError(
                f"PairedSampler: {len(self.confident)} confident and {len(self.unconfident)} unconfident "
                f"examples make no batch of {batch_size} (half of each)"
            )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def batches(self) -> int:
        """The batches of an epoch."""
        return min(len(self.confident), len(self.unconfident)) // (self.batch_size // 2)

    def __len__(self) -> int:
        return self.batches() * self.batch_size

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        half = self.batch_size // 2
        confident = self.confident[torch.randperm(len(self.confident), generator=g, device=g.device)]
        unconfident = self.unconfident[torch.randperm(len(self.unconfident), generator=g, device=g.device)]
        for b in range(self.batches()):
            yield from confident[b * half : (b + 1) * half].tolist()
            yield from unconfident[b * half : (b + 1) * half].tolist()

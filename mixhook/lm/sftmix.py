"""SFTMix: confident and relatively unconfident examples paired in each batch, their last hidden states mixed
position by position from their responses' first tokens, and a mixup loss beside next-token prediction.

Paper: Xiao, Zhang, Zhou, Ghassemi, Zhao. "SFTMix: Elevating Language Model Instruction Tuning with Mixup
Recipe." ACL 2026. https://arxiv.org/abs/2410.05248. No code is public; the method as far as it is known (from
a detailed paper note and the public reviews: the paper's own method section could not be checked), and the
readings chosen where no source says, are in docs/language-models.md. Its data side (the reference run, the
confidence, the split and the paired batches) is :mod:`mixhook.lm.confidence`; this module is the mix and
its loss.

For the pairs ``(c, u)`` of a batch (rows ``k`` and ``k + B // 2``, as
:class:`~mixhook.lm.confidence.PairedSampler` makes them) and ``lam ~ Beta(alpha, alpha)``, at the input of
the LM head (a decoder's final norm's output)::

    Z~_n = lam * Z^c_n + (1 - lam) * Z^u_n,   n < min(N^c, N^u)
    l = l_NTP + mu * mean_n [lam * CE(W Z~_n, y^c_n) + (1 - lam) * CE(W Z~_n, y^u_n)]

``Z_n`` the state that predicts response token ``n`` (``y_n``, counted from the response's first labelled
token; a causal model's state at the position before it), ``l_NTP`` the usual mean cross-entropy of the
labelled tokens of every example. The LM head runs once on the clean rows and on each pair's mixed row (the
mix of ``(u, c)`` with ``1 - lam`` is the same state and its loss the same terms: computed once, counted for
both rows); one softmax of each mixed position serves both its targets, and the logits' gradient is
computed in the forward (:func:`token_losses`), so that a step holds about as much as plain fine-tuning's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import recompute
from ..engine.card import HookCard
from ..engine.checks import check_non_negative, check_positive
from ..functional import sample_beta
from ..hooks import LayerHook
from ..packing import PackedBatchError, packing
from .protocol import LossState
from .tokens import (
    IGNORE,
    logits_of,
    next_labels,
    next_token_losses,
    predicted_tokens,
    put_back,
    sequence_of,
    token_losses,
)

LAMS = ("pair", "batch")
REDUCES = ("token", "sequence")
RESPONSES = ("all", "first", "last")


@dataclass(frozen=True)
class Plan:
    """One :meth:`SFTMix.loss` call's mix, made before its forward from the batch's labels (device tensors;
    an activation-checkpoint recomputation mixes by it again): the batch's ``labels`` ``(B, T)``; each row's
    partner ``index`` ``(B,)``; for each row's slots ``n`` (``(B, T)`` each), the positions of its own and
    its partner's states (``own``, ``other``), whether the slot is mixed (``valid``), the targets there
    (``own_y``, ``partner_y``, ``-100`` elsewhere, at the targets' positions); and ``lam`` ``(B,)``,
    float64, ``1 - lam`` for a row's partner."""

    labels: torch.Tensor
    index: torch.Tensor
    own: torch.Tensor
    other: torch.Tensor
    valid: torch.Tensor
    own_y: torch.Tensor
    partner_y: torch.Tensor
    lam: torch.Tensor


def partners(n: int, device=None) -> torch.Tensor:
    """Row ``k``'s partner: ``k + n // 2`` for the first half, ``k - n // 2`` for the second."""
    return torch.arange(n, device=device).roll(n // 2)


def response_positions(labels: torch.Tensor, response: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's labelled positions in order, then the others (``(B, T)``, a permutation per row), and how
    many are labelled (``(B,)``); a label at position 0, which no token predicts, is not counted.
    ``response``: every labelled token (``"all"``), or the first or last run of them (a conversation's first
    or last answer). Device ops only."""
    mask = labels != IGNORE
    mask[:, 0] = False
    if response != "all":
        starts = mask & ~F.pad(mask[:, :-1], (1, 0))
        span = starts.cumsum(1)
        chosen = torch.ones_like(span) if response == "first" else span.amax(1, keepdim=True)
        mask = mask & (span == chosen)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    return order, mask.sum(1)


class SFTMix(LayerHook):
    """SFTMix (Xiao et al. 2026) at the input of a causal language model's LM head: the hook and its loss.

    Attach it to the module whose output the LM head takes (``"model.norm"`` of a Llama, Qwen2, Mistral or
    Gemma; ``"transformer.ln_f"`` of GPT-2). :meth:`loss` runs one forward of the batch, in which that
    module's ``(B, T, D)`` output is followed by ``B // 2`` mixed rows, one per pair (row ``k`` and its
    partner ``k + B // 2``, :func:`partners`: ``lam`` for the one and ``1 - lam`` for the other, the pair's
    mix and its loss the same from either side, so each is computed once and counted for both rows), and
    returns ``l_NTP + mu * l_mixup`` and the forward's outputs with the clean rows' logits::

        mix = SFTMix("model.norm")
        with mix.attach(model):
            loss, outputs = mix.loss(model, batch)  # batch: input_ids, attention_mask, labels (-100)
            loss.backward()

    The batch's rows are paired ``k`` with ``k + B // 2``: feed it
    :class:`~mixhook.lm.confidence.PairedSampler`'s batches (confident rows first) so that the pairs are
    SFTMix's; an odd batch is refused. Outside :meth:`loss` the hook does nothing (an evaluation forward,
    generation), and in an evaluation (the model in eval mode, or no gradients) :meth:`loss` is the plain
    ``l_NTP``. A packed batch (several sequences in a row) is refused in one line, as is a batch whose
    labels are missing. Inside activation checkpointing the recomputation mixes the same rows again.

    The points no source states are arguments, each with the reading chosen as default (see
    docs/language-models.md): ``lam`` per pair (``"pair"``) or one per batch (``"batch"``: one per call of
    :meth:`loss`, so one per micro-batch and process, not one per optimizer step); the mixup loss
    averaged per mixed token (``"token"``) or per sequence (``"sequence"``: each pair's mean, then their
    mean); gradients through the mixed states into the body (``detach=False``) or not; which answer of a
    conversation is mixed (``response``: ``"all"`` labelled tokens in order, the ``"first"`` or ``"last"``
    run of them). ``l_NTP`` is the mean cross-entropy of the batch's labelled tokens (the model's own loss),
    ``l_mixup`` the mean over its mixed tokens; under gradient accumulation and DDP the means are the
    step's (``counts=``, :meth:`counts` added over the step's micro-batches and processes: the trainer
    mixin does it as the Trainer counts ``num_items_in_batch``), so that with ``mu=0`` SFTMix trains as
    the Trainer's own loss does. A batch with no token to mix has ``l_mixup = 0``. The mix is computed in
    float32 at least (float64 states in float64) with the lam the label weights use, then cast to the
    states' dtype: under bf16 the mix and its targets weigh by the same lam; the slots a pair does not mix
    are selected out, not multiplied by 0 (a non-finite state there spreads nothing).

    ``.last``: a :class:`~mixhook.lm.protocol.LossState` (the contract of the hooks with a loss of their
    own): ``draws["lam"]`` (``(B,)``), ``tokens`` (the mixed tokens, each pair's for both its rows) and the
    two terms of the loss, detached (``terms["ntp"]`` and ``terms["mixup"]``: with ``counts`` given, this
    batch's shares of the step's means).

    Args:
        layer: the LM head's input (one module).
        alpha: ``lam ~ Beta(alpha, alpha)`` (the paper: 0.5).
        mu: the mixup loss's weight (the paper: 0.2).
        lam, reduce, detach, response: see above.
        generator: as :class:`~mixhook.ManifoldMixup`.
    """

    card = HookCard(
        signature='SFTMix(layer, alpha=0.5, mu=0.2, lam="pair", reduce="token")',
        hook="a forward hook at the LM head's input (the final norm), in the one forward of `mix.loss`",
        formula=(
            "each pair's (rows `k`, `k + B/2`) response states `lam·Z^c_n + (1-lam)·Z^u_n` from their first "
            "labelled tokens; loss `l_NTP + mu·mean[lam·CE(y^c_n) + (1-lam)·CE(y^u_n)]`"
        ),
        paper="Xiao et al. 2026",
        commands=(
            "none yet: [Language models](language-models.md#sftmix-confidence-from-a-reference-run-paired-"
            "batches-and-the-mix)"
        ),
        members="loss, counts",
        example={"layer": "model.norm"},
        trainer=("SFTMixLoss", "PairedBatches"),
    )

    _TRANSIENT = ("_plan",)

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 0.5,
        mu: float = 0.2,
        lam: str = "pair",
        reduce: str = "token",
        detach: bool = False,
        response: str = "all",
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
    ):
        super().__init__(layer, batch_dim)
        self.alpha, self.mu = check_positive("alpha", alpha), check_non_negative("mu", mu)
        for name, value, choices in (
            ("lam", lam, LAMS),
            ("reduce", reduce, REDUCES),
            ("response", response, RESPONSES),
        ):
            if value not in choices:
                raise ValueError(f"SFTMix: {name} must be one of {', '.join(choices)}, got {value!r}")
        self.lam, self.reduce, self.detach, self.response = lam, reduce, bool(detach), response
        self._draw_from(generator)
        self.last: LossState | None = None

    def _fresh(self) -> None:
        super()._fresh()
        self._plan = None

    def __repr__(self) -> str:
        return (
            f"SFTMix(layer={self._layer_spec!r}, alpha={self.alpha}, mu={self.mu}, lam={self.lam!r}, "
            f"reduce={self.reduce!r}, detach={self.detach}, response={self.response!r})"
        )

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        if len(modules) != 1:
            raise ValueError(f"SFTMix mixes at one layer, the LM head's input; got {sorted(modules)}")
        for spec, module in modules.items():
            handles.append(module.register_forward_hook(recompute.hook(self._hook(spec), self._again(spec))))

    def _hook(self, spec: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output):
            plan = self._plan
            self._note(spec, plan)  # (an activation-checkpoint recomputation mixes the same again)
            return None if plan is None else self._with_mixed(spec, output, plan)

        return hook

    def _again(self, spec: str) -> Callable:
        def again(module: nn.Module, args: tuple, output):
            plan = self._replayed(spec)
            return None if plan is None else self._with_mixed(spec, output, plan)

        return again

    def _with_mixed(self, spec: str, output, plan: Plan):
        """``output`` with its ``(B, T, D)`` tensor followed by the ``B // 2`` mixed rows."""
        leaf, h = sequence_of(
            output, self.sites[spec], self._dims[spec], f"SFTMix at {spec!r}",
            "SFTMix mixes the (B, T, D) input of the LM head: name the final norm",
        )  # fmt: skip
        if h.shape[:2] != plan.labels.shape:
            raise ValueError(
                f"SFTMix at {spec!r}: its output has {tuple(h.shape[:2])} rows and positions, the batch's "
                f"labels {tuple(plan.labels.shape)}"
            )
        return put_back(output, leaf, torch.cat([h, self._mixed(h, plan)]))

    def _mixed(self, h: torch.Tensor, plan: Plan) -> torch.Tensor:
        """The ``B // 2`` mixed rows, one per pair: row ``i``'s slot ``n`` (``i < B // 2``) at the position
        before its ``n``-th response token, ``lam_i * h_i + (1 - lam_i) * h_p`` of the states before their
        ``n``-th ones, computed in float32 at least and cast to ``h``'s dtype; zeros elsewhere."""
        source = h.detach() if self.detach else h
        half = h.shape[0] // 2
        own, other, valid = plan.own[:half], plan.other[:half], plan.valid[:half]
        d = h.shape[-1]
        wide = torch.promote_types(h.dtype, torch.float32)
        lam = plan.lam[:half].to(wide)[:, None, None]
        mine = source[:half].gather(1, own[..., None].expand(-1, -1, d)).to(wide)
        theirs = source[half:].gather(1, other[..., None].expand(-1, -1, d)).to(wide)
        blend = torch.where(valid[..., None], lam * mine + (1 - lam) * theirs, 0).to(h.dtype)
        return h.new_zeros((half, *h.shape[1:])).scatter_add(1, own[..., None].expand(-1, -1, d), blend)

    def _planned(self, labels: torch.Tensor) -> Plan:
        """The pairs, their lams (from the hook's generator) and the aligned positions and targets."""
        n, length = labels.shape
        index, positions, slots = self._aligned(labels)
        valid = torch.arange(length, device=labels.device)[None] < slots[:, None]
        own = (positions - 1).clamp(min=0)
        other = (positions[index] - 1).clamp(min=0)
        targets = torch.full_like(labels, IGNORE)
        own_y = targets.scatter(1, positions, torch.where(valid, labels.gather(1, positions), IGNORE))
        partner_y = targets.scatter(
            1, positions, torch.where(valid, labels[index].gather(1, positions[index]), IGNORE)
        )
        self._seed_for_rank()
        half = n // 2
        first = sample_beta(self.alpha, self.alpha, self.generator, None if self.lam == "batch" else half)
        first = first.expand(half) if first.ndim == 0 else first
        lam = torch.cat([first, 1 - first]).to(labels.device, torch.float64)
        return Plan(labels, index, own, other, valid, own_y, partner_y, lam)

    def _aligned(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's partner, its response positions in order (:func:`response_positions`) and its slots:
        how many of them are mixed (the shorter of its and its partner's responses)."""
        index = partners(labels.shape[0], labels.device)
        positions, each = response_positions(labels, self.response)
        return index, positions, torch.minimum(each, each[index])

    def counts(self, labels: torch.Tensor) -> torch.Tensor:
        """What divides the two sums of the loss of a batch of ``labels``, ``(2,)`` on their device: its
        labelled tokens (``l_NTP``'s) and its mixed tokens (``l_mixup``'s, each pair's counted twice; with
        ``reduce="sequence"``, its rows with a token to mix). A trainer adds them over a step's micro-batches
        and processes and hands the sums to :meth:`loss` (``counts=``), so that the step's loss is its
        tokens' mean, as the Trainer's own causal LM loss is (``num_items_in_batch``)."""
        _, _, slots = self._aligned(labels)
        mixed = slots.sum() if self.reduce == "token" else (slots > 0).sum()
        return torch.stack([predicted_tokens(labels), mixed])

    def loss(
        self, model: nn.Module, inputs: Mapping[str, torch.Tensor], counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, object]:
        """One forward of ``inputs`` (``labels`` taken out, ``-100`` where there is no loss) with the mixed
        rows after the clean ones; ``l_NTP + mu * l_mixup`` and the outputs, their logits the clean rows'.
        ``counts``: the divisors of the two sums (:meth:`counts`, added over a step's batches); by default
        this batch's own, so that each term is its mean."""
        if self._model is None:
            raise RuntimeError("SFTMix.loss(): attach the hook to the model first (mix.attach(model))")
        labels = inputs.get("labels")
        if not isinstance(labels, torch.Tensor) or labels.ndim != 2 or labels.is_floating_point():
            raise ValueError(
                "SFTMix.loss(): the inputs need labels, (B, T) token ids with -100 where no loss"
            )
        rest = {k: v for k, v in inputs.items() if k != "labels"}
        packed = packing(model, (), rest)
        if packed is not None:
            raise PackedBatchError(
                f"SFTMix.loss(): a packed batch ({packed}); it pairs whole rows, so give it padded batches "
                "(TRL: packing=False, padding_free=False)"
            )
        if counts is not None and (not isinstance(counts, torch.Tensor) or counts.shape != (2,)):
            raise ValueError(
                f"SFTMix.loss(): counts must be a (2,) tensor (SFTMix.counts), got {counts!r:.80}"
            )
        ntp_count, mixed_count = (None, None) if counts is None else counts
        n = labels.shape[0]
        if not (model.training and torch.is_grad_enabled()):  # (an evaluation: the plain loss)
            outputs = model(**rest)
            return _ntp(logits_of(outputs), labels, ntp_count), outputs
        if n < 2 or n % 2:
            raise ValueError(
                f"SFTMix.loss(): a batch of {n} rows; it pairs row k with row k + B/2, so it needs an even "
                "batch (PairedSampler's)"
            )
        self._plan = self._planned(labels)
        try:
            outputs = model(**rest)
        finally:
            plan, self._plan = self._plan, None
        logits = logits_of(outputs)
        if logits.shape[0] != n + n // 2:
            raise RuntimeError(
                f"SFTMix.loss(): the forward gave {logits.shape[0]} rows of logits, not the {n + n // 2} of "
                "the clean and mixed rows: the hooked layer did not run in it, or the model did not keep its "
                "rows"
            )
        if logits.shape[1] != labels.shape[1]:
            raise ValueError(
                f"SFTMix.loss(): the logits cover {logits.shape[1]} positions, the labels {labels.shape[1]}; "
                "leave logits_to_keep unset (every position's prediction is needed)"
            )
        losses, slots = self._losses(logits, labels, plan)
        labelled = predicted_tokens(labels) if ntp_count is None else ntp_count
        ntp = losses[:n].sum() / labelled.clamp(min=1)
        mix, tokens = self._mixup(losses[n:], slots, mixed_count)
        total = ntp + self.mu * mix
        self.last = LossState({"ntp": ntp.detach(), "mixup": mix.detach()}, {"lam": plan.lam}, tokens)
        return total, _clean_rows(outputs, n, n + n // 2)

    def _losses(self, logits: torch.Tensor, labels: torch.Tensor, plan: Plan):
        """Each position's loss, ``(B + B // 2, T)``, 0 where none: a clean row's cross-entropy of its next
        label, a pair's ``lam * CE(y^c) + (1 - lam) * CE(y^u)``; in one :func:`token_losses` over the clean
        and mixed logits together (one softmax of each position serving both of a pair's targets); and the
        pairs' slots, ``(B // 2, T)``."""
        n, length = labels.shape
        half = n // 2
        wide = torch.promote_types(logits.dtype, torch.float32)
        clean, own = next_labels(labels), next_labels(plan.own_y[:half])
        partner = next_labels(plan.partner_y[:half])
        slots = own != IGNORE
        lam = plan.lam[:half].to(wide)[:, None].expand(-1, length)
        labelled = (clean != IGNORE).to(wide)
        targets = torch.cat([torch.stack([clean, clean], -1), torch.stack([own, partner], -1)]).clamp(min=0)
        weights = torch.cat([
            torch.stack([labelled, torch.zeros_like(labelled)], -1),
            torch.stack([torch.where(slots, lam, 0), torch.where(slots, 1 - lam, 0)], -1),
        ])  # fmt: skip
        each = token_losses(logits.flatten(0, 1), targets.flatten(0, 1), weights.flatten(0, 1))
        return each.view(n + half, length), slots

    def _mixup(
        self, each: torch.Tensor, slots: torch.Tensor, count=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``l_mixup`` from the pairs' losses (``(B // 2, T)``, 0 where no slot), each pair's terms counted
        for both its rows, as the mean over the ``B`` rows counts them; and the mixed tokens (each pair's
        twice)."""
        per_row = slots.sum(1)
        tokens = 2 * per_row.sum()
        if self.reduce == "token":
            return 2 * each.sum() / (tokens if count is None else count).clamp(min=1), tokens
        rows = 2 * (per_row > 0).sum()
        means = each.sum(1) / per_row.clamp(min=1)
        return 2 * means.sum() / (rows if count is None else count).clamp(min=1), tokens


def _clean_rows(outputs, n: int, rows: int):
    """The forward's outputs with every tensor of the ``rows`` clean and mixed rows cut to the ``n`` clean
    ones (the logits, the last hidden states), in a mapping (a ``ModelOutput``, changed in place) or a
    tuple."""

    def cut(value):
        if isinstance(value, torch.Tensor):
            return value[:n] if value.ndim and value.shape[0] == rows else value
        if isinstance(value, tuple):
            return tuple(cut(v) for v in value)
        return value

    if isinstance(outputs, Mapping):
        for key in list(outputs.keys()):
            outputs[key] = cut(outputs[key])
        return outputs
    return cut(outputs)


def _ntp(logits: torch.Tensor, labels: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
    """``l_NTP``: the cross-entropy of the batch's labelled tokens summed, divided by ``count`` (by default
    their number: the model's own loss)."""
    count = predicted_tokens(labels) if count is None else count
    return next_token_losses(logits, labels).sum() / count.clamp(min=1)

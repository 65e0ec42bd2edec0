"""Targets under a mix: which labels are class indices in range, and a dense target's per-position weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..functional import per_sample, positions, smooth_one_hot
from ..transfer import to_device
from . import partners
from .contract import MixState
from .policies import Policies


def _at_least_float32(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` in float32 where it is of a lower precision (bfloat16, float16), else as it is."""
    return loss if loss.dtype in (torch.float32, torch.float64) else loss.float()


def check_classes(target: torch.Tensor, num_classes: int) -> None:
    """Refuse class indices outside ``[0, num_classes)``: in one line for labels on the CPU; on a GPU as
    a device-side assertion (reading the labels on the host would stall every step until the GPU is
    idle), which fails the step loudly at the next synchronisation."""
    if not target.numel():
        return
    if target.device.type != "cpu":
        inside = ((target >= 0) & (target < num_classes)).all()
        torch._assert_async(inside, f"targets(): class indices must lie in [0, {num_classes})")
        return
    low, high = (int(v) for v in torch.aminmax(target))
    if low < 0 or high >= num_classes:
        ignore = (
            " (a dense map's ignore label, e.g. 255, has no probability: use loss() with a criterion "
            "that ignores it)"
            if target.ndim > 1
            else ""
        )
        raise ValueError(
            f"targets(): class indices must lie in [0, {num_classes}), got values from {low} to "
            f"{high}{ignore}"
        )


_DENSE = {
    1: ("(B, L)", "(B, K, L)"),
    2: ("(B, H, W)", "(B, K, H, W)"),
    3: ("(B, D, H, W)", "(B, K, D, H, W)"),
}


def dense_weights(last: MixState, target: torch.Tensor, what: str, kind: str) -> torch.Tensor | None:
    """The own-content weight of each position of a dense ``target`` under the region mix ``last``:
    ``last.weights`` resized to the target's ``(H, W)`` by area (each label pixel gets the fraction of
    its area that kept the sample's own content: exact for a mask cut at the input's resolution, and a
    feature map's cells cover whole blocks of label pixels), as ``(B, H, W)`` float64. Dense targets are
    integer maps ``(B, H, W)`` or floating ``(B, K, H, W)`` (under a mix of a 1-D or 3-D map: ``(B, L)``
    or ``(B, K, L)``, ``(B, D, H, W)`` or ``(B, K, D, H, W)``); the usual ``(B,)`` indices and ``(B, K)``
    floating targets are not dense (``None``: the sample's lam). Any other shape under a region mix is
    refused: the mask would be mapped onto it along dimensions it does not describe."""
    spatial = positions(target)
    if spatial <= 0:
        return None
    dims = last.weights.ndim - 1
    if spatial != dims:
        indices, floating = _DENSE[dims]
        raise ValueError(
            f"{what}(): {kind} mixes regions of a {dims}-D map, so its dense targets must be {indices} class "
            f"indices or {floating} floating targets; got {target.dtype} {tuple(target.shape)}"
        )
    weights = last.weights.to(torch.float64)
    size = tuple(target.shape[-dims:])
    if tuple(weights.shape[1:]) != size:
        weights = F.interpolate(weights.unsqueeze(1), size=size, mode="area").squeeze(1)
    return weights.expand(target.shape[0], *size)


def halves(last: MixState, logits: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The clean rows and the mixed rows of a clean+mixed forward's ``logits`` (``2B`` rows first; with a
    method's own rows before the mixed ones, :attr:`MixState.groups`, those and the mixed ones)."""
    n = last.index.shape[0]
    rows = (1 + last.groups) * n
    if not isinstance(logits, torch.Tensor) or logits.ndim == 0 or logits.shape[0] != rows:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"{what}(): the forward that produced these logits kept its clean batch beside the mix "
            f"(clean=True), so the logits must have {rows} rows first (the {n} clean samples, then their "
            f"mixes), got {shape}"
        )
    return logits[:n], logits[n:]


def per_row(clean: torch.Tensor, mixed: torch.Tensor, eta: float = 1.0) -> torch.Tensor:
    """The loss of a clean+mixed batch from the clean rows' and the mixed rows' losses, the mixed ones
    weighed by ``eta``: one loss per row (``2B``) for per-sample losses, else the mean of the two (for a
    mean-reducing criterion, the mean over the doubled batch)."""
    if clean.ndim == 0 and mixed.ndim == 0:
        return (clean + eta * mixed) / 2
    if clean.ndim and clean.shape == mixed.shape:
        return torch.cat([clean, eta * mixed])
    raise ValueError(
        f"loss(): the criterion returned shape {tuple(clean.shape)} for the clean rows and "
        f"{tuple(mixed.shape)} under the mix: return one loss per sample (reduction='none') or a number"
    )


def partner_targets(last: MixState, target: torch.Tensor, what: str, kind: str) -> torch.Tensor:
    """The labels of the partner batch a mix drew its partners from (``use_partners(inputs, targets)``:
    a :class:`~mixhook.policies.PartnerBatch`), on ``target``'s device, checked to be labels of the same
    kind as ``target``."""
    found = last.info.get("partner_targets")
    if found is None:
        raise ValueError(
            f"{what}(): {kind} drew its partners from a partner batch given without labels: pass them, "
            "use_partners(inputs, targets)"
        )
    if found.dtype.is_floating_point != target.dtype.is_floating_point or found.shape[1:] != target.shape[1:]:
        raise ValueError(
            f"{what}(): the partner batch's labels are {found.dtype} {tuple(found.shape)}, the batch's "
            f"{target.dtype} {tuple(target.shape)}: give labels of the same kind"
        )
    return to_device(found, target.device, target.dtype)


def soft_targets(target: torch.Tensor, num_classes: int | None, smoothing: float, dtype: torch.dtype | None):
    """What ``targets()`` makes of labels like ``target`` (checked here, with its arguments, in one line
    each): ``soft(t)``, the soft targets of labels ``t`` in ``dtype`` (``None``: torch's default): one-hot
    class indices (per position for dense ones) with label ``smoothing``, or floating targets as they are."""
    if num_classes is not None and (
        isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1
    ):
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not dtype.is_floating_point:
        raise ValueError(f"targets(dtype=...) must be a floating dtype, got {dtype}")
    if not isinstance(target, torch.Tensor) or target.ndim == 0 or target.dtype == torch.bool:
        what = f"{target.dtype} {tuple(target.shape)}" if isinstance(target, torch.Tensor) else type(target)
        raise ValueError(f"targets() needs a batch of integer class indices or floating targets, got {what}")
    if target.dtype.is_floating_point:
        if smoothing:
            raise ValueError(
                "targets(smoothing=...) applies to class indices; smooth floating (soft, multi-hot) "
                "targets yourself before mixing them"
            )
        if num_classes is not None and (target.ndim < 2 or target.shape[1] != num_classes):
            raise ValueError(
                f"targets(): floating targets of shape {tuple(target.shape)} do not have "
                f"num_classes={num_classes} classes along dimension 1"
            )
        return lambda t: t.to(dtype)
    if num_classes is None:
        raise ValueError("targets(): class indices need num_classes")
    check_classes(target, num_classes)

    def one_hot(t: torch.Tensor) -> torch.Tensor:
        soft = smooth_one_hot(t.reshape(-1), num_classes, smoothing, dtype)
        return soft.view(*t.shape, num_classes).movedim(-1, 1) if t.ndim > 1 else soft

    return one_hot


def weighed_labels(criterion: Callable, logits: torch.Tensor, target: torch.Tensor, indices, weights):
    """``sum_k weights[k] * criterion(logits, target[indices[k]])``: the criterion under a mix of ``K``
    samples per row (:attr:`MixState.mixture`), ``indices`` ``(K, B)``, ``weights`` one per term (numbers,
    or a ``(K,)`` tensor) or ``(K, B)`` per row (the criterion must then return one loss per sample),
    weighed in float32 at least and rounded once to the criterion's dtype."""
    loss = None
    for k in range(len(indices)):
        rows = indices[k]
        term = criterion(logits, target.index_select(0, to_device(torch.as_tensor(rows), target.device)))
        work = _at_least_float32(term)
        weight = weights[k]
        if isinstance(weight, torch.Tensor):
            if weight.ndim and (work.ndim == 0 or work.shape[0] != weight.shape[0]):
                raise ValueError(
                    f"loss(): the mix weighs each of its {len(indices)} labels by one weight per sample, so "
                    "the criterion must return one loss per sample (reduction='none'), but it returned "
                    f"shape {tuple(term.shape)}"
                )
            weight = to_device(weight, work.device, work.dtype)
            weight = weight.view(-1, *[1] * (work.ndim - 1)) if weight.ndim else weight
        part = weight * work
        loss = part if loss is None else loss + part
    return loss.to(term.dtype)


class LossAndTargets:
    """``loss`` and ``targets`` of a :class:`~mixhook.engine.mixer.Mixer`: the criterion, or the soft
    targets, under the mix of the forward that produced the logits (found by ``_bound_state``)."""

    dense_targets: ClassVar[str | None]  # set by Mixer (why a method refuses dense targets, or None)
    _policies: Policies | None  # set by Mixer (use())

    def loss(
        self,
        criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        logits: torch.Tensor,
        target: torch.Tensor,
    ) -> torch.Tensor:
        """``lam * criterion(logits, target) + (1 - lam) * criterion(logits, target[index])`` under the
        mix of the forward that produced ``logits``, or ``criterion(logits, target)`` when that forward
        mixed nothing (an eval forward, a skipped one); see :meth:`state_for` for how the forward is found
        and what is refused.

        ``target`` is whatever the criterion takes: class indices, soft or multi-hot targets
        (``BCEWithLogitsLoss``), regression values, or dense targets (see :func:`dense_weights`). With
        one lam per sample (``mode="elem"``) the criterion must return one loss per sample
        (``reduction="none"``); the weighted per-sample losses are returned for you to reduce. With a
        dense target under a region mix, lam is each position's own weight (the mask resized to the label
        map), so the criterion must return one loss per position (``reduction="none"``, e.g. ``(B, H, W)``
        for ``(B, H, W)`` class indices), weighted and returned for you to reduce.

        For a criterion that is linear in its target (cross-entropy, BCE) this equals the criterion of
        the mixed targets (:meth:`targets`); for one that is not (MSE on regression targets), the two
        differ: mix the targets with :meth:`targets` when the criterion of the mixed target is meant.

        After a clean+mixed forward (``clean=True``) the logits have ``2B`` rows and ``target`` has ``B``:
        the criterion of the clean rows beside the mixed criterion of the mixed rows, as one loss per row
        (``2B``, for a per-sample criterion) or, for a criterion that reduces, the mean of the two (the
        doubled batch's mean, as RegMixup's authors train); a method's own loss may weigh them otherwise
        (RegMixup's ``eta``, RankMixup, MixupE)."""
        last = self._path.seen.state_for(logits, "loss", type(self).__name__, self._model is not None)
        if last is None:
            return criterion(logits, target)
        if type(self).labelled is not LossAndTargets.labelled:  # (MixPro: weights that follow the logits)
            last = self._labelled(last, logits, target, "loss")
        if last.clean:
            clean, mixed = halves(last, logits, "loss")
            return self.clean_loss(criterion, clean, mixed, target, last)
        return self.mixed_loss(criterion, logits, target, last)

    def weigh(
        self,
        metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        logits: torch.Tensor,
        target: torch.Tensor,
    ) -> torch.Tensor:
        """A per-sample ``metric`` under the mix of the forward that produced ``logits``, weighted as
        :meth:`loss` weighs a criterion (``lam * metric(logits, target) + (1 - lam) * metric(logits,
        target[index])``), without the terms of a method's own loss: after a clean+mixed forward the
        clean rows' metric, then the mixed rows' weighted one (``2B`` values). For reporting: the app's
        lam-weighted training accuracy is ``weigh(lambda o, t: (o.argmax(1) == t).double(), logits, y)``.
        ``metric(logits, target)`` when that forward mixed nothing."""
        last = self._labelled_state(logits, target, "weigh")
        if last is None:
            return metric(logits, target)
        if last.clean:
            clean, mixed = halves(last, logits, "weigh")
            return torch.cat([metric(clean, target), self.mixed_loss(metric, mixed, target, last, False)])
        return self.mixed_loss(metric, logits, target, last, False)

    def labelled(self, last: MixState, logits: torch.Tensor, target: torch.Tensor) -> MixState:
        """The mix ``last`` as ``loss``/``weigh``/``targets`` weigh the labels of the forward that produced
        ``logits``: itself by default; a method whose label weights follow the prediction (MixPro's
        progressive attention labelling) returns it with those weights."""
        return last

    def _labelled_state(self, logits, target: torch.Tensor, what: str) -> MixState | None:
        """The mix bound to ``logits`` (:meth:`state_for`), as :meth:`labelled` weighs its labels."""
        last = self._path.seen.state_for(logits, what, type(self).__name__, self._model is not None)
        if last is None or type(self).labelled is LossAndTargets.labelled:
            return last
        return self._labelled(last, logits, target, what)

    def _labelled(self, last: MixState, logits, target: torch.Tensor, what: str) -> MixState:
        """``last`` as :meth:`labelled` weighs its labels, given the ``logits`` (refused without them)."""
        if logits is None:
            raise ValueError(
                f"{what}(): {type(self).__name__} weighs the labels by the prediction: pass the logits "
                f"({what}(y, ..., logits=logits))"
            )
        return self.labelled(last, logits, target)

    def targets_refused(self) -> str | None:
        """Why the mixed targets of a clean+mixed forward are not this method's training signal (its loss
        is not a criterion of them), or ``None``: the app asks before it trains on soft targets."""
        return None

    def clean_loss(
        self,
        criterion: Callable,
        clean: torch.Tensor,
        mixed: torch.Tensor,
        target: torch.Tensor,
        last: MixState,
    ) -> torch.Tensor:
        """An extension point (a method with ``keeps_clean`` overrides it; a user calls :meth:`loss`): the
        loss of a clean+mixed forward from its ``clean`` and ``mixed`` logits (``B`` rows each) and the mix
        ``last``; by default the mean over the doubled batch, with :meth:`mixed_loss` the mixed rows', or
        a loss policy's that reads the clean rows (SUMix: :meth:`~.policies.Policy.clean_loss`)."""
        if self._policies is not None and self._policies.on_loss:
            partner = self._partners_of(last, target, "loss")
            own = self._policies.clean_loss(criterion, clean, mixed, target, partner, last)
            if own is not None:
                return own
        return per_row(criterion(clean, target), self.mixed_loss(criterion, mixed, target, last))

    def mixed_loss(
        self,
        criterion: Callable,
        logits: torch.Tensor,
        target: torch.Tensor,
        last: MixState,
        own_terms: bool = True,
    ) -> torch.Tensor:
        """An extension point (a method whose mixed loss has terms of its own overrides it, calling this
        one; a user calls :meth:`loss`): the criterion of ``logits`` under the mix ``last`` (its mixed rows
        only), ``lam * criterion(logits, target) + (1 - lam) * criterion(logits, target[index])``; with
        ``own_terms`` (``loss``, not ``weigh``), a loss policy's weights and terms too."""
        if last.mixture is not None:
            return weighed_labels(
                criterion, logits, self._mixture_targets(last, target, "loss"), *last.mixture
            )
        if self._policies is not None and self._policies.on_loss:
            partner = self._partners_of(last, target, "loss")
            return self._policies.mixed_loss(criterion, logits, target, partner, last, own_terms)
        loss_a = criterion(logits, target)
        loss_b = criterion(logits, self._partners_of(last, target, "loss"))
        weight = last.weight
        if (
            type(weight) is float
            and last.partner_lam is None
            and target.ndim <= 1 + target.is_floating_point()
        ):  # one lam as a float, a target that is no map (a region's weights then do not enter): the usual
            return torch.lerp(loss_b, loss_a, weight)
        if last.partner_lam is not None:  # weights that need not sum to one (SnapMix)
            if loss_a.ndim == 0 or loss_a.shape[0] != last.partner_lam.shape[0]:
                raise ValueError(
                    f"loss(): {type(self).__name__} weighs each sample's two labels by its own weights, so "
                    "the criterion must return one loss per sample (reduction='none'), but it returned "
                    f"shape {tuple(loss_a.shape)}"
                )
            work = _at_least_float32(loss_a)  # (a low-precision loss: weighed in float32, rounded once)
            lam, partner = (per_sample(w, work) for w in (last.lam, last.partner_lam))
            return (lam * work + partner * loss_b.to(work.dtype)).to(loss_a.dtype)
        lam = self._target_weights(last, target, "loss")
        if lam is None:
            lam = last.lam
            if lam.ndim == 1 and (loss_a.ndim == 0 or loss_a.shape[0] != lam.shape[0]):
                raise ValueError(
                    f"loss(): lam has one value per sample ({lam.shape[0]}), so the criterion must return "
                    f"one loss per sample (reduction='none'), but it returned shape {tuple(loss_a.shape)}"
                )
            if lam.ndim == 1 and loss_a.ndim > 1:  # per-sample lam over per-position losses (dense)
                if any(dim != 0 for dim in last.batch_dims):
                    raise ValueError(
                        f"loss(): per-position losses {tuple(loss_a.shape)} with one lam per sample need the "
                        f"batch first, but this model's mixed tensors have it at {last.batch_dims}: reduce "
                        "the criterion to one loss per sample"
                    )
                lam = lam.view(-1, *[1] * (loss_a.ndim - 1))
        elif loss_a.shape != lam.shape:
            raise ValueError(
                f"loss(): a dense target under {type(self).__name__}'s region mix weighs each position "
                f"by its own mask, so the criterion must return one loss per position {tuple(lam.shape)} "
                f"(reduction='none'), but it returned shape {tuple(loss_a.shape)}"
            )
        # weighed in float32 at least and rounded once to the criterion's dtype: a bfloat16 loss is as near
        # the exact weighing as bfloat16 can be (lam rounded to bfloat16 first would move it further)
        work = _at_least_float32(loss_a)
        lam = to_device(lam, work.device, work.dtype)
        return torch.lerp(loss_b.to(work.dtype), work, lam).to(loss_a.dtype)

    def targets(
        self,
        target: torch.Tensor,
        num_classes: int | None = None,
        smoothing: float = 0.0,
        dtype: torch.dtype | None = None,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mixed targets of the forward that produced ``logits``: ``lam * t + (1 - lam) * t[index]``
        (``t`` when it mixed nothing), in ``dtype`` (a floating dtype, e.g. the logits'; ``None``: torch's
        default), computed from the float64 lam. Without ``logits``: the latest forward's, refused in one
        line when an earlier forward that mixed has not had its targets or loss taken (pass ``logits``
        to say which; see :meth:`state_for`).

        ``t`` is, by ``target``:

        - integer class indices ``(B,)``: one-hot over ``num_classes`` with label smoothing (``1 -
          smoothing + smoothing/num_classes`` on the true class, ``smoothing/num_classes`` elsewhere):
          ``(B, num_classes)``, for ``nn.CrossEntropyLoss``, which accepts class probabilities;
        - integer dense labels ``(B, *S)`` (a segmentation map ``(B, H, W)``, token labels ``(B, T)``):
          one-hot per position, ``(B, num_classes, *S)``;
        - floating targets, taken as they are: soft class probabilities or multi-hot labels ``(B, K)``
          (for ``BCEWithLogitsLoss``), regression values ``(B,)`` or ``(B, d)``, dense probabilities
          ``(B, K, H, W)``; ``num_classes``, when given, is checked against ``K``; ``smoothing`` is
          refused (smooth them yourself first, as the smoothing of multi-hot labels is a choice).

        Under a region mix (CutMix, FMix, PatchUp, ...) a dense target's lam is per position: the
        method's own-content mask resized to the label map (:func:`dense_weights`), so a pasted box
        pastes its labels too. After a clean+mixed forward (``clean=True``): ``2B`` rows, the clean
        targets then the mixed ones, as the logits' rows are."""
        soft = soft_targets(target, num_classes, smoothing, dtype)
        last = self._labelled_state(logits, target, "targets")
        labels = None if last is None else self._partners_of(last, target, "targets")
        own = soft(target)
        if last is None:
            return own
        if last.clean:
            why = self.targets_refused()
            if why:
                raise ValueError(f"targets(): {type(self).__name__} {why}; train with its loss()")
            if logits is not None:
                halves(last, logits, "targets")
        mixed = self._mixed_targets(last, target, labels, own, soft(labels), num_classes)
        return torch.cat([own, mixed]) if last.clean else mixed

    def _mixed_targets(self, last: MixState, target, labels, own, partner, num_classes: int | None):
        """The soft targets ``own`` of the samples and ``partner`` of their partners mixed as ``last``
        weighs them (``labels``: the partners' labels, for a target policy)."""
        if last.mixture is not None:  # (K samples per row: own is each label's soft target, in order)
            target = self._mixture_targets(last, target, "targets")
            indices, weights = last.mixture
            mixed = None
            for k in range(indices.shape[0]):
                soft = own.index_select(0, to_device(indices[k], own.device))
                weight = to_device(weights[k], own.device, own.dtype)
                part = (weight.view(-1, *[1] * (own.ndim - 1)) if weight.ndim else weight) * soft
                mixed = part if mixed is None else mixed + part
            return mixed
        policies = self._policies
        if policies is not None and policies.on_loss:
            if policies.changes_loss:
                names = ", ".join(type(p).__name__ for p in policies.all if p.changes_loss)
                raise ValueError(
                    f"targets(): {type(self).__name__} uses {names}, which weights or adds to the loss "
                    "beyond mixed targets; train with loss()"
                )
            lam = policies.target_lam(last, target, labels, "targets", num_classes)
            return torch.lerp(
                partner, own, to_device(lam, own.device, own.dtype).view(-1, *[1] * (own.ndim - 1))
            )
        weights = self._target_weights(last, target, "targets")
        if last.partner_lam is not None:  # weights that need not sum to one (SnapMix)
            lam, partner_lam = (per_sample(w, own) for w in (last.lam, last.partner_lam))
            return lam * own + partner_lam * partner
        if weights is None:
            weight = last.weight
            lam = weight if type(weight) is float else per_sample(last.lam, own)
            return torch.lerp(partner, own, lam)
        return torch.lerp(partner, own, to_device(weights, own.device, own.dtype).unsqueeze(1))

    def _mixture_targets(self, last: MixState, target: torch.Tensor, what: str) -> torch.Tensor:
        """``target``, checked to be labels a mix of more than two samples per row weighs as a whole (one
        weight per label: no loss policy's two-label weights, no dense map's per-position ones, the
        batch's own rows)."""
        kind, k = type(self).__name__, last.mixture[0].shape[0]
        if self._policies is not None and self._policies.on_loss:
            names = ", ".join(type(p).__name__ for p in self._policies.all)
            raise ValueError(
                f"{what}(): {kind} mixed {k} samples per row, which the two-label weights of {names} cannot "
                "describe; use it with a mix of two"
            )
        if positions(target) > 0:
            raise ValueError(
                f"{what}(): {kind} mixed {k} samples per row with one weight per label: dense targets "
                f"{tuple(target.shape)} have no per-position weights under it"
            )
        if target.shape[0] != last.mixture[0].shape[1] or last.info.get("partners") in ("global", "batch"):
            raise ValueError(
                f"{what}(): target has {target.shape[0]} rows, and {kind}'s mix of {k} samples per row "
                f"takes the {last.mixture[0].shape[1]} labels of the batch it mixed"
            )
        return target

    def _target_weights(self, last: MixState, target: torch.Tensor, what: str) -> torch.Tensor | None:
        """Per-position own weights ``(B, H, W)`` for a dense ``target`` under a region mix, else ``None``
        (lam as it is)."""
        dense = positions(target) > 0
        if dense and self.dense_targets is not None:
            raise ValueError(f"{what}(): {type(self).__name__} {self.dense_targets}")
        if not dense or last.weights is None:  # (weights a method deferred are made for a dense target only)
            return None
        return dense_weights(last, target, what, type(self).__name__)

    def _partners_of(self, last: MixState, target: torch.Tensor, what: str) -> torch.Tensor:
        """The partners' rows of ``target`` under the mix ``last`` (from every rank's ``target`` when the
        partners came from the global batch)."""
        index = last.index
        if target.shape[0] != index.shape[0]:
            raise ValueError(
                f"{what}(): target has {target.shape[0]} rows but the forward that produced the logits "
                f"mixed a batch of {index.shape[0]}"
            )
        where = last.info.get("partners")
        if where == "global":
            target = partners.gather_labels(target)
        elif where == "batch":  # a partner batch (mixhook.policies.PartnerBatch): its own labels
            target = partner_targets(last, target, what, type(self).__name__)
        return target.index_select(
            0, index if index.device == target.device else to_device(index, target.device)
        )

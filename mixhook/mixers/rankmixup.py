"""RankMixup: a mixed sample must be less confident than its clean source (the mixup ranking loss, MRL).

Paper: Noh, Park, Lee, Ham. "RankMixup: Ranking-Based Mixup Training for Network Calibration." ICCV 2023.
https://arxiv.org/abs/2308.11990
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..engine.card import Card
from ..engine.checks import check_non_negative, check_per_sample
from ..engine.contract import MixState
from ..transfer import to_device
from ._clean import CleanAndMixed


class RankMixup(CleanAndMixed):
    """RankMixup (Noh et al. 2023) with its mixup ranking loss (MRL): cross-entropy on the clean batch plus
    a hinge that ranks each mixed sample's confidence below its clean source's.

    The chosen layer emits the clean batch followed by its mix ``lam * h + (1 - lam) * h[index]``,
    ``lam ~ Beta(alpha, alpha)`` (:attr:`~mixhook.engine.mixer.Mixer.clean`). :meth:`loss` is
    ``CE(clean, y) + weight * mask * relu(max_k z_mix - max_k z_clean + margin)`` per clean sample, with
    ``z`` the logits (the authors' code ranks the top logits, not the softmax) and ``mask`` 0 where the mix
    keeps one label (partner of the same class, or ``lam`` of 0 or 1), as in the authors' code
    (cvlab-yonsei/RankMixup ``calibrate/losses/rankmixup.py``, ``RankMixup_MRL``). The mixed rows get no
    cross-entropy. With a per-sample criterion it returns the ``B`` per-sample losses (their mean is the
    training loss); with a reducing one, ``CE + weight * mean(mask * hinge)``.

    The authors' code multiplies a ``(B,)`` mask by a ``(B, 1)`` hinge, which broadcasts to ``(B, B)``: its
    term is ``mean(mask) * mean(hinge)``, equal to this one when every partner has another label and
    ``0 < lam < 1`` (the common case); here each sample's hinge is masked by its own partner, as the paper
    writes it. Their clean and mixed batches are two forwards; here one forward of ``2B`` rows, which equals
    two forwards for a model without batch statistics (BatchNorm sees both halves together here).

    Args:
        layer: as :class:`ManifoldMixup` (the authors mix the input, or the last stage's features).
        alpha: the Beta distribution's concentration, > 0 (authors: 2.0 on CIFAR, 1.0 on Tiny-ImageNet).
        margin: the ranking margin on the top logit, >= 0 (authors: 2.0 on CIFAR, 1.0 on Tiny-ImageNet).
        weight: the weight of the ranking term, >= 0 (authors: 0.1).
        prob, generator, batch_dim: as :class:`ManifoldMixup`.
    """

    card = Card(
        paper="Noh et al. 2023",
        mixes="ranks the mixed sample's confidence below the clean one's",
        where="input, any layer; clean+mixed",
        family="clean",
        traits=("clean",),
        signature="RankMixup(layer, alpha=2.0, margin=2.0, weight=0.1)",
        hook="forward, clean+mixed",
        commands="`mixup=rankmixup`",
        details=(
            "Clean+mixed as RegMixup; loss = `CE(clean) + weight·mask·relu(max z_mix - max z_clean + "
            "margin)` per sample (the mixup ranking loss, MRL, on the top logits; `mask` 0 for a same-label "
            "partner or lam 0 or 1), equal to the authors' `RankMixup_MRL` on the same draws where every "
            "partner has another label (their `(B,)×(B,1)` mask broadcast differs otherwise, see the class "
            "docstring)"
        ),
        workflows="all but TRL",
        example={"layer": "input", "alpha": 1.0},
    )

    class_labels = True
    refused_targets = "ranks confidences: its loss is no criterion of mixed targets"
    takes_loss_policies = False  # its loss is its own (cross-entropy of the clean rows and a ranking hinge)

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 2.0,
        margin: float = 2.0,
        weight: float = 0.1,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim=batch_dim)
        self.margin = check_non_negative("margin", margin)
        self.weight = check_non_negative("weight", weight)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, margin={self.margin}, weight={self.weight})"

    def clean_terms(
        self,
        criterion: Callable,
        clean: torch.Tensor,
        mixed: torch.Tensor,
        target: torch.Tensor,
        last: MixState,
    ) -> torch.Tensor:
        kind = type(self).__name__
        ce = criterion(clean, target)
        hinge = F.relu(mixed.max(1).values - clean.max(1).values + self.margin)
        lam = to_device(last.lam, hinge.device, hinge.dtype).expand(hinge.shape[0])
        partner = self._partners_of(last, target, "loss")
        mask = (target != partner) & (lam > 0) & (lam < 1)
        ranked = hinge * mask
        check_per_sample(kind, ce, ranked)
        return ce + self.weight * (ranked.mean() if ce.ndim == 0 else ranked)

"""What the target is: Remix's label rule for imbalanced classes, and DecoupleMix's loss.

Papers:
    - Chou, Chang, Pan, Wei, Juan. "Remix: Rebalanced Mixup." ECCV Workshops 2020.
      https://arxiv.org/abs/2007.03943 (no official code: the rule is the paper's Eq. 3)
    - Liu, Li, Wang, Tan, Wu, Li. "Harnessing Hard Mixed Samples with Decoupled Regularizer." NeurIPS 2023.
      https://arxiv.org/abs/2203.10761 (OpenMixup's ``soft_mix_cross_entropy``,
      ``openmixup/models/losses/cross_entropy_loss.py``, ``use_mix_decouple=True``)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..engine.checks import check_non_negative
from ..engine.mixer import Mixer
from ..engine.policies import Policy, refuse_own_loss
from ..transfer import to_device


def remix_lam(lam: torch.Tensor, n_own: torch.Tensor, n_partner: torch.Tensor, kappa: float, tau: float):
    """Remix's label weight (the paper's Eq. 3) of each sample under the mix weight ``lam`` (the sample's
    own share of the input), from the sizes of the sample's and of its partner's classes: 0 when the
    sample's class is at least ``kappa`` times the partner's and ``lam < tau`` (the label goes to the
    minority partner), 1 when it is at most ``1/kappa`` times and ``1 - lam < tau``, else ``lam``."""
    ratio = n_own / n_partner
    lam = lam.expand(ratio.shape).to(torch.float64)
    to_partner = (ratio >= kappa) & (lam < tau)
    to_own = (ratio <= 1 / kappa) & (1 - lam < tau)
    return torch.where(to_partner, torch.zeros_like(lam), torch.where(to_own, torch.ones_like(lam), lam))


class Remix(Policy):
    """Remix (Chou et al. 2020): under a mix that gives the sample ``lam`` of the input, its label goes
    wholly to the minority class of the pair when the pair's classes are imbalanced enough
    (:func:`remix_lam`, ``kappa`` and ``tau``); otherwise the label is mixed by ``lam`` as usual. Takes any
    mixer (its lam, CutMix's area-corrected one included) with class-index labels; the label weight is one
    per sample, so ``loss`` needs one loss per sample (``reduction='none'``).

    Args:
        counts: the number of training samples of each class (``None``: call :meth:`count` with the
            training labels before training; the app counts them).
        kappa: the imbalance ratio from which the label goes to the minority class, >= 1 (paper: 3).
        tau: the input share below which a majority sample gives up its label, in (0, 1] (paper: 0.5).
    """

    knob = "target"
    needs_classes = True
    needs_class_counts = True
    why_classes = "moves the label between classes by their sizes"

    def __init__(
        self, counts: Sequence[int] | torch.Tensor | None = None, kappa: float = 3.0, tau: float = 0.5
    ):
        if not (isinstance(kappa, (int, float)) and math.isfinite(kappa) and kappa >= 1):
            raise ValueError(f"kappa must be a number >= 1, got {kappa!r}")
        if not (isinstance(tau, (int, float)) and 0 < tau <= 1):
            raise ValueError(f"tau must be in (0, 1], got {tau!r}")
        self.kappa, self.tau = float(kappa), float(tau)
        self.counts = counts

    @property
    def counts(self) -> torch.Tensor | None:
        """The number of training samples of each class (float64 on the CPU), or ``None`` until given."""
        return self._counts

    @counts.setter
    def counts(self, counts) -> None:
        self._counts = None if counts is None else _check_counts(counts)

    def __repr__(self) -> str:
        counts = "" if self.counts is None else f"counts={self.counts.tolist()}, "
        return f"Remix({counts}kappa={self.kappa}, tau={self.tau})"

    def count(self, labels: torch.Tensor, num_classes: int) -> Remix:
        """Count the classes of the training ``labels`` (class indices) into :attr:`counts`; returns self."""
        labels = torch.as_tensor(labels)
        if labels.dtype.is_floating_point or labels.ndim != 1:
            raise ValueError(
                f"Remix.count() takes class indices (N,), got {labels.dtype} {tuple(labels.shape)}"
            )
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
            raise ValueError(f"Remix.count(): labels must lie in [0, {num_classes})")
        self.counts = torch.bincount(labels.cpu(), minlength=num_classes)
        return self

    def check_mixer(self, mixer: Mixer) -> None:
        refuse_own_loss(self, mixer)

    def target_lam(self, lam: torch.Tensor, target: torch.Tensor, partner: torch.Tensor, classes: int | None):
        if self.counts is None:
            raise RuntimeError(
                "Remix needs the class counts: Remix(counts=[...]) or remix.count(train_labels, num_classes)"
            )
        if classes is not None and classes != self.counts.shape[0]:
            raise ValueError(
                f"Remix has counts for {self.counts.shape[0]} classes, but the logits have {classes}; count "
                "the classes of this data set"
            )
        counts = to_device(self.counts, target.device)
        return remix_lam(lam, counts[target], counts[partner], self.kappa, self.tau)


def _check_counts(counts) -> torch.Tensor:
    counts = torch.as_tensor(counts).detach().cpu()
    if counts.ndim != 1 or counts.numel() < 2 or counts.dtype.is_complex or not bool((counts >= 0).all()):
        raise ValueError(
            f"Remix counts must be one non-negative number per class (two or more), got {counts.tolist()}"
        )
    return counts.to(torch.float64)


def decoupled_terms(
    logits: torch.Tensor, own: torch.Tensor, partner: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """DecoupleMix's two terms per sample: the cross-entropy of the sample's class among every class but
    the partner's, and of the partner's class among every class but the sample's (``-log softmax`` with
    the other class of the pair removed)."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    own, partner = own.view(-1, 1), partner.view(-1, 1)
    without_partner = z.scatter(1, partner, float("-inf")).logsumexp(1)
    without_own = z.scatter(1, own, float("-inf")).logsumexp(1)
    return without_partner - z.gather(1, own).squeeze(1), without_own - z.gather(1, partner).squeeze(1)


class DecoupledLoss(Policy):
    """DecoupleMix's loss (Liu et al., NeurIPS 2023): the mixed cross-entropy plus ``eta`` times, for each
    pair of two classes, ``lam`` times the cross-entropy of the sample's class with the partner's class
    removed from the softmax and ``1 - lam`` times the partner's with the sample's removed, so that a hard
    mix (whose two classes compete in the softmax) still pushes each class up against the others. Pairs of
    one class, and lam within ``eps`` of 0 or 1, add nothing (OpenMixup's thresholds).

    Equal to OpenMixup's ``soft_mix_cross_entropy(use_mix_decouple=True)`` with its default head
    (``eta_weight=dict(eta=eta, mode="both")``, linear lam), for one lam per batch; where OpenMixup's
    order of the two classes of its first row puts ``1 - lam`` on the sample's term (its ``lam_k`` follows
    class indices), and at ``lam = 0.5`` (it drops the term), this follows the paper. Takes class indices
    and logits ``(B, C)``; ``targets()`` refuses (the term is not a target).

    Args:
        eta: the weight of the decoupled terms, >= 0 (OpenMixup's CIFAR configs: 0.1).
        eps: lam within this of 0 or 1 counts as no mix (OpenMixup: 1e-3).
    """

    knob = "loss"
    needs_classes = True
    changes_loss = True
    why_classes = "removes one class of each pair from the softmax"

    def __init__(self, eta: float = 0.1, eps: float = 1e-3):
        check_non_negative("eta", eta)
        if not (isinstance(eps, (int, float)) and 0 <= eps < 0.5):
            raise ValueError(f"eps must be in [0, 0.5), got {eps!r}")
        self.eta, self.eps = float(eta), float(eps)

    def __repr__(self) -> str:
        return f"DecoupledLoss(eta={self.eta}, eps={self.eps})"

    def check_mixer(self, mixer: Mixer) -> None:
        refuse_own_loss(self, mixer)

    def extra_loss(self, logits, target, partner, lam) -> torch.Tensor:
        if logits.ndim != 2:
            raise ValueError(f"DecoupledLoss takes logits (B, C), got {tuple(logits.shape)}")
        own_term, partner_term = decoupled_terms(logits, target, partner)
        lam = to_device(lam, logits.device, own_term.dtype).expand(own_term.shape)
        active = (target != partner) & (lam > self.eps) & (lam < 1 - self.eps)
        term = self.eta * (lam * own_term + (1 - lam) * partner_term)
        return torch.where(active, term, torch.zeros_like(term))

"""MixupE: the mixup loss plus a term along the directional derivative of the clean samples' logits.

Paper: Zou, Verma, Mittal, Tang, Pham, Kannala, Bengio, Solin, Kawaguchi. "MixupE: Understanding and
Improving Mixup from Directional Derivative Perspective." UAI 2023. https://arxiv.org/abs/2212.13381
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..engine.card import Card
from ..engine.checks import check_non_negative, check_per_sample
from ..engine.contract import MixState
from ._clean import CleanAndMixed


class MixupE(CleanAndMixed):
    """MixupE (Zou et al. 2023): the mixup loss minus ``eta`` times the clean samples' implicit
    directional-derivative term, rescaled to the mixup loss's size.

    The chosen layer emits the clean batch followed by its mix ``lam * h + (1 - lam) * h[index]``,
    ``lam ~ Beta(alpha, alpha)`` (:attr:`~mixhook.engine.mixer.Mixer.clean`). With ``z`` the clean rows'
    logits, ``g_i = sum_k z_ik (onehot(y_i)_k - softmax(z_i)_k)`` and ``E = (alpha + 1) / (2 alpha + 1)``
    (the mean of ``Beta(alpha + 1, alpha)``), :meth:`loss` is ``L = M - eta * (1 - E) * sum_{g_i <
    threshold} g_i / B`` rescaled by ``|M| / |L|`` (both without gradient), where ``M`` is the mixup
    criterion of the mixed rows: the authors' faster version (oneHuster/MixupE ``mixup.py``,
    ``mixupe_version == 3``, which their README trains with: ``alpha = 2``, ``eta = 0.001``, ``threshold =
    1``); ``threshold=math.inf`` keeps every sample. With a per-sample criterion it returns ``B`` row
    losses whose mean is that loss; with a reducing one, the loss itself.

    The authors' clean logits come from a second forward of the clean batch; here from the same forward
    (``2B`` rows), which equals two forwards for a model without batch statistics.

    Args:
        layer: as :class:`ManifoldMixup` (the authors mix the input).
        alpha: the Beta distribution's concentration, > 0 (authors: 2.0).
        eta: the weight of the directional term, >= 0 (authors: 0.001 on CIFAR-100).
        threshold: only samples with ``g_i < threshold`` count (authors: 1.0); ``math.inf``: all.
        prob, generator, batch_dim: as :class:`ManifoldMixup`.
    """

    card = Card(
        paper="Zou et al. 2023",
        mixes="mixup's loss with its enhancement term",
        where="input, any layer; clean+mixed",
        family="clean",
        traits=("clean",),
        signature="MixupE(layer, alpha=2.0, eta=0.001, threshold=1.0)",
        hook="forward, clean+mixed",
        commands="`mixup=mixupe`",
        details=(
            "Clean+mixed as RegMixup; loss = `M - eta·(1-E)·Σ_{g_i<threshold} g_i / B` rescaled by "
            "`|M|/|loss|`, `M` the mixup criterion of the mixed rows, `g_i = Σ_k z_ik (onehot(y_i) - "
            "softmax(z_i))_k` on the clean logits, `E = (alpha+1)/(2alpha+1)`: the authors' version 3, equal "
            "to their code on the same draws"
        ),
        workflows="all but TRL",
        example={"layer": "input", "alpha": 1.0},
    )

    class_labels = True
    refused_targets = "adds a term of the clean logits: its loss is no criterion of mixed targets"

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 2.0,
        eta: float = 0.001,
        threshold: float = 1.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim=batch_dim)
        self.eta = check_non_negative("eta", eta)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold):
            raise ValueError(f"threshold must be a number (math.inf: every sample), got {threshold!r}")
        self.threshold = float(threshold)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, eta={self.eta}, threshold={self.threshold})"

    def clean_terms(
        self,
        criterion: Callable,
        clean: torch.Tensor,
        mixed: torch.Tensor,
        target: torch.Tensor,
        last: MixState,
    ) -> torch.Tensor:
        kind = type(self).__name__
        mix = self.mixed_loss(criterion, mixed, target, last)
        onehot = F.one_hot(target, clean.shape[1]).to(clean.dtype)
        g = (clean * (onehot - torch.softmax(clean, dim=1))).sum(1)
        mean_lam = (self.alpha + 1) / (2 * self.alpha + 1)
        term = (1 - mean_lam) * g * (g.detach() < self.threshold)
        if mix.ndim == 0:
            total = mix - self.eta * term.sum() / g.shape[0]
            return total * (mix.detach().abs() / total.detach().abs())
        check_per_sample(kind, mix, term)
        rows = mix - self.eta * term
        return rows * (mix.detach().mean().abs() / rows.detach().mean().abs())

"""RegMixup: cross-entropy on the clean batch plus the mixup loss on its mixed copy, in one forward.

Paper: Pinto, Yang, Lim, Torr, Dokania. "Using Mixup as a Regularizer Can Surprisingly Improve Accuracy
and Out-of-Distribution Robustness." NeurIPS 2022. https://arxiv.org/abs/2206.14502
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..engine.card import Card
from ..engine.checks import check_non_negative
from ..engine.contract import MixState
from ..engine.targets import per_row
from ._clean import CleanAndMixed


class RegMixup(CleanAndMixed):
    """RegMixup (Pinto et al. 2022): train on the clean batch and, beside it, on its mixup.

    The chosen layer emits the clean batch followed by its mix ``lam * h + (1 - lam) * h[index]``,
    ``lam ~ Beta(alpha, alpha)`` (:attr:`~mixhook.engine.mixer.Mixer.clean`): the model's logits have
    ``2B`` rows, and :meth:`loss` is the criterion of the clean rows beside ``eta`` times the mixup
    criterion of the mixed rows. With a per-sample criterion it returns the ``2B`` row losses, whose mean
    is the authors' training loss (their code, FrancescoPinto/RegMixup ``models/regmixup.py``, takes the
    cross-entropy's mean over the concatenated batch: ``(CE + eta * mixup CE) / 2``, the paper's ``CE + eta
    * mixup CE`` halved); with a reducing criterion, that mean itself. The paper mixes the input with
    ``alpha = 20`` (CIFAR-10) or ``10`` (CIFAR-100) and ``eta = 1``; any layer works as for Manifold Mixup.
    Evaluation forwards are not doubled.

    Args:
        layer: as :class:`ManifoldMixup` (``"input"``: the paper's).
        alpha: the Beta distribution's concentration, > 0 (paper: 20 on CIFAR-10, 10 on CIFAR-100).
        eta: the weight of the mixed rows' loss, >= 0 (paper: 1).
        prob, generator, mode, batch_dim: as :class:`ManifoldMixup`.
    """

    card = Card(
        paper="Pinto et al. 2022",
        mixes="mixup beside the clean batch (`2B` rows)",
        where="input, any layer; no padding masks",
        family="clean",
        traits=("clean",),
        signature="RegMixup(layer, alpha=20.0, eta=1.0)",
        hook="forward, clean+mixed",
        commands="`mixup=regmixup`",
        details=(
            "The layer emits `[h; lam*h + (1-lam)*h[index]]` (2B rows downstream); loss = the clean rows' "
            "criterion beside `eta` × the mixup criterion of the mixed rows, their mean over the doubled "
            "batch (`(CE + eta·mixup CE)/2`, as the authors' code trains), equal to the authors' training "
            "step on the same draws"
        ),
        workflows="all but TRL",
        example={"layer": "input", "alpha": 1.0},
    )

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 20.0,
        eta: float = 1.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        mode: str = "batch",
        batch_dim: int | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, mode=mode, batch_dim=batch_dim)
        self.eta = check_non_negative("eta", eta)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, eta={self.eta})"

    def targets_refused(self) -> str | None:
        if self.eta != 1:
            return f"weighs its mixed rows by eta={self.eta}, which the mixed targets cannot carry"
        return None

    def clean_terms(
        self,
        criterion: Callable,
        clean: torch.Tensor,
        mixed: torch.Tensor,
        target: torch.Tensor,
        last: MixState,
    ) -> torch.Tensor:
        return per_row(criterion(clean, target), self.mixed_loss(criterion, mixed, target, last), self.eta)

"""C-Mixup: mixup for regression, each sample's partner drawn with probability by label similarity.

Paper: Yao, Wang, Zhang, Zou, Finn. "C-Mixup: Improving Generalization in Regression." NeurIPS 2022.
https://arxiv.org/abs/2210.05775
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..engine.card import Card
from ..engine.checks import check_positive
from .manifold import ManifoldMixup


def partner_rates(labels: torch.Tensor, bandwidth: float) -> torch.Tensor:
    """``(B, B)`` float64: row ``i`` is the probability of each sample being ``i``'s partner,
    ``exp(-||y_i - y_j||^2 / (2 bandwidth^2))`` normalised over ``j`` (``i`` itself included), the
    authors' Gaussian kernel density rate (scikit-learn's ``KernelDensity``, whose constant cancels)."""
    y = labels.detach().to("cpu", torch.float64).reshape(labels.shape[0], -1)
    log = -torch.cdist(y, y).square() / (2 * bandwidth**2)
    return torch.softmax(log, dim=1)


def draw_partners(rates: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's partner by inverse transform of ``uniforms`` (one in [0, 1) per row): the index where the
    row's cumulative rate first exceeds it, as ``numpy.random.choice(p=...)`` picks from one uniform."""
    cdf = rates.cumsum(1)
    cdf = cdf / cdf[:, -1:]
    found = torch.searchsorted(cdf, uniforms.to(cdf.dtype).unsqueeze(1), right=True).squeeze(1)
    return found.clamp_(max=rates.shape[1] - 1)


class CMixup(ManifoldMixup):
    """C-Mixup (Yao et al. 2022): mixup for regression, each sample's partner drawn with probability
    proportional to a Gaussian kernel on the distance between their labels.

    On each training forward (with probability ``prob``): partner ``j`` of sample ``i`` is drawn from the
    batch with probability ``exp(-||y_i - y_j||^2 / (2 bandwidth^2))`` normalised over the batch (``i``
    itself included; with replacement, so a sample may be several partners), ``lam ~ Beta(alpha, alpha)``
    one per batch, and the layer's output ``h`` becomes ``lam * h + (1 - lam) * h[index]``, at the input
    (the paper) or any layer. The partners need the batch's labels: call ``use_targets(y)`` before every
    training forward (the app and the trainer adapters do). Train on the mixed labels, as the authors do
    (``mse(pred, mix.targets(y, dtype=pred.dtype, logits=pred))``); ``loss`` mixes the criterion instead.

    The authors' main sampler draws the partner from the whole training set; a hidden layer only sees the
    batch, so the partners here come from the batch: the authors' batch sampler
    (huaxiuyao/C-Mixup ``src/algorithm.py``, ``get_batch_kde_mixup_idx``), whose rates and draws this
    equals on the same uniforms. Labels are read on the host (one copy of ``B`` labels per mixed step).

    Args:
        layer, prob, generator, batch_dim, padding: as :class:`ManifoldMixup`.
        alpha: the Beta distribution's concentration, > 0 (authors: 2.0 on most data sets).
        bandwidth: the kernel's width in label units, > 0 (authors: per data set, 0.05 to 50; with
            standardised labels about 0.5 to 2).
    """

    card = Card(
        paper="Yao et al. 2022",
        mixes="regression: partners drawn by label distance",
        where="input, any layer; float targets",
        family="regression",
        signature="CMixup(layer, alpha=2.0, bandwidth=1.0)",
        hook="forward (labels via `use_targets(y)`)",
        commands=(
            "`data=diabetes model=mlp mixup=cmixup` (on class labels, e.g. digits, refused in one line "
            "before training)"
        ),
        details=(
            "Regression: partner `j` of `i` drawn from the batch with probability `∝ "
            "exp(-‖y_i-y_j‖²/(2·bandwidth²))` (with replacement), then `h' = lam*h + (1-lam)*h[index]`; "
            "train on `targets(y)` (MSE); rates and draws equal the authors' batch KDE sampler on the same "
            "uniforms"
        ),
        app=("data=diabetes", "model=mlp"),
        shown_on="mlp",
        example={"layer": "input", "alpha": 1.0},
    )

    index_is_permutation = False  # partners drawn with replacement

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 2.0,
        bandwidth: float = 1.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim=batch_dim, padding=padding)
        self.bandwidth = check_positive("bandwidth", bandwidth)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, bandwidth={self.bandwidth})"

    def check_targets(self, target: torch.Tensor) -> None:
        check_regression_labels(type(self).__name__, target)
        super().check_targets(target)  # (its policies')

    def before_forward(
        self, model: nn.Module, args: tuple, kwargs: dict, spec: str, pinned: Mapping, targets, generator
    ) -> Mapping:
        if "index" in pinned:
            return {}
        labels = check_regression_labels(type(self).__name__, targets)
        rates = partner_rates(labels, self.bandwidth)
        g = generator
        uniforms = torch.rand(labels.shape[0], generator=g, device=g.device, dtype=torch.float64)
        index = draw_partners(rates, uniforms.cpu())
        return {"index": index}  # drawn with replacement: not a permutation


def check_regression_labels(kind: str, targets) -> torch.Tensor:
    """The batch's regression labels ``(B,)`` or ``(B, d)``, or a one-line error."""
    if targets is None:
        raise RuntimeError(
            f"{kind} draws each sample's partner by label similarity, so it needs the batch's labels: call "
            f"{kind[0].lower()}{kind[1:]}.use_targets(y) before every training forward"
        )
    if (
        not isinstance(targets, torch.Tensor)
        or not targets.dtype.is_floating_point
        or targets.ndim not in (1, 2)
    ):
        what = (
            f"{targets.dtype} {tuple(targets.shape)}" if isinstance(targets, torch.Tensor) else type(targets)
        )
        raise ValueError(
            f"{kind} mixes regression targets: its labels must be floating values (B,) or (B, d), got {what} "
            "(class indices: use ManifoldMixup)"
        )
    if not bool(torch.isfinite(targets).all()):
        raise ValueError(f"{kind}: the labels hold NaN or infinite values; their distances are undefined")
    return targets

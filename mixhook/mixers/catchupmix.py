"""Catch-up Mix: at a random layer, each sample keeps the channels whose activation maps are relatively weak
beside its partner's and takes the rest (its relatively strong ones) from the partner; CutMix at the input.

Paper: Kang, Kang, Kim. "Catch-Up Mix: Catch-Up Class for Struggling Filters in CNN." AAAI 2024.
https://arxiv.org/abs/2401.13193. No code from the authors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..engine.card import Card
from ..engine.checks import check_region
from ..engine.contract import Draw, Mixed
from ..engine.regions import RegionMixer
from ..functional import gather_rows, sample_lam
from ..sites import INPUT, Leaf
from ..transfer import to_device
from .cutmix import draw_region, pasted


def relative_influence(h: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each channel's relative filter influence in each sample of ``h`` (``(B, C, ...)``): its activation
    map's l2 norm as a share of the sample's channels' norms, less the same share in the partner
    ``index[i]``; ``(B, C)``, detached, in float32 at least."""
    h = h.detach()
    norms = h.to(torch.promote_types(h.dtype, torch.float32)).flatten(2).norm(dim=2)
    share = norms / norms.sum(1, keepdim=True).clamp_min(torch.finfo(norms.dtype).tiny)
    return share - share[index]


def kept_channels(rfi: torch.Tensor, count: int) -> torch.Tensor:
    """The ``(B, C)`` boolean mask of the ``count`` channels of lowest relative influence in each row (ties:
    the lower channel first)."""
    order = torch.argsort(rfi, dim=1, stable=True)
    kept = torch.zeros_like(rfi, dtype=torch.bool)
    return kept.scatter_(1, order[:, :count], True)


class CatchUpMix(RegionMixer):
    """Catch-up Mix (Kang et al. 2024) at a layer drawn per batch from ``layer`` (the paper: the input and
    each block of the network).

    At a hidden layer with a ``(B, C, ...)`` output (maps of any number of positions; layouts read as the
    region methods read them): ``lam ~ Beta(alpha, alpha)``, a permutation ``index``; each channel's
    **relative filter influence** in sample ``i`` is the l2 norm of its activation map as a share of the
    sample's channels' norms, less that share in its partner::

        RFI_ic = ||h_ic|| / sum_c' ||h_ic'|| - ||h_jc|| / sum_c' ||h_jc'||,   j = index[i]

    sample ``i`` keeps its own maps in the ``floor(lam * C)`` channels of lowest ``RFI_i`` (where it lags
    behind its partner) and takes its partner's in the rest (where it is strong, so the filters that lag
    behind are the ones the mixed sample is trained through); the own label weighs ``floor(lam * C) / C``
    (the fraction of channels kept; the masks are computed without gradients). At ``"input"``: CutMix
    (the paper's layer 0), a box of area about ``1 - lam``, lam corrected to the area kept.
    ``.last.info["kept"]``: the ``(B, C)`` channels kept (``["box"]`` at the input).

    **Reconstructed, not checked against the paper's equations**: its method section could not be read
    where this was written and the authors published no code. The rule follows the abstract and Figure 2
    ("we compare the magnitudes of activation maps using their l2 norms; a mask M is generated to mix the
    activation maps from the selected pair with relatively low l2 norms") as a third-party
    reimplementation makes it precise (allthemix's ``catchup_mix_features``: the same relative influence,
    ``floor(lam * C)`` own channels of lowest influence). The one difference from it: there the labels
    weigh the drawn lam, here the fraction of channels kept. Check it against the paper before quoting it.

    Args:
        layer: ``"input"`` and/or layers with ``(B, C, ...)`` outputs, one drawn per batch.
        alpha: Beta concentration, > 0.
        prob, generator, batch_dim, padding, layout: as :class:`~mixhook.CutMix`.

    ``pin`` also takes ``box`` (at the input, as :class:`~mixhook.CutMix`).
    """

    card = Card(
        paper="Kang et al. 2024",
        mixes="the channels where a sample lags its partner",
        where="input, any layer",
        family="feature",
        signature="CatchUpMix(layer, alpha=1.0)",
        hook="forward, `(B,C,...)` outputs, a layer drawn per batch",
        commands="`mixup=catchupmix`",
        details=(
            "At a hidden layer each sample keeps its own maps in the `floor(lam·C)` channels of lowest "
            "relative filter influence `RFI_ic = ‖h_ic‖/Σ‖h_i·‖ - ‖h_jc‖/Σ‖h_j·‖` (where it lags behind its "
            "partner `j`) and takes the partner's in the rest; lam ← `floor(lam·C)/C`; CutMix at `input`. "
            "**Reconstructed** from the abstract and Figure 2 with a third-party reimplementation "
            "(allthemix): the paper's method section could not be read here and the authors published no "
            "code; the rule is written out in the test"
        ),
        example={"layer": ["input", "conv1"]},
        drawn={"note": "\n(its channel rule on the RGB layer)"},
    )

    pin_keys = ("box",)
    region_dims = (1, 2, 3)

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 1.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout)

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return sample_lam(self.alpha, generator)

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        h = check_region("CatchUpMix", spec, leaves, self.region_dims)
        if self.sites[spec].layer == INPUT:
            if min(h.shape[2:]) < 2:
                raise ValueError(f"CatchUpMix at {spec!r}: its input is too small to ever paste a box")
        elif h.shape[1] < 2:
            raise ValueError(f"CatchUpMix at {spec!r}: one channel cannot be split between two samples")

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        if draw.lam.ndim:
            raise ValueError(f"CatchUpMix draws one lam per batch: pin one lam, not {draw.lam.shape[0]}")
        shape = tuple(h.shape[2:])
        if self.sites[draw.layer].layer == INPUT:  # CutMix at the input (the paper's layer 0)
            return pasted(h, path, draw.index, draw_region(draw, shape))
        index = to_device(draw.index, h.device)
        channels = h.shape[1]
        count = math.floor(float(draw.lam) * channels)
        kept = kept_channels(relative_influence(h, index), count)
        mixed = torch.where(kept.view(*kept.shape, *[1] * len(shape)), h, gather_rows(h, index))
        lam = torch.tensor(count / channels, dtype=torch.float64)
        return Mixed({path: mixed}, lam=lam, info={"kept": kept})  # (on the map's device: no host read)

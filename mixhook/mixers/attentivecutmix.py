"""Attentive CutMix at any layer with two spatial dimensions (or on a ViT's tokens): the partner's most
salient grid cells pasted at the same places.

Paper: Walawalkar, Shen, Liu, Savvides. "Attentive CutMix: An Enhanced Data Augmentation Approach for
Deep Learning Based Image Classification." ICASSP 2020. https://arxiv.org/abs/2003.13048. Authors' code:
github.com/xden2331/attentive_cutmix (``attentive_transform.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.card import Card
from ..engine.checks import check_grid, check_spatial
from ..engine.contract import Draw, Mixed
from ..engine.regions import RegionMixer
from ..engine.saliency import Saliency, SaliencyGuided, pinned_saliency
from ..geometry import cell_index, grid_mask
from ..sites import Leaf
from ..transfer import to_device
from .gridmix import check_grid_fits


def cell_scores(saliency: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The mean saliency of each cell of a ``rows x cols`` grid (:func:`~mixhook.geometry.cell_index`)
    over ``(B, H, W)`` maps: ``(B, rows, cols)`` float64, on the maps' device."""
    n, height, width = saliency.shape
    cell = (cell_index(height, rows)[:, None] * cols + cell_index(width, cols)[None, :]).flatten()
    counts = torch.bincount(cell, minlength=rows * cols).to(torch.float64)
    sums = torch.zeros(n, rows * cols, dtype=torch.float64, device=saliency.device)
    sums.index_add_(1, to_device(cell, saliency.device), saliency.to(torch.float64).flatten(1))
    return (sums / to_device(counts, saliency.device)).view(n, rows, cols)


def top_cells(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``(B, rows, cols)`` bool: True on each map's ``k`` highest cells (ties to the lower index)."""
    n, rows, cols = scores.shape
    order = torch.sort(scores.flatten(1), dim=1, descending=True, stable=True).indices[:, :k]
    cells = torch.zeros(n, rows * cols, dtype=torch.bool, device=scores.device)
    cells.scatter_(1, order, True)
    return cells.view(n, rows, cols)


class AttentiveCutMix(SaliencyGuided, RegionMixer):
    """Attentive CutMix (Walawalkar et al. 2020) at any layer whose output is ``(B, C, H, W)`` (or, with
    ``tokens``, a ViT block's tokens), with saliency from the same forward or a gradient pass.

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``, a permutation
    ``index``, and the saliency ``S`` of every sample's map (:mod:`mixhook.engine.saliency`); the map is
    cut into a ``grid`` of cells, each scored by its mean saliency, and the ``top_k`` cells of the
    partner's map are pasted into the sample at the same places (one pattern per sample):

        ``h'_i = M_i * h_i + (1 - M_i) * h_index[i]``,   ``M_i`` = 0 on the partner's top cells

    lam (one per sample: ``loss`` needs a per-sample criterion, ``reduction="none"``) is ``mean(M_i)``,
    the area kept; no lam is drawn (``top_k`` fixes the area). ``.last.info["cells"]`` is the
    ``(B, rows, cols)`` bool pattern (True: the sample's own), ``["mask"]`` the ``(B, H, W)`` masks,
    ``["saliency"]`` the maps.

    The paper scores a pre-trained ResNet-50's last 7x7 feature map of the image; here the scores come
    from the model being trained (``saliency="activation"`` at a hidden layer, no extra pass, or
    ``"gradient"``, anywhere; see :class:`~mixhook.SaliencyMix`). The authors' released code ranks the
    cells by the feature map's last channel alone; this ranks them by the channel mean the paper
    describes. (OpenMixup's ``attentivemix`` keeps the sample's own top cells instead.)

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output ``(B, C, H, W)``
            with at least ``grid`` pixels along each side.
        grid: cells along each side, an int or ``(rows, columns)`` (the paper: 7).
        top_k: how many of the partner's cells are pasted, from 1 to cells - 1 (the paper: 6).
        saliency, saliency_layer: the saliency source, as :class:`~mixhook.SaliencyMix`.
        prob, generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout, tokens, prefix: as :class:`~mixhook.engine.regions.RegionMixer` (maps in any layout, a
            ViT's tokens as maps).

    ``pin`` also takes ``saliency`` (``(B, H, W)``).
    """

    card = Card(
        paper="Walawalkar et al. 2020",
        mixes="the partner's most attended cells",
        where="input, any map, ViT tokens",
        family="saliency",
        traits=("tokens",),
        signature='AttentiveCutMix(layer, grid=7, top_k=6, saliency="activation", saliency_layer=None)',
        hook='forward, `(B,C,H,W)` outputs or ViT tokens (+ one forward/backward for `"gradient"`)',
        commands="`mixup=attentivecutmix`",
        details=(
            "The map cut into `grid` cells scored by mean saliency (sources as SaliencyMix); the partner's "
            "`top_k` cells pasted at the same places, one pattern per sample; lam ← kept area, one per "
            "sample (no lam drawn); top-k selection equal to OpenMixup's on the same map; the authors' code "
            "ranks by the last channel only, this by the channel mean the paper describes; "
            '`.last.info["cells"]`, `["mask"]`, `["saliency"]`'
        ),
        example={"layer": "conv1", "grid": 4, "top_k": 3},
        drawn={"grid": 4, "top_k": 6},
    )

    pin_keys = ("saliency",)

    def __init__(
        self,
        layer: str | Sequence[str],
        grid: int | Sequence[int] = 7,
        top_k: int = 6,
        saliency: str = "activation",
        saliency_layer: str | None = None,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, 1.0, prob, generator, batch_dim, padding, layout, tokens, prefix)
        self.saliency = Saliency("AttentiveCutMix", saliency, saliency_layer, self.layers)
        self.grid = check_grid(grid)
        cells = self.grid[0] * self.grid[1]
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k < cells:
            raise ValueError(
                f"top_k must be an int from 1 to {cells - 1} (the grid's cells - 1), got {top_k!r}"
            )
        self.top_k = top_k

    def __repr__(self) -> str:
        base = super().__repr__()[:-1].replace(", alpha=1.0", "")
        return f"{base}, grid={self.grid}, top_k={self.top_k}, {self.saliency!r})"

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.ones((), dtype=torch.float64)  # unused: top_k sets the area

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        check_grid_fits("AttentiveCutMix", spec, check_spatial("AttentiveCutMix", spec, leaves), self.grid)

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        n, height, width = h.shape[0], h.shape[-2], h.shape[-1]
        # on the map's device: the cells are ranked and the masks made there, never read on the host
        saliency = pinned_saliency("AttentiveCutMix", draw.pinned, n, height, width, h.device)
        index = to_device(draw.index, h.device)
        rows, cols = self.grid
        cells = ~top_cells(cell_scores(saliency[index], rows, cols), self.top_k)
        mask = grid_mask(cells, height, width)
        m = mask.to(h.dtype)[:, None]
        mixed = m * h + (1 - m) * h[index]
        info = {"cells": cells, "mask": mask, "saliency": saliency}
        return Mixed({path: mixed}, lam=mask.flatten(1).mean(1), info=info, weights=mask)

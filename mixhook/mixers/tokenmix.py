"""TokenMix at any layer with two spatial dimensions or on a ViT's tokens: a mask of whole tokens (blocks
of them, or scattered), each from the sample or its partner.

Paper: Liu, Liu, Zhou, Li, Liu. "TokenMix: Rethinking Image Mixing for Data Augmentation in
Vision Transformers." ECCV 2022. https://arxiv.org/abs/2207.08409. Authors' code: github.com/Sense-X/TokenMix
(the mask generators as carried into OpenMixup's ``openmixup/models/augments/tokenmix.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.card import Card
from ..engine.checks import check_grid, check_spatial
from ..engine.contract import Draw
from ..engine.regions import MaskMixer
from ..geometry import block_token_mask, grid_mask, random_token_mask
from ..hooks import Planned
from ..sites import Leaf
from .gridmix import check_pinned_cells

MASK_TYPES = ("block", "random")


class TokenMix(MaskMixer):
    """TokenMix (Liu et al. 2022): whole tokens from the partner, at the input, at a ``(B, C, H, W)`` layer
    or on a ViT block's tokens (``tokens=(gh, gw)`` or ``"auto"``).

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``,
    ``lam ~ Beta(alpha, alpha)``, a permutation ``index`` and a token mask on a ``grid`` of cells (one
    cell per pixel, or per patch token, by default): ``min(N, int((1 - lam) * N) + extra_tokens)`` of the
    ``N`` cells are to come from the partner, as blocks (``mask_type="block"``,
    :func:`~mixhook.geometry.block_token_mask`) or scattered (``"random"``,
    :func:`~mixhook.geometry.random_token_mask`); one mask for the
    batch:

        ``h' = M * h + (1 - M) * h[index]``,   ``M`` = 0 on the partner's cells, 1 elsewhere

    ``loss`` and ``targets`` use ``lam = mean(M)``, the fraction of the map (of the patch tokens) the
    sample keeps. (The paper weighs the labels by a pre-trained teacher's activation over the mask, a
    second network outside a hook's reach; the area rule is what the method is without it.)
    ``.last.info["cells"]`` is the ``(gh, gw)`` bool pattern (True: the sample's own), ``["mask"]`` is
    ``M``.

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output ``(B, C, H, W)``
            (or, with ``tokens``, ``(B, T, D)``) with at least ``grid`` pixels along each side.
        alpha: Beta concentration, > 0 (default 1.0).
        grid: the cells of the mask, an int or ``(rows, columns)``, e.g. the patch grid ``(14, 14)`` at
            the input of a ViT/16 on 224 px images; ``None`` (default): one cell per pixel or token.
        mask_type: ``"block"`` (default, the paper's) or ``"random"``.
        extra_tokens: cells mixed beyond ``int((1 - lam) * N)``, >= 0 (default 0; the authors' runs add
            ``mask_token_num_start=14`` on their 14x14 grid: ``extra_tokens=14`` reproduces them).
        prob, generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout, tokens, prefix: as :class:`~mixhook.engine.regions.RegionMixer` (maps in any layout, a
            ViT's tokens as maps).

    ``pin`` also takes ``cells`` (a ``(gh, gw)`` tensor of 0/1 or bools, 1: the sample's own).
    """

    card = Card(
        paper="Liu et al. 2022",
        mixes="a mask of whole cells or patch tokens",
        where="input, any map, ViT tokens",
        family="region",
        traits=("tokens",),
        signature='TokenMix(layer, alpha=1.0, grid=None, mask_type="block", extra_tokens=0)',
        hook="forward, `(B,C,H,W)` outputs or ViT tokens",
        commands="`mixup=tokenmix mixup.layer=layer1`",
        details=(
            "A mask of whole cells (one per pixel or patch token, or a `grid`): `min(N, int((1-lam)N) + "
            'extra_tokens)` of the `N` cells from `h[index]`, as blocks of log-uniform aspect (`"block"`) or '
            'scattered (`"random"`), one mask per batch; lam ← kept area; masks equal the authors\' '
            "generators on the same draws (their runs: `extra_tokens=14`); labels by area, not by the "
            'paper\'s teacher; `.last.info["cells"]`, `["mask"]`'
        ),
        example={"layer": "input", "grid": 4},
    )

    pin_keys = ("cells",)
    checks_by_signature = True  # (the map's sides, and the grid)
    grid = Planned()

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 1.0,
        grid: int | Sequence[int] | None = None,
        mask_type: str = "block",
        extra_tokens: int = 0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout, tokens, prefix)
        self.grid = None if grid is None else check_grid(grid)
        if mask_type not in MASK_TYPES:
            raise ValueError(f"mask_type must be one of {', '.join(MASK_TYPES)}, got {mask_type!r}")
        if isinstance(extra_tokens, bool) or not isinstance(extra_tokens, int) or extra_tokens < 0:
            raise ValueError(f"extra_tokens must be an int >= 0, got {extra_tokens!r}")
        self.mask_type = mask_type
        self.extra_tokens = extra_tokens

    def __repr__(self) -> str:
        extra = f"grid={self.grid}, mask_type={self.mask_type!r}, extra_tokens={self.extra_tokens}"
        return f"{super().__repr__()[:-1]}, {extra})"

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        h = check_spatial("TokenMix", spec, leaves)
        rows, cols = self.grid or h.shape[-2:]
        if h.shape[-2] < rows or h.shape[-1] < cols or rows * cols < 2:
            raise ValueError(
                f"TokenMix at {spec!r}: its {h.shape[-2]}x{h.shape[-1]} map cannot hold a {rows}x{cols} "
                "grid of at least 2 cells; choose an earlier layer or a smaller grid"
            )

    def draw_mask(self, h: torch.Tensor, draw: Draw) -> tuple[torch.Tensor, dict]:
        height, width = h.shape[-2:]
        if draw.lam.ndim:
            raise ValueError(f"TokenMix cuts one mask per batch: pin one lam, not {draw.lam.shape[0]}")
        rows, cols = self.grid or (height, width)
        cells = draw.pinned.get("cells")
        if cells is None:
            n = rows * cols
            count = min(n, int((1 - float(draw.lam)) * n) + self.extra_tokens)
            make = block_token_mask if self.mask_type == "block" else random_token_mask
            cells = ~make(rows, cols, count, draw.generator)
        else:
            cells = check_pinned_cells(cells, rows, cols)
        return grid_mask(cells, height, width), {"cells": cells}

"""GridMix at any layer with two spatial dimensions: the map cut into a grid, each cell from one sample.

Paper: Baek, Bang, Shim. "GridMix: Strong regularization through local context mapping." Pattern
Recognition 109, 2021. No code from the authors is public. (OpenMixup's ``gridmix``, taken from
IlyaDobrynin/GridMixup, is another mask under the same name: GridMask-style holes inside one box.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..sites import Leaf
from ..transfer import to_device
from .base import Mixer
from .checks import check_spatial
from .contract import Draw
from .masked import MaskedMix
from .tokens import token_grid


def cell_index(size: int, cells: int) -> torch.Tensor:
    """For each of ``size`` pixels, the cell it falls in when the side is cut into ``cells`` parts at
    ``floor(c * size / cells)``, ``c = 0..cells`` (cells differ by at most one pixel)."""
    edges = torch.arange(cells + 1) * size // cells
    return torch.searchsorted(edges, torch.arange(size), right=True) - 1


def grid_mask(cells: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The ``(height, width)`` float64 mask that gives every pixel the value of its cell in ``cells``
    (``(gh, gw)``, or ``(B, gh, gw)`` for one mask per sample; 1 = the sample's own, 0 = its partner's)."""
    gh, gw = cells.shape[-2:]
    rows, cols = (to_device(cell_index(size, n), cells.device) for size, n in ((height, gh), (width, gw)))
    return cells.to(torch.float64)[..., rows, :][..., cols]


class GridMix(MaskedMix, Mixer):
    """GridMix (Baek et al. 2021) at the input or at any layer whose output is ``(B, C, H, W)``.

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``,
    ``lam ~ Beta(alpha, alpha)`` and a permutation ``index``; the map is cut into a ``grid`` of cells
    (:func:`cell_index`) and ``round(lam * cells)`` of them, drawn uniformly, stay the sample's own, the
    others come whole from its partner (one cell pattern for the batch):

        ``h' = M * h + (1 - M) * h[index]``,   ``M`` = 1 on the kept cells

    ``loss`` and ``targets`` use ``lam = mean(M)``, the fraction of pixels kept (cells at uneven sizes
    included). ``.last.info["cells"]`` is the ``(gh, gw)`` bool pattern (True: the sample's own), from
    which a loop can build the paper's patch-level labels for its local context loss (a head of the
    model, not a hook); ``["mask"]`` is ``M``.

    This follows the paper's description (its code is not public); the cell count drawn from lam, as
    the kept area of CutMix and FMix is, is mixhook's reading.

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output ``(B, C, H, W)``
            with at least ``grid`` pixels along each side.
        alpha: Beta concentration, > 0 (default 1.0).
        grid: the number of cells along each side: an int (square) or ``(rows, columns)``, each >= 1,
            with at least 2 cells in all (default 4: 4 x 4 cells).
        prob, generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout: ``"NHWC"`` or ``"NCHW"`` (or a dict per layer) for a 4-D map whose layout the model
            does not state; where it does, it is read (a contradicting one is refused): see
            :mod:`mixhook.layouts`.
        tokens, prefix: on ``(B, T, D)`` tokens (a ViT block), the patch grid ``(rows, columns)`` or
            ``"auto"`` and the rule for the leading tokens; see :mod:`mixhook.mixers.tokens`.

    ``pin`` also takes ``cells`` (a ``(gh, gw)`` tensor of 0/1 or bools).
    """

    pin_keys = ("cells",)

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 1.0,
        grid: int | Sequence[int] = 4,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout=layout)
        self.token_grid = token_grid(tokens, prefix, "GridMix")
        self.grid = _grid(grid)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, grid={self.grid})"

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        check_grid_fits("GridMix", spec, check_spatial("GridMix", spec, leaves), self.grid)

    def draw_mask(self, h: torch.Tensor, draw: Draw) -> tuple[torch.Tensor, dict]:
        height, width = h.shape[-2:]
        if draw.lam.ndim:
            raise ValueError(f"GridMix cuts one grid per batch: pin one lam, not {draw.lam.shape[0]}")
        gh, gw = self.grid
        cells = draw.pinned.get("cells")
        if cells is None:
            n = gh * gw
            g = draw.generator
            kept = torch.randperm(n, generator=g, device=g.device).cpu()[
                : math.floor(float(draw.lam) * n + 0.5)
            ]
            cells = torch.zeros(n, dtype=torch.bool)
            cells[kept] = True
            cells = cells.view(gh, gw)
        else:
            cells = check_pinned_cells(cells, gh, gw)
        return grid_mask(cells, height, width), {"cells": cells}


def check_grid_fits(kind: str, spec: str, h: torch.Tensor, grid: tuple[int, int]) -> None:
    """A one-line ``ValueError`` unless ``h``'s map has at least ``grid`` pixels along each side."""
    if h.shape[-2] < grid[0] or h.shape[-1] < grid[1]:
        raise ValueError(
            f"{kind} at {spec!r}: its {h.shape[-2]}x{h.shape[-1]} map has fewer pixels than the "
            f"{grid[0]}x{grid[1]} grid has cells along a side; choose an earlier layer or a smaller grid"
        )


def check_pinned_cells(cells, rows: int, cols: int) -> torch.Tensor:
    """Pinned ``(rows, cols)`` cells of 0/1 (or bools) as a bool CPU tensor, or a one-line ``ValueError``."""
    cells = torch.as_tensor(cells).cpu()
    if tuple(cells.shape) != (rows, cols) or not bool(((cells == 0) | (cells == 1)).all()):
        raise ValueError(
            f"pinned cells must be a {rows}x{cols} tensor of 0/1, got shape {tuple(cells.shape)}"
        )
    return cells.to(torch.bool)


def _grid(grid) -> tuple[int, int]:
    values = (grid, grid) if isinstance(grid, int) and not isinstance(grid, bool) else grid
    try:
        gh, gw = values
    except (TypeError, ValueError):
        raise ValueError(f"grid must be an int or two ints (rows, columns), got {grid!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (gh, gw)) or gh * gw < 2:
        raise ValueError(f"grid must be ints >= 1 with at least 2 cells in all, got {grid!r}")
    return gh, gw

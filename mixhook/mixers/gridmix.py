"""GridMix at any layer with a 2-D (or 1-D, 3-D) map: the map cut into a grid, each cell from one sample.

Paper: Baek, Bang, Shim. "GridMix: Strong regularization through local context mapping." Pattern
Recognition 109, 2021. No code from the authors is public. (OpenMixup's ``gridmix``, taken from
IlyaDobrynin/GridMixup, is another mask under the same name: GridMask-style holes inside one box.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..engine.card import Card
from ..engine.checks import check_grid, check_region, map_size
from ..engine.contract import Draw
from ..engine.regions import MaskMixer
from ..geometry import grid_volume
from ..hooks import Planned
from ..sites import Leaf


class GridMix(MaskMixer):
    """GridMix (Baek et al. 2021) at the input or at any layer whose output is ``(B, C, H, W)`` (or a 1-D
    ``(B, C, L)`` or 3-D ``(B, C, D, H, W)`` map: segments or boxes of a grid along each dimension).

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``,
    ``lam ~ Beta(alpha, alpha)`` and a permutation ``index``; the map is cut into a ``grid`` of cells
    (:func:`~mixhook.geometry.cell_index`) and ``round(lam * cells)`` of them, drawn uniformly, stay the
    sample's own, the others come whole from its partner (one cell pattern for the batch):

        ``h' = M * h + (1 - M) * h[index]``,   ``M`` = 1 on the kept cells

    ``loss`` and ``targets`` use ``lam = mean(M)``, the fraction of pixels kept (cells at uneven sizes
    included). ``.last.info["cells"]`` is the ``(gh, gw)`` bool pattern (True: the sample's own), from
    which a loop can build the paper's patch-level labels for its local context loss (a head of the
    model, not a hook); ``["mask"]`` is ``M``.

    This follows the paper's description (its code is not public); the cell count drawn from lam, as
    the kept area of CutMix and FMix is, is mixhook's reading.

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output a map with at
            least ``grid`` positions along each side.
        alpha: Beta concentration, > 0 (default 1.0).
        grid: the number of cells along each side: an int (the same along every side) or
            ``(rows, columns)`` (on a 1-D or 3-D map one or three counts), each >= 1, with at least 2
            cells in all (default 4: 4 x 4 cells; 4 segments of a 1-D map, 4 x 4 x 4 of a 3-D one).
        prob, generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout, tokens, prefix: as :class:`~mixhook.engine.regions.RegionMixer` (maps in any layout, a
            ViT's tokens as maps).

    ``pin`` also takes ``cells`` (a ``(gh, gw)`` tensor of 0/1 or bools; one count per dimension).
    """

    card = Card(
        paper="Baek et al. 2021",
        mixes="grid cells from either sample",
        where="input, any map, ViT tokens",
        family="region",
        traits=("tokens",),
        signature="GridMix(layer, alpha=1.0, grid=4)",
        hook="forward, `(B,C,H,W)` outputs (or `(B,C,L)`, `(B,C,D,H,W)`) or ViT tokens",
        commands="`mixup=gridmix mixup.layer=layer1`",
        details=(
            "The map cut into `grid` cells a side; `round(lam*cells)` cells (drawn uniformly, one pattern "
            "per batch) keep `h`, the rest come whole from `h[index]`; lam ← kept area; the paper's "
            "description (no authors' code; OpenMixup's `gridmix` is a different mask); "
            '`.last.info["cells"]` for patch labels, `["mask"]`'
        ),
        example={"layer": "input", "grid": 2},
    )

    pin_keys = ("cells",)
    checks_by_signature = True  # (the map's kind and sides, and the grid)
    grid = Planned()
    region_dims = (1, 2, 3)

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
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout, tokens, prefix)
        self._side = grid if isinstance(grid, int) and not isinstance(grid, bool) else None
        nd = isinstance(grid, (tuple, list)) and len(grid) in (1, 3)  # a 1-D or 3-D map's counts
        self.grid = _counts(grid) if nd else check_grid(grid)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, grid={self.grid})"

    def cells_of(self, h: torch.Tensor) -> tuple[int, ...]:
        """The cell counts along each dimension of the map ``h``."""
        return (self._side,) * (h.ndim - 2) if self._side is not None else self.grid

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        h = check_region("GridMix", spec, leaves, self.region_dims)
        counts = self.cells_of(h)
        if len(counts) != h.ndim - 2:
            raise ValueError(
                f"GridMix at {spec!r}: grid={self.grid} gives {len(counts)} cell counts, but the map is "
                f"{h.ndim - 2}-D ({map_size(h)}); give one count per dimension, or one int for all"
            )
        if any(size < n for size, n in zip(h.shape[2:], counts, strict=True)):
            what = "pixels" if h.ndim == 4 else "positions"
            raise ValueError(
                f"GridMix at {spec!r}: its {map_size(h)} map has fewer {what} than the "
                f"{'x'.join(map(str, counts))} grid has cells along a side; choose an earlier layer or a "
                "smaller grid"
            )

    def draw_mask(self, h: torch.Tensor, draw: Draw) -> tuple[torch.Tensor, dict]:
        if draw.lam.ndim:
            raise ValueError(f"GridMix cuts one grid per batch: pin one lam, not {draw.lam.shape[0]}")
        counts = self.cells_of(h)
        cells = draw.pinned.get("cells")
        if cells is None:
            n = math.prod(counts)
            g = draw.generator
            kept = torch.randperm(n, generator=g, device=g.device).cpu()[
                : math.floor(float(draw.lam) * n + 0.5)
            ]
            cells = torch.zeros(n, dtype=torch.bool)
            cells[kept] = True
            cells = cells.view(*counts)
        else:
            cells = check_pinned_cells(cells, *counts)
        return grid_volume(cells, tuple(h.shape[2:])), {"cells": cells}


def check_grid_fits(kind: str, spec: str, h: torch.Tensor, grid: tuple[int, int]) -> None:
    """A one-line ``ValueError`` unless ``h``'s map has at least ``grid`` pixels along each side."""
    if h.shape[-2] < grid[0] or h.shape[-1] < grid[1]:
        raise ValueError(
            f"{kind} at {spec!r}: its {h.shape[-2]}x{h.shape[-1]} map has fewer pixels than the "
            f"{grid[0]}x{grid[1]} grid has cells along a side; choose an earlier layer or a smaller grid"
        )


def check_pinned_cells(cells, *counts: int) -> torch.Tensor:
    """Pinned cells of 0/1 (or bools), ``(rows, cols)`` (one count per dimension), as a bool CPU tensor,
    or a one-line ``ValueError``."""
    cells = torch.as_tensor(cells).cpu()
    if tuple(cells.shape) != counts or not bool(((cells == 0) | (cells == 1)).all()):
        raise ValueError(
            f"pinned cells must be a {'x'.join(map(str, counts))} tensor of 0/1, got shape "
            f"{tuple(cells.shape)}"
        )
    return cells.to(torch.bool)


def _counts(grid) -> tuple[int, ...]:
    """GridMix's ``grid`` given as counts: 1 to 3 ints >= 1 with at least 2 cells in all (else one line)."""
    try:
        counts = tuple(grid)
    except TypeError:
        counts = ()
    if (
        not 1 <= len(counts) <= 3
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in counts)
        or math.prod(counts) < 2
    ):
        raise ValueError(
            f"grid must be an int >= 2 or one to three ints >= 1 (cells along each dimension) with at "
            f"least 2 cells in all, got {grid!r}"
        )
    return counts

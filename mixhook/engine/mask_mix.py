"""The region methods whose mix is one mask blend: ``M * h + (1 - M) * h[index]``, ``M`` drawn on the host.

FMix, GridMix, SmoothMix and TokenMix differ only in how they draw the ``(H, W)`` mask ``M`` (``(L,)``
or ``(D, H, W)`` on a 1-D or 3-D map) of
own-content weights (:meth:`MaskedMix.draw_mask`); the blend, what ``loss``/``targets`` use
(``lam = mean(M)``, the dense targets' weights ``M``) and the one-graph path under torch.compile
(:mod:`.traced`: the mask packed with the index, blended in the graph) are shared here.
"""

from __future__ import annotations

import torch

from ..functional import mask_blend
from ..sites import Leaf
from .contract import Draw, Mixed


class MaskedMix:
    """Mix by a mask drawn on the host: a method implements :meth:`draw_mask` (a :class:`~.mixer.Mixer`
    subclass lists this class first)."""

    def draw_mask(self, h: torch.Tensor, draw: Draw) -> tuple[torch.Tensor, dict]:
        """The ``(H, W)`` (``(L,)``, ``(D, H, W)``) float64 CPU mask of one mix of the map ``h`` (1: the
        sample's own content),
        pinned or drawn from ``draw.generator``, and what :attr:`MixState.info` records beside it."""
        raise NotImplementedError

    def _masked(self, leaves: list[Leaf], draw: Draw) -> tuple[torch.Tensor, Mixed]:
        mask, info = self.draw_mask(leaves[0].tensor, draw)
        weights = mask[None] if mask.ndim == leaves[0].tensor.ndim - 2 else None
        return mask, Mixed({}, lam=mask.mean(), info={**info, "mask": mask}, weights=weights)

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        mask, mixed = self._masked(leaves, draw)
        h, path = leaves[0].tensor, leaves[0].path
        return Mixed({path: mask_blend(h, mask, draw.index)}, mixed.lam, mixed.info, weights=mixed.weights)

    def traced_params(self, n: int, leaves: list[Leaf]) -> list:
        return [((n,), torch.int64), (tuple(leaves[0].tensor.shape[2:]), torch.float64)]  # index, mask

    def draw_traced(self, leaves: list[Leaf], draw: Draw) -> tuple[list[torch.Tensor], Mixed]:
        mask, mixed = self._masked(leaves, draw)
        return [draw.index, mask], mixed

    def mix_traced(self, leaves: list[Leaf], values: list[torch.Tensor]) -> dict:
        index, mask = values
        return {leaves[0].path: mask_blend(leaves[0].tensor, mask, index)}

"""The bases of the region methods: :class:`RegionMixer` (maps cut by position, in any layout, and a ViT's
tokens as maps) and :class:`MaskMixer` (a region method whose mix is one mask blend,
``M * h + (1 - M) * h[index]``, ``M`` drawn on the host by one function that serves the eager and the
compiled path alike).

Where a region goes is a pure function of :mod:`mixhook.geometry` (boxes, grids, Fourier, Gaussian and
token masks): a method draws its region there, and these bases do the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..functional import mask_blend
from ..sites import Leaf
from .checks import check_region
from .contract import Draw, Mixed
from .mixer import Mixer
from .tokens import token_grid


class RegionMixer(Mixer):
    """The base of the methods that cut maps by position (CutMix, FMix, GridMix, SmoothMix, TokenMix,
    PatchUp, ResizeMix, SaliencyMix, AttentiveCutMix).

    What they share is here, once: a map is cut in its own layout (a ``(B, H, W, C)`` map is given as its
    ``(B, C, H, W)`` view, and a map whose layout cannot be told is refused: :mod:`mixhook.layouts`), and a
    ViT block's ``(B, T, D)`` tokens are given as the ``(B, D, gh, gw)`` map of their patch grid
    (:mod:`.tokens`), the mixed map put back into the tokens.

    Args:
        layer, alpha, prob, generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout: ``"NHWC"``/``"NCHW"`` for a 4-D map, ``"NCL"``/``"NLC"`` for a 3-D one,
            ``"NCDHW"``/``"NDHWC"`` for a 5-D one (those the method cuts: :attr:`region_dims`), or a dict
            per layer, for a map whose layout the model does not state (``None``, default: read from the
            model or PyTorch's convention, else refused in one line); one that contradicts what the model
            states is refused (:mod:`mixhook.layouts`).
        tokens: on ``(B, T, D)`` tokens (a ViT block), the patch grid ``(rows, columns)``, or ``"auto"``
            (read from a timm or HuggingFace ViT); ``None`` (default): maps only.
        prefix: the leading tokens ahead of the patch grid (class, distillation, registers):
            ``"blend"`` (default: ``lam * t + (1 - lam) * t[index]`` with the lam the targets get) or
            ``"keep"`` (each sample keeps its own); see :mod:`.tokens`.
    """

    layout_aware = True

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 1.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        layout: str | dict | None = None,
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout=layout)
        self.token_grid = token_grid(tokens, prefix, type(self).__name__)

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        """One map with :attr:`region_dims` position dimensions, batch first, or a one-line ``TypeError``
        (a method adds its own conditions: a map too small for its regions)."""
        check_region(type(self).__name__, spec, leaves, self.region_dims)


class MaskMixer(RegionMixer):
    """A region method whose mix is one mask blend: ``M * h + (1 - M) * h[index]``, the ``(H, W)`` mask
    ``M`` (``(L,)`` or ``(D, H, W)`` on a 1-D or 3-D map) of own-content weights drawn on the host by
    :meth:`draw_mask`, the method's one function. The blend, what ``loss``/``targets`` use
    (``lam = mean(M)``, the dense targets' weights ``M``) and the one-graph path under torch.compile (the
    mask packed with the index, blended in the graph: :mod:`.traced`) follow from it (FMix, GridMix,
    SmoothMix, TokenMix)."""

    def draw_mask(self, h: torch.Tensor, draw: Draw) -> tuple[torch.Tensor, dict]:
        """The ``(H, W)`` (``(L,)``, ``(D, H, W)``) float64 CPU mask of one mix of the map ``h`` (1: the
        sample's own content), pinned or drawn from ``draw.generator``, and what :attr:`MixState.info`
        records beside it. On the host, in the eager and the compiled path alike (``h`` may then be a
        :class:`~.traced.Shape`: its shape and dtype only)."""
        raise NotImplementedError(f"{type(self).__name__} must implement draw_mask(h, draw)")

    def _masked(self, leaves: list[Leaf], draw: Draw) -> tuple[torch.Tensor, Mixed]:
        mask, info = self.draw_mask(leaves[0].tensor, draw)
        weights = mask[None] if mask.ndim == leaves[0].tensor.ndim - 2 else None
        return mask, Mixed({}, lam=mask.mean(), info={**info, "mask": mask}, weights=weights)

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        """``M * h + (1 - M) * h[index]`` with the mask :meth:`draw_mask` draws (as the traced path
        blends it). Not :meth:`~.mixer.Mixer.mix`'s default: that would copy the float64 mask to the map's
        device and cast it there; :func:`~mixhook.functional.mask_blend` casts it before its one copy."""
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

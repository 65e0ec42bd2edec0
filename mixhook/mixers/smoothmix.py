"""SmoothMix at any layer with a 2-D (or 1-D, 3-D) map: a Gaussian mask, so the mixed regions have no edge.

Paper: Lee, Zaheer, Astrid, Lee. "SmoothMix: a Simple Yet Effective Data Augmentation to Train Robust
Classifiers." CVPR Workshops 2020. No code from the authors; OpenMixup's
``openmixup/models/augments/smoothmix.py`` (Westlake-AI/openmixup) is the implementation others use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.card import Card
from ..engine.checks import check_pinned_mask, check_splittable
from ..engine.contract import Draw
from ..engine.regions import MaskMixer
from ..geometry import gaussian_volume
from ..sites import Leaf


class SmoothMix(MaskMixer):
    """SmoothMix (Lee et al. 2020) at the input or at any layer whose output is ``(B, C, H, W)`` (or a 1-D
    ``(B, C, L)`` or 3-D ``(B, C, D, H, W)`` map: a Gaussian along each dimension,
    :func:`~mixhook.geometry.gaussian_volume`).

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``, a permutation
    ``index``, a centre ``(cy, cx)`` uniform over the map's pixels and a width ``s ~ U(sigma[0],
    sigma[1])``; the mask ``G`` (:func:`~mixhook.geometry.gaussian_mask`, ``sigma_y = s * H``,
    ``sigma_x = s * W``: one shape on every map, whatever its size; one mask for the batch) blends, as the
    paper's equations:

        ``h' = G * h + (1 - G) * h[index]``,   ``lam = mean(G)``

    so each sample's own label weighs what its Gaussian blob covers. ``loss``/``targets`` use that lam.
    ``.last.info["mask"]`` is ``G``; ``["centre"]`` and ``["sigma"]`` what was drawn.

    The paper's mask has no lam of its own (nothing is drawn from a Beta), so ``alpha`` is not an
    argument and ``pin(lam=...)`` is refused; pin a mask instead. Compared with OpenMixup's on the same
    draw (tested): its ``sigma = (U(0, 1) / 4 + 0.25) * H`` is this ``sigma=(0.25, 0.5)`` default, and
    its mask is this one with the centre half a pixel up and left of a pixel (its grid is cropped from a
    rolled ``2H x 2H`` one), only for square maps of even side (others fail in its ``view``). Its labels
    are the other way round: OpenMixup weights the *partner* image by ``G`` but gives ``mean(G)`` to the
    sample's own label, while the paper (and mixhook) give ``mean(G)`` to the label of the image ``G``
    weights.

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output a map (see above).
        sigma: the range of ``s`` (the Gaussian's width as a fraction of the side), ``0 < low <= high``
            (default ``(0.25, 0.5)``, OpenMixup's).
        prob, generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout, tokens, prefix: as :class:`~mixhook.engine.regions.RegionMixer` (maps in any layout, a
            ViT's tokens as maps).

    ``pin`` also takes ``mask`` (an ``(H, W)`` tensor of weights in [0, 1]; ``(L,)``, ``(D, H, W)``).
    """

    card = Card(
        paper="Lee et al. 2020",
        mixes="a soft Gaussian mask",
        where="input, any map, ViT tokens",
        family="region",
        traits=("tokens",),
        signature="SmoothMix(layer, sigma=(0.25, 0.5))",
        hook="forward, `(B,C,H,W)` outputs (or `(B,C,L)`, `(B,C,D,H,W)`) or ViT tokens",
        commands="`mixup=smoothmix mixup.layer=layer1`",
        details=(
            "Gaussian mask `G` (centre uniform, width `s ~ U(sigma)` × each side, one per batch): `h' = G h "
            "+ (1-G) h[index]`; lam ← `mean(G)` (no Beta draw); equal to OpenMixup's mask on the same draws; "
            "OpenMixup's labels are swapped (its `mean(G)` goes to the label of the image weighted `1-G`); "
            '`.last.info["mask"]`'
        ),
    )

    pin_keys = ("mask",)
    checks_by_signature = True  # (the map's kind and sides)
    region_dims = (1, 2, 3)

    def __init__(
        self,
        layer: str | Sequence[str],
        sigma: Sequence[float] = (0.25, 0.5),
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, 1.0, prob, generator, batch_dim, padding, layout, tokens, prefix)
        try:
            low, high = (float(v) for v in sigma)
        except (TypeError, ValueError):
            raise ValueError(f"sigma must be two numbers (low, high), got {sigma!r}") from None
        if not 0.0 < low <= high < float("inf"):
            raise ValueError(f"sigma must satisfy 0 < low <= high, got {sigma!r}")
        self.sigma = (low, high)

    def __repr__(self) -> str:
        return f"SmoothMix(layer={self._layer_spec!r}, sigma={self.sigma}, prob={self.prob})"

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """Nothing drawn: SmoothMix's lam is its mask's mean (a placeholder until :meth:`mix`)."""
        return torch.ones((), dtype=torch.float64)

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        check_splittable("SmoothMix", spec, leaves, self.region_dims)

    def draw_mask(self, h: torch.Tensor, draw: Draw) -> tuple[torch.Tensor, dict]:
        shape = tuple(h.shape[2:])
        if "lam" in draw.pinned:
            raise ValueError("SmoothMix draws no lam (its lam is the mask's mean): pin mask=... instead")
        mask = draw.pinned.get("mask")
        if mask is not None:
            return check_pinned_mask(mask, *shape), {}
        g = draw.generator
        centre = tuple(int(torch.randint(size, (), generator=g, device=g.device)) for size in shape)
        low, high = self.sigma
        s = low + (high - low) * float(torch.rand((), dtype=torch.float64, generator=g, device=g.device))
        mask = gaussian_volume(shape, centre, tuple(s * size for size in shape))
        return mask, {"centre": centre, "sigma": s}

"""ResizeMix at any layer with two spatial dimensions: the whole partner, shrunk into a box, pasted.

Paper: Qin, Fang, Zhang, Liu, Wang, Wang. "ResizeMix: Mixing Data with Preserved Object
Information and True Labels." arXiv:2012.11101, 2020. No code from the authors; OpenMixup's
``openmixup/models/augments/resizemix.py`` (Westlake-AI/openmixup) is the implementation papers compare
with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..engine.card import Card
from ..engine.checks import check_spatial
from ..engine.contract import Draw, Mixed
from ..engine.regions import RegionMixer
from ..functional import gather_rows
from ..geometry import box_lam, boxes_mask
from ..sites import Leaf
from ..transfer import to_device
from .cutmix import draw_box

INTERPOLATIONS = ("nearest", "nearest-exact", "bilinear", "bicubic", "area")


def paste_resized(
    h: torch.Tensor, index: torch.Tensor, box: tuple[int, int, int, int], interpolation: str
) -> torch.Tensor:
    """A copy of ``h`` (B, C, H, W) whose ``box`` holds the whole of ``h[index]`` resized to the box's size
    (``F.interpolate``); ``h`` is not modified. An empty box pastes nothing. Gradients flow to ``h``
    outside the box and, through the resize, to all of ``h[index]``."""
    y1, y2, x1, x2 = box
    out = h.clone()
    if y2 > y1 and x2 > x1:
        partner = h[to_device(index, h.device)]
        out[:, :, y1:y2, x1:x2] = F.interpolate(partner, size=(y2 - y1, x2 - x1), mode=interpolation)
    return out


class ResizeMix(RegionMixer):
    """ResizeMix (Qin et al. 2020) at the input or at any layer whose output is ``(B, C, H, W)``.

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``, a scale
    ``tau ~ U(scope[0], scope[1])`` and a permutation ``index``; a box of sides ``int(H * tau)`` and
    ``int(W * tau)`` around a uniformly drawn centre, clipped to the borders (CutMix's
    :func:`~mixhook.geometry.rand_box` with side ratio ``tau``), receives the *whole* partner map
    ``h[index]`` resized to the box (``F.interpolate``, ``interpolation``); the rest of ``h`` is kept.
    ``loss`` and ``targets`` use ``lam = 1 - box area / (H * W)``: the partner's label weighs what its
    pasted area covers. ``.last.info["box"]`` is the box, ``["scale"]`` the drawn ``tau``.

    As OpenMixup: the box is clipped before the resize, so a box at a border holds the whole partner
    squeezed to the clipped shape. (OpenMixup names the first spatial side ``W``; on square maps, the
    only ones its box is right for, the masks are equal — tested on the same draws.) Where
    ``int(side * tau) < 2`` the box is empty: nothing is pasted and lam is 1 (OpenMixup's resize raises
    there, e.g. on 16x16 maps for ``tau < 0.125``).

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output ``(B, C, H, W)``.
        scope: the range of ``tau``, ``0 < scope[0] <= scope[1] < 1`` (the paper's and OpenMixup's
            default ``(0.1, 0.8)``).
        interpolation: ``F.interpolate``'s mode: ``"nearest"`` (OpenMixup's default), ``"nearest-exact"``,
            ``"bilinear"``, ``"bicubic"`` or ``"area"``.
        prob, generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout, tokens, prefix: as :class:`~mixhook.engine.regions.RegionMixer` (maps in any layout, a
            ViT's tokens as maps).

    The draw is recorded as lam ``1 - tau**2`` (the box's area fraction before clipping), so ``pin(lam=)``
    sets the box's size as for CutMix (``tau = sqrt(1 - lam)``); ``pin`` also takes ``box=(y1, y2, x1,
    x2)``.
    """

    card = Card(
        paper="Qin et al. 2020",
        mixes="the whole partner resized into a box",
        where="input, any map, ViT tokens",
        family="region",
        traits=("tokens",),
        signature='ResizeMix(layer, scope=(0.1, 0.8), interpolation="nearest")',
        hook="forward, `(B,C,H,W)` outputs or ViT tokens",
        commands="`mixup=resizemix mixup.layer=layer1`",
        details=(
            "The whole `h[index]` resized (`F.interpolate`) into a box of side ratio `tau ~ U(scope)` "
            "(CutMix's box, clipped) pasted into `h`; lam ← `1 - box area/(H*W)`; equal to OpenMixup's on "
            'the same draws; `.last.info["box"]`, `["scale"]`'
        ),
    )

    pin_keys = ("box",)

    def __init__(
        self,
        layer: str | Sequence[str],
        scope: Sequence[float] = (0.1, 0.8),
        interpolation: str = "nearest",
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, 1.0, prob, generator, batch_dim, padding, layout, tokens, prefix)
        low, high = _scope(scope)
        self.scope = (low, high)
        if interpolation not in INTERPOLATIONS:
            raise ValueError(
                f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}"
            )
        self.interpolation = interpolation

    dense_targets = (
        "pastes the whole partner resized into the box, so a dense target's labels would have to be "
        "resized with it: dense targets are not mixed for ResizeMix (use CutMix or FMix)"
    )

    def __repr__(self) -> str:
        return (
            f"ResizeMix(layer={self._layer_spec!r}, scope={self.scope}, "
            f"interpolation={self.interpolation!r}, prob={self.prob})"
        )

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        low, high = self.scope
        u = torch.rand((), dtype=torch.float64, generator=generator, device=generator.device).cpu()
        tau = low + (high - low) * u
        return 1.0 - tau * tau

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        h = check_spatial("ResizeMix", spec, leaves)
        if min(int(side * self.scope[1]) // 2 for side in h.shape[-2:]) == 0:
            raise ValueError(
                f"ResizeMix at {spec!r}: its {h.shape[-2]}x{h.shape[-1]} map is too small to ever paste a "
                f"box at scales up to {self.scope[1]} (a box side is 2 * (int(side * scale) // 2)); choose "
                "an earlier layer"
            )

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        box, mixed = self._boxed(h, draw)
        return Mixed({path: paste_resized(h, draw.index, box, self.interpolation)}, mixed.lam, mixed.info)

    @staticmethod
    def _boxed(h, draw: Draw) -> tuple[tuple[int, int, int, int], Mixed]:
        """The box of one mix of the map ``h`` (pinned, or drawn) and the :class:`Mixed` (no tensors) that
        records it: lam the area kept, the box and the scale."""
        height, width = h.shape[-2:]
        if draw.lam.ndim:
            raise ValueError(f"ResizeMix pastes one box per batch: pin one lam, not {draw.lam.shape[0]}")
        box = draw_box(draw, height, width)
        lam = torch.tensor(box_lam(box, height, width), dtype=torch.float64)
        return box, Mixed({}, lam=lam, info={"box": box, "scale": math.sqrt(max(0.0, 1.0 - float(draw.lam)))})

    # The one-graph path (mixhook.engine.traced): the box and the resize drawn on the host as the
    # resize's separable weights over the whole map, so that the graph's shapes do not depend on the box:
    # the source row (column) of each pixel for the nearest modes, else a (side, side) matrix of weights.

    @property
    def _nearest(self) -> bool:
        return self.interpolation.startswith("nearest")

    def traced_params(self, n: int, leaves: list[Leaf]) -> list:
        height, width = leaves[0].tensor.shape[-2:]
        sides = ((height,), (width,)) if self._nearest else ((height, height), (width, width))
        dtype = torch.int64 if self._nearest else torch.float64
        # the index, the box, the rows' and the columns' weights
        return [((n,), torch.int64), ((4,), torch.int64), *((shape, dtype) for shape in sides)]

    def draw_traced(self, leaves: list[Leaf], draw: Draw) -> tuple[list[torch.Tensor], Mixed]:
        h = leaves[0].tensor
        box, mixed = self._boxed(h, draw)
        y1, y2, x1, x2 = box
        rows = resize_weights(h.shape[-2], y1, y2, self.interpolation)
        cols = resize_weights(h.shape[-1], x1, x2, self.interpolation)
        return [draw.index, torch.tensor(box), rows, cols], mixed

    def mix_traced(self, leaves: list[Leaf], values: list[torch.Tensor]) -> dict:
        h = leaves[0].tensor
        index, box, rows, cols = values
        partner = gather_rows(h, index)
        if self._nearest:
            pasted = partner.index_select(-2, rows).index_select(-1, cols)
        else:
            pasted = rows.to(h.dtype) @ partner @ cols.to(h.dtype).T
        inside = boxes_mask(box[None], h.shape[-2], h.shape[-1], h.device)
        return {leaves[0].path: torch.where(inside, pasted, h)}


def resize_weights(side: int, start: int, stop: int, interpolation: str) -> torch.Tensor:
    """What ``F.interpolate`` puts at each position ``start:stop`` of a ``side``-long axis when it resizes
    the whole axis to ``stop - start`` (``interpolation`` is separable): for the nearest modes the source
    position of each position (0 outside), else the ``(side, side)`` matrix whose row ``i`` weighs the
    source positions (0 outside). Made by resizing the positions (the identity) themselves."""
    if interpolation.startswith("nearest"):
        out = torch.zeros(side, dtype=torch.int64)
        if stop > start:
            source = torch.arange(side, dtype=torch.float64).view(1, 1, side, 1)
            resized = F.interpolate(source, size=(stop - start, 1), mode=interpolation)
            out[start:stop] = resized.view(-1).long()
        return out
    out = torch.zeros(side, side, dtype=torch.float64)
    if stop > start:
        eye = torch.eye(side, dtype=torch.float64).view(1, side, side, 1)
        resized = F.interpolate(eye, size=(stop - start, 1), mode=interpolation)  # (1, source, out, 1)
        out[start:stop] = resized[0, :, :, 0].T
    return out


def _scope(scope) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in scope)
    except (TypeError, ValueError):
        raise ValueError(f"scope must be two numbers (low, high), got {scope!r}") from None
    if not 0.0 < low <= high < 1.0:
        raise ValueError(f"scope must satisfy 0 < low <= high < 1, got {scope!r}")
    return low, high

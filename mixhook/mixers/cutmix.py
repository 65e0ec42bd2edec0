"""CutMix at any layer with two spatial dimensions: the input (classic CutMix) or a hidden feature map.

Paper: Yun, Han, Oh, Chun, Choe, Yoo. "CutMix: Regularization Strategy to Train Strong Classifiers with
Localizable Features." ICCV 2019. https://arxiv.org/abs/1905.04899
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..sites import Leaf
from ..transfer import to_device
from .base import Draw, Mixed, Mixer, check_spatial


def rand_box(height: int, width: int, lam: float, generator: torch.Generator) -> tuple[int, int, int, int]:
    """A box of area ratio about ``1 - lam`` with a uniformly drawn centre, clipped to the borders.

    As the paper's reference code and timm's ``rand_bbox``: side ratio ``sqrt(1 - lam)``, half-sides
    ``int(H * ratio) // 2`` and ``int(W * ratio) // 2`` around a centre ``(cy, cx)`` uniform over the map.
    Returns ``(y1, y2, x1, x2)``: rows ``y1:y2`` and columns ``x1:x2``.
    """
    ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * ratio), int(width * ratio)
    cy = int(torch.randint(height, (), generator=generator, device=generator.device))
    cx = int(torch.randint(width, (), generator=generator, device=generator.device))
    y1, y2 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, height)
    x1, x2 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, width)
    return y1, y2, x1, x2


def box_lam(box: tuple[int, int, int, int], height: int, width: int) -> float:
    """The lam a pasted ``box`` leaves: ``1 - box area / (height * width)``."""
    y1, y2, x1, x2 = box
    return 1.0 - (y2 - y1) * (x2 - x1) / (height * width)


def paste_box(h: torch.Tensor, index: torch.Tensor, box: tuple[int, int, int, int]) -> torch.Tensor:
    """A copy of ``h`` (B, C, H, W) whose ``box`` region comes from ``h[index]``; ``h`` is not modified.

    Gradients flow to ``h`` outside the box and to ``h[index]`` inside it."""
    y1, y2, x1, x2 = box
    out = h.clone()
    out[:, :, y1:y2, x1:x2] = h[:, :, y1:y2, x1:x2][to_device(index, h.device)]
    return out


class CutMix(Mixer):
    """CutMix (Yun et al. 2019) at the input or at any layer whose output is ``(B, C, H, W)``.

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``,
    ``lam ~ Beta(alpha, alpha)``, a permutation ``index`` and a box of area ratio ``1 - lam``
    (:func:`rand_box`); the box of ``h[index]`` is pasted into ``h`` (the same box for the whole
    batch), and lam is corrected to the area actually kept after clipping to the borders:
    ``lam = 1 - box area / (H * W)``. ``loss`` and ``targets`` use the corrected lam. At ``"input"`` this
    is classic CutMix; at a hidden layer it is Feature (Manifold) CutMix. ``.last.info["box"]`` is the box.

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output ``(B, C, H, W)``.
        alpha: Beta concentration, > 0 (the paper uses 1.0).
        prob: probability that a batch is mixed (the paper's cutmix_prob), in [0, 1].
        generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.

    The layer (or the selected element, ``"block[0]"``) must give one ``(B, C, H, W)`` map with
    ``H, W >= 2`` (a smaller map can never hold a pasted box: refused when first checked);
    ``.last.elements`` names the element that was cut. ``pin`` also takes ``box=(y1, y2, x1, x2)``; a
    pinned ``lam`` sets the box size, its centre is drawn.
    """

    pin_keys = ("box",)

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 1.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding)

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        h = check_spatial("CutMix", spec, leaves)
        if min(h.shape[-2:]) < 2:
            raise ValueError(
                f"CutMix at {spec!r}: its {h.shape[-2]}x{h.shape[-1]} map is too small to ever paste a box "
                "(a box side is 2 * (int(side * sqrt(1 - lam)) // 2)); choose an earlier layer"
            )

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        name, h, path = draw.layer, leaves[0].tensor, leaves[0].path
        height, width = h.shape[-2:]
        box = draw.pinned.get("box")
        if box is None:
            box = rand_box(height, width, float(draw.lam), draw.generator)
        else:
            box = tuple(int(v) for v in box)
            y1, y2, x1, x2 = box
            if not (0 <= y1 <= y2 <= height and 0 <= x1 <= x2 <= width):
                raise ValueError(f"pinned box {box} does not fit the {height}x{width} map of layer {name!r}")
        lam = torch.tensor(box_lam(box, height, width), dtype=torch.float64)
        return Mixed({path: paste_box(h, draw.index, box)}, lam=lam, info={"box": box})

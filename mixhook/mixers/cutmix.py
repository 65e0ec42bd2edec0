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
from .base import Mixer
from .checks import check_spatial
from .contract import Draw, Mixed
from .functional import sample_beta, sample_lam
from .tokens import token_grid

ROUNDINGS = ("paper", "timm")


def _sides(cut, rounding: str):
    """How many rows (columns) of a ``cut``-long side lie before the centre and from it on: ``cut // 2``
    each (``"paper"``: the authors' code and torchvision's; a box of even side), or ``cut // 2`` and
    ``(cut + 1) // 2`` (``"timm"``: timm >= 1.0's ``rand_bbox``; the side is ``cut``)."""
    return cut // 2, (cut + 1) // 2 if rounding == "timm" else cut // 2


def rand_box(
    height: int, width: int, lam: float, generator: torch.Generator, rounding: str = "paper"
) -> tuple[int, int, int, int]:
    """A box of area ratio about ``1 - lam`` with a uniformly drawn centre, clipped to the borders.

    Side ratio ``sqrt(1 - lam)``, sides ``cut_h = int(H * ratio)`` and ``cut_w = int(W * ratio)`` around a
    centre ``(cy, cx)`` uniform over the map (rows first). ``rounding="paper"``: rows
    ``cy - cut_h // 2 : cy + cut_h // 2``, as the paper's reference code and torchvision's ``v2.CutMix``;
    ``"timm"``: rows ``cy - cut_h // 2 : cy + (cut_h + 1) // 2``, as timm >= 1.0's ``rand_bbox`` (the
    paper's rounding drops a row and a column when ``cut`` is odd). Columns alike. Returns
    ``(y1, y2, x1, x2)``: rows ``y1:y2`` and columns ``x1:x2``.
    """
    ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * ratio), int(width * ratio)
    cy = int(torch.randint(height, (), generator=generator, device=generator.device))
    cx = int(torch.randint(width, (), generator=generator, device=generator.device))
    (up, down), (left, right) = _sides(cut_h, rounding), _sides(cut_w, rounding)
    y1, y2 = max(cy - up, 0), min(cy + down, height)
    x1, x2 = max(cx - left, 0), min(cx + right, width)
    return y1, y2, x1, x2


def rand_boxes(
    height: int, width: int, lam: torch.Tensor, generator: torch.Generator, rounding: str = "paper"
) -> torch.Tensor:
    """One :func:`rand_box` per value of ``lam`` (1-D float64), vectorised: an ``(n, 4)`` int64 tensor of
    ``(y1, y2, x1, x2)`` rows, on the CPU. Box ``i`` is the box :func:`rand_box` makes from ``lam[i]`` and
    the centre ``(cy[i], cx[i])``, where all ``n`` row centres are drawn first, then all column centres."""
    n = lam.shape[0]
    cy = torch.randint(height, (n,), generator=generator, device=generator.device).cpu()
    cx = torch.randint(width, (n,), generator=generator, device=generator.device).cpu()
    return boxes_around(height, width, lam, cy, cx, rounding)


def boxes_around(
    height: int, width: int, lam: torch.Tensor, cy: torch.Tensor, cx: torch.Tensor, rounding: str = "paper"
) -> torch.Tensor:
    """:func:`rand_box`'s boxes around given centres: side ratio ``sqrt(1 - lam)`` (``lam`` one value or
    one per centre), the sides rounded as ``rounding`` says, clipped to the borders; ``(n, 4)`` int64
    ``(y1, y2, x1, x2)`` rows on the centres' device."""
    ratio = torch.sqrt(1.0 - to_device(torch.as_tensor(lam, dtype=torch.float64), cy.device))
    cut_h, cut_w = (height * ratio).floor().long(), (width * ratio).floor().long()
    cy, cx = cy.long(), to_device(cx, cy.device).long()
    (up, down), (left, right) = _sides(cut_h, rounding), _sides(cut_w, rounding)
    y1, y2 = (cy - up).clamp(min=0), (cy + down).clamp(max=height)
    x1, x2 = (cx - left).clamp(min=0), (cx + right).clamp(max=width)
    return torch.stack(torch.broadcast_tensors(y1, y2, x1, x2), dim=1)


def boxes_mask(boxes: torch.Tensor, height: int, width: int, device=None) -> torch.Tensor:
    """``(n, 1, height, width)`` bool: True inside box ``i`` (rows ``y1:y2``, columns ``x1:x2``) of
    sample ``i``."""
    boxes = boxes if device is None else to_device(boxes, device)  # queued, not a blocking copy
    rows = torch.arange(height, device=device)
    cols = torch.arange(width, device=device)
    in_rows = (rows >= boxes[:, :1]) & (rows < boxes[:, 1:2])
    in_cols = (cols >= boxes[:, 2:3]) & (cols < boxes[:, 3:4])
    return (in_rows[:, :, None] & in_cols[:, None, :]).unsqueeze(1)


def box_weights(box: tuple[int, int, int, int], height: int, width: int) -> torch.Tensor:
    """``(1, height, width)`` bool: the sample's own content, False inside the pasted ``box``."""
    return ~boxes_mask(torch.tensor([box]), height, width)[:, 0]


def boxes_lam(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Per sample, the lam its pasted box leaves: ``1 - box area / (height * width)`` (float64)."""
    area = (boxes[:, 1] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 2])
    return 1.0 - area.to(torch.float64) / (height * width)


def box_lam(box: tuple[int, int, int, int], height: int, width: int) -> float:
    """The lam a pasted ``box`` leaves: ``1 - box area / (height * width)``."""
    y1, y2, x1, x2 = box
    return 1.0 - (y2 - y1) * (x2 - x1) / (height * width)


def draw_box(draw: Draw, height: int, width: int, rounding: str = "paper") -> tuple[int, int, int, int]:
    """The box of one mix: the pinned ``box`` once it fits the ``height x width`` map (else a one-line
    ``ValueError``), or :func:`rand_box` from ``draw.lam`` and ``draw.generator``."""
    box = draw.pinned.get("box")
    if box is None:
        return rand_box(height, width, float(draw.lam), draw.generator, rounding)
    box = tuple(int(v) for v in box)
    y1, y2, x1, x2 = box
    if not (0 <= y1 <= y2 <= height and 0 <= x1 <= x2 <= width):
        raise ValueError(f"pinned box {box} does not fit the {height}x{width} map of layer {draw.layer!r}")
    return box


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

    ``mode="elem"`` cuts one box per sample (asked for in clovaai/CutMix-PyTorch#4; timm's ``elem``
    mode): ``lam_i ~ Beta(alpha, alpha)`` and a centre for each sample, box ``i`` of ``h[index[i]]``
    pasted into ``h[i]``, and one corrected lam per sample for ``loss`` (which then needs a per-sample
    criterion, ``reduction="none"``) and ``targets``; ``.last.info["box"]`` is then a ``(B, 4)`` int64
    tensor of ``(y1, y2, x1, x2)`` rows.

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output ``(B, C, H, W)``.
        alpha: Beta concentration, > 0 (the paper uses 1.0).
        prob: probability that a batch is mixed (the paper's cutmix_prob), in [0, 1].
        mode: ``"batch"`` (one box for the batch, as the paper) or ``"elem"`` (one box per sample).
        rounding: ``"paper"`` (the authors' code and torchvision's box) or ``"timm"`` (timm >= 1.0's,
            one row/column longer for an odd side); see :func:`rand_box`.
        generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout: ``"NHWC"`` or ``"NCHW"`` (or a dict per layer) for a 4-D map whose layout the model
            does not state; where it does, it is read (a contradicting one is refused): see
            :mod:`mixhook.layouts`.
        tokens, prefix: on ``(B, T, D)`` tokens (a ViT block), the patch grid ``(rows, columns)`` or
            ``"auto"`` and the rule for the leading tokens; see :mod:`mixhook.mixers.tokens`.

    The layer (or the selected element, ``"block[0]"``) must give one ``(B, C, H, W)`` map with
    ``H, W >= 2`` (a smaller map can never hold a pasted box: refused when first checked);
    ``.last.elements`` names the element that was cut. ``pin`` also takes ``box=(y1, y2, x1, x2)`` (in
    ``mode="elem"`` also one row per sample, ``(B, 4)``); a pinned ``lam`` sets the box size, its centre
    is drawn.
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
        mode: str = "batch",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        rounding: str = "paper",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout=layout)
        self.token_grid = token_grid(tokens, prefix, "CutMix")
        if mode not in ("batch", "elem"):
            raise ValueError(f"mode must be 'batch' or 'elem', got {mode!r}")
        self.mode = mode
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
        self.rounding = rounding

    def __repr__(self) -> str:
        base = super().__repr__()
        base = base if self.mode == "batch" else f"{base[:-1]}, mode={self.mode!r})"
        return base if self.rounding == "paper" else f"{base[:-1]}, rounding={self.rounding!r})"

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        if self.mode == "elem":
            return sample_beta(self.alpha, self.alpha, generator, size=n)
        return sample_lam(self.alpha, generator)

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        h = check_spatial("CutMix", spec, leaves)
        if min(h.shape[-2:]) < 2:
            raise ValueError(
                f"CutMix at {spec!r}: its {h.shape[-2]}x{h.shape[-1]} map is too small to ever paste a box "
                "(a box side is 2 * (int(side * sqrt(1 - lam)) // 2)); choose an earlier layer"
            )

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        if self.mode == "elem":
            return paste_boxes(h, path, draw.index, self._boxes(h, draw))
        box = self._box(h, draw)
        height, width = h.shape[-2:]
        lam = torch.tensor(box_lam(box, height, width), dtype=torch.float64)
        return Mixed(
            {path: paste_box(h, draw.index, box)},
            lam=lam,
            info={"box": box},
            weights=box_weights(box, height, width),
        )

    def _box(self, h: torch.Tensor, draw: Draw) -> tuple[int, int, int, int]:
        """The box of a ``mode="batch"`` mix of the map ``h`` (pinned, or drawn)."""
        if draw.lam.ndim:
            raise ValueError(
                f"CutMix(mode='batch') cuts one box per batch: pin one lam, not {draw.lam.shape[0]} "
                "(one box per sample is mode='elem')"
            )
        return draw_box(draw, h.shape[-2], h.shape[-1], self.rounding)

    def _boxes(self, h: torch.Tensor, draw: Draw) -> torch.Tensor:
        """The ``(n, 4)`` boxes of a ``mode="elem"`` mix of the map ``h`` (pinned, or drawn)."""
        n, height, width = h.shape[0], h.shape[-2], h.shape[-1]
        lam = draw.lam.expand(n) if draw.lam.ndim == 0 else draw.lam
        boxes = draw.pinned.get("box")
        if boxes is None:
            return rand_boxes(height, width, lam, draw.generator, self.rounding)
        return pinned_boxes("CutMix(mode='elem')", boxes, n, height, width, draw.layer)

    def traced_params(self, n: int, leaves: list[Leaf]) -> list:
        return [((n,), torch.int64), ((n if self.mode == "elem" else 1, 4), torch.int64)]  # index, boxes

    def draw_traced(self, leaves: list[Leaf], draw: Draw) -> tuple[list[torch.Tensor], Mixed]:
        h = leaves[0].tensor
        height, width = h.shape[-2:]
        if self.mode == "elem":
            boxes = self._boxes(h, draw)
            weights = ~boxes_mask(boxes, height, width)[:, 0]
            mixed = Mixed({}, boxes_lam(boxes, height, width), {"box": boxes}, weights=weights)
            return [draw.index, boxes], mixed
        box = self._box(h, draw)
        lam = torch.tensor(box_lam(box, height, width), dtype=torch.float64)
        mixed = Mixed({}, lam, {"box": box}, weights=box_weights(box, height, width))
        return [draw.index, torch.tensor([box])], mixed

    def mix_traced(self, leaves: list[Leaf], values: list[torch.Tensor]) -> dict:
        index, boxes = values
        h = leaves[0].tensor
        mask = boxes_mask(boxes, h.shape[-2], h.shape[-1], h.device)
        return {leaves[0].path: torch.where(mask, h.index_select(0, index), h)}


def pinned_boxes(kind: str, boxes, n: int, height: int, width: int, layer: str) -> torch.Tensor:
    """Pinned per-sample boxes, one ``(y1, y2, x1, x2)`` for all or one row per sample, as an ``(n, 4)``
    int64 CPU tensor, or a one-line ``ValueError``."""
    boxes = torch.as_tensor(boxes).to(torch.int64).cpu()
    boxes = boxes.expand(n, 4) if boxes.shape == (4,) else boxes
    if boxes.shape != (n, 4):
        raise ValueError(
            f"pinned box of shape {tuple(boxes.shape)}: {kind} takes one (y1, y2, x1, x2) or one row per "
            f"sample, ({n}, 4)"
        )
    y1, y2, x1, x2 = boxes.unbind(1)
    if not bool(((0 <= y1) & (y1 <= y2) & (y2 <= height) & (0 <= x1) & (x1 <= x2) & (x2 <= width)).all()):
        raise ValueError(f"a pinned box does not fit the {height}x{width} map of layer {layer!r}")
    return boxes


def paste_boxes(h: torch.Tensor, path, index: torch.Tensor, boxes: torch.Tensor) -> Mixed:
    """Box ``i`` of ``h[index[i]]`` pasted into ``h[i]``: the :class:`Mixed` with one lam per sample (the
    area each box leaves) and ``info["box"]``."""
    height, width = h.shape[-2:]
    mask = boxes_mask(boxes, height, width, h.device)
    mixed = torch.where(mask, h[to_device(index, h.device)], h)
    return Mixed({path: mixed}, lam=boxes_lam(boxes, height, width), info={"box": boxes}, weights=~mask[:, 0])

"""CutMix at the input (classic CutMix) or at a hidden layer, on 2-D maps and on 1-D and 3-D ones.

Paper: Yun, Han, Oh, Chun, Choe, Yoo. "CutMix: Regularization Strategy to Train Strong Classifiers with
Localizable Features." ICCV 2019. https://arxiv.org/abs/1905.04899
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.card import Card
from ..engine.checks import check_region, map_size
from ..engine.contract import Deferred, Draw, Mixed
from ..engine.regions import RegionMixer
from ..functional import gather_rows, sample_beta, sample_lam
from ..geometry import (
    box_slices,
    rand_region,
    rand_regions,
    region_lam,
    region_weights,
    regions_lam,
    regions_mask,
)
from ..sites import Leaf
from ..transfer import to_device

ROUNDINGS = ("paper", "timm")


def _fits(box: Sequence[int], shape: Sequence[int]) -> bool:
    return all(0 <= a <= b <= size for a, b, size in zip(box[0::2], box[1::2], shape, strict=True))


def _size(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape)


def draw_region(draw: Draw, shape: Sequence[int], rounding: str = "paper") -> tuple[int, ...]:
    """The box of one mix of a map of positions ``shape``: the pinned ``box`` once it fits (else a
    one-line ``ValueError``), or :func:`~mixhook.geometry.rand_region` from ``draw.lam`` and
    ``draw.generator``."""
    box = draw.pinned.get("box")
    if box is None:
        lam = draw.weight if type(draw.weight) is float else float(draw.lam)
        return rand_region(shape, lam, draw.generator, rounding)
    box = tuple(int(v) for v in box)
    if len(box) != 2 * len(shape) or not _fits(box, shape):
        raise ValueError(
            f"pinned box {box} does not fit the {_size(shape)} map of layer {draw.layer!r} (a box is "
            f"{2 * len(shape)} bounds, (start, stop) along each of its {len(shape)} dimensions)"
        )
    return box


def draw_box(draw: Draw, height: int, width: int, rounding: str = "paper") -> tuple[int, int, int, int]:
    """The box of one mix: the pinned ``box`` once it fits the ``height x width`` map (else a one-line
    ``ValueError``), or :func:`~mixhook.geometry.rand_box` from ``draw.lam`` and ``draw.generator``."""
    return draw_region(draw, (height, width), rounding)


def paste_box(h: torch.Tensor, index: torch.Tensor, box: tuple[int, ...]) -> torch.Tensor:
    """A copy of ``h`` (B, C, ...) whose ``box`` region (``(a1, b1, a2, b2, ...)`` over the dimensions
    after the channels) comes from ``h[index]``; ``h`` is not modified.

    Gradients flow to ``h`` outside the box and to ``h[index]`` inside it."""
    region = (slice(None), slice(None), *box_slices(box))
    out = h.clone()
    out[region] = h[region][index if index.device == h.device else to_device(index, h.device)]
    return out


class CutMix(RegionMixer):
    """CutMix (Yun et al. 2019) at the input or at any layer whose output is a ``(B, C, H, W)`` map, or a
    1-D ``(B, C, L)`` or 3-D ``(B, C, D, H, W)`` one.

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``,
    ``lam ~ Beta(alpha, alpha)``, a permutation ``index`` and a box of area ratio ``1 - lam``
    (:func:`~mixhook.geometry.rand_box`); the box of ``h[index]`` is pasted into ``h`` (the same box for
    the whole batch), and lam is corrected to the area actually kept after clipping to the borders:
    ``lam = 1 - box area / (H * W)``. ``loss`` and ``targets`` use the corrected lam. At ``"input"`` this
    is classic CutMix; at a hidden layer it is Feature (Manifold) CutMix. ``.last.info["box"]`` is the box.

    ``mode="elem"`` cuts one box per sample (asked for in clovaai/CutMix-PyTorch#4; timm's ``elem``
    mode): ``lam_i ~ Beta(alpha, alpha)`` and a centre for each sample, box ``i`` of ``h[index[i]]``
    pasted into ``h[i]``, and one corrected lam per sample for ``loss`` (which then needs a per-sample
    criterion, ``reduction="none"``) and ``targets``; ``.last.info["box"]`` is then a ``(B, 4)`` int64
    tensor of ``(y1, y2, x1, x2)`` rows.

    On a 1-D map (a signal, a time series, a sequence's positions) the box is a segment of length ratio
    ``1 - lam``; on a 3-D map (a volume, a clip) a box of side ratio ``cbrt(1 - lam)`` in depth, height and
    width (:func:`~mixhook.geometry.rand_region`), ``(z1, z2, y1, y2, x1, x2)``; lam is the fraction
    kept, as in 2-D. Their layouts are read, never guessed (:mod:`mixhook.layouts`): a 1-D convolution
    states ``(B, C, L)``; a ``(B, L, C)`` sequence, a model's 3-D or 5-D input, and a map nothing states
    need ``layout=``.

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output a map (see above).
        alpha: Beta concentration, > 0 (the paper uses 1.0).
        prob: probability that a batch is mixed (the paper's cutmix_prob), in [0, 1].
        mode: ``"batch"`` (one box for the batch, as the paper) or ``"elem"`` (one box per sample).
        rounding: ``"paper"`` (the authors' code and torchvision's box) or ``"timm"`` (timm >= 1.0's,
            one row/column longer for an odd side); see :func:`~mixhook.geometry.rand_box`.
        generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout, tokens, prefix: as :class:`~mixhook.engine.regions.RegionMixer` (maps in any layout, a
            ViT's tokens as maps).

    The layer (or the selected element, ``"block[0]"``) must give one map with every side >= 2 (a
    smaller map can never hold a pasted box: refused when first checked);
    ``.last.elements`` names the element that was cut. ``pin`` also takes ``box=(y1, y2, x1, x2)`` (in
    ``mode="elem"`` also one row per sample, ``(B, 4)``; on a 1-D or 3-D map 2 or 6 bounds); a pinned
    ``lam`` sets the box size, its centre is drawn.
    """

    card = Card(
        paper="Yun et al. 2019",
        mixes="a box of the partner pasted in",
        where="input, any map, ViT tokens",
        family="region",
        traits=("tokens",),
        signature='CutMix(layer, alpha=1.0, prob=1.0, mode="batch", rounding="paper")',
        hook="forward, `(B,C,H,W)` outputs (or `(B,C,L)`, `(B,C,D,H,W)`) or ViT tokens",
        commands="`mixup=cutmix mixup.layer=layer2`, `mixup.mode=elem`",
        details=(
            "Box of area ≈ `1-lam` from `h[index]` pasted into `h`; lam ← `1 - box area/(H*W)`; on a 1-D map "
            "a segment of length ratio `1-lam`, on a 3-D map a box of side ratio `cbrt(1-lam)` (layouts read "
            'or declared); `mode="elem"`: one box and lam per sample (CutMix-PyTorch#4); `rounding="paper"`: '
            "the authors' (and torchvision's) box, `\"timm\"`: timm ≥ 1.0's (an odd side one longer), each "
            'tested against that code; `.last.info["box"]`'
        ),
    )

    pin_keys = ("box",)
    region_dims = (1, 2, 3)
    checks_by_signature = True  # (the map's kind and sides)

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
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout, tokens, prefix)
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
        h = check_region(type(self).__name__, spec, leaves, self.region_dims)
        if min(h.shape[2:]) < 2:
            raise ValueError(
                f"CutMix at {spec!r}: its {map_size(h)} map is too small to ever paste a box (a box side is "
                "2 * (int(side * ratio) // 2)); choose an earlier layer"
            )

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        if self.mode == "elem":
            return paste_boxes(h, path, draw.index, self._boxes(h, draw))
        return pasted(h, path, draw.index, self._box(h, draw))

    def _box(self, h: torch.Tensor, draw: Draw) -> tuple[int, ...]:
        """The box of a ``mode="batch"`` mix of the map ``h`` (pinned, or drawn)."""
        if draw.lam.ndim:
            raise ValueError(
                f"CutMix(mode='batch') cuts one box per batch: pin one lam, not {draw.lam.shape[0]} "
                "(one box per sample is mode='elem')"
            )
        return draw_region(draw, h.shape[2:], self.rounding)

    def _boxes(self, h: torch.Tensor, draw: Draw) -> torch.Tensor:
        """The ``(n, 2 * dims)`` boxes of a ``mode="elem"`` mix of the map ``h`` (pinned, or drawn)."""
        n, shape = h.shape[0], tuple(h.shape[2:])
        lam = draw.lam.expand(n) if draw.lam.ndim == 0 else draw.lam
        boxes = draw.pinned.get("box")
        if boxes is None:
            return rand_regions(shape, lam, draw.generator, self.rounding)
        return pinned_regions("CutMix(mode='elem')", boxes, n, shape, draw.layer)

    def traced_params(self, n: int, leaves: list[Leaf]) -> list:
        bounds = 2 * (leaves[0].tensor.ndim - 2)
        return [((n,), torch.int64), ((n if self.mode == "elem" else 1, bounds), torch.int64)]  # index, boxes

    def draw_traced(self, leaves: list[Leaf], draw: Draw) -> tuple[list[torch.Tensor], Mixed]:
        h = leaves[0].tensor
        shape = tuple(h.shape[2:])
        if self.mode == "elem":
            boxes = self._boxes(h, draw)
            weights = ~regions_mask(boxes, shape)[:, 0]
            mixed = Mixed({}, regions_lam(boxes, shape), {"box": boxes}, weights=weights)
            return [draw.index, boxes], mixed
        box = self._box(h, draw)
        lam = torch.tensor(region_lam(box, shape), dtype=torch.float64)
        mixed = Mixed({}, lam, {"box": box}, weights=Deferred(region_weights, box, shape))
        return [draw.index, torch.tensor([box])], mixed

    def mix_traced(self, leaves: list[Leaf], values: list[torch.Tensor]) -> dict:
        index, boxes = values
        h = leaves[0].tensor
        mask = regions_mask(boxes, h.shape[2:], h.device)
        return {leaves[0].path: torch.where(mask, gather_rows(h, index), h)}


def pasted(h: torch.Tensor, path, index: torch.Tensor, box: tuple[int, ...]) -> Mixed:
    """One ``box`` of ``h[index]`` pasted into ``h`` (:func:`paste_box`): the :class:`Mixed` with the
    volume it leaves as lam, ``info["box"]`` and the box's own-content weights (made when first read)."""
    shape = h.shape[2:]
    lam = region_lam(box, shape)  # (a float: the record's lam, and what the loss weighs by)
    weights = Deferred(region_weights, box, tuple(shape))  # (made if a dense target reads them)
    return Mixed({path: paste_box(h, index, box)}, lam=lam, info={"box": box}, weights=weights)


def pinned_regions(kind: str, boxes, n: int, shape: Sequence[int], layer: str) -> torch.Tensor:
    """Pinned per-sample boxes in a map of positions ``shape``, one box (``2 * len(shape)`` bounds) for
    all or one row per sample, as an ``(n, 2 * len(shape))`` int64 CPU tensor, or a one-line
    ``ValueError``."""
    bounds = 2 * len(shape)
    boxes = torch.as_tensor(boxes).to(torch.int64).cpu()
    boxes = boxes.expand(n, bounds) if boxes.shape == (bounds,) else boxes
    if boxes.shape != (n, bounds):
        one = "(y1, y2, x1, x2)" if bounds == 4 else f"{bounds} bounds"
        raise ValueError(
            f"pinned box of shape {tuple(boxes.shape)}: {kind} takes one {one} or one row per sample, "
            f"({n}, {bounds})"
        )
    starts, stops = boxes[:, 0::2], boxes[:, 1::2]
    sizes = torch.tensor(list(shape))
    if not bool(((0 <= starts) & (starts <= stops) & (stops <= sizes)).all()):
        raise ValueError(f"a pinned box does not fit the {_size(shape)} map of layer {layer!r}")
    return boxes


def pinned_boxes(kind: str, boxes, n: int, height: int, width: int, layer: str) -> torch.Tensor:
    """Pinned per-sample boxes, one ``(y1, y2, x1, x2)`` for all or one row per sample, as an ``(n, 4)``
    int64 CPU tensor, or a one-line ``ValueError``."""
    return pinned_regions(kind, boxes, n, (height, width), layer)


def paste_boxes(h: torch.Tensor, path, index: torch.Tensor, boxes: torch.Tensor) -> Mixed:
    """Box ``i`` of ``h[index[i]]`` pasted into ``h[i]``: the :class:`Mixed` with one lam per sample (the
    volume each box leaves) and ``info["box"]``."""
    shape = tuple(h.shape[2:])
    mask = regions_mask(boxes, shape, h.device)
    mixed = torch.where(mask, h[to_device(index, h.device)], h)
    return Mixed({path: mixed}, lam=regions_lam(boxes, shape), info={"box": boxes}, weights=~mask[:, 0])

"""SaliencyMix at any layer with two spatial dimensions (or on a ViT's tokens): the partner's most salient
box pasted at the same place.

Paper: Uddin, Monira, Shin, Chung, Bae. "SaliencyMix: A Saliency Guided Data Augmentation Strategy for
Better Regularization." ICLR 2021. https://arxiv.org/abs/2006.01791. Authors' code:
github.com/afm-shahab-uddin/SaliencyMix (``SaliencyMix_CIFAR/saliencymix.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..engine.card import Card
from ..engine.checks import check_spatial
from ..engine.contract import Draw, Mixed
from ..engine.regions import RegionMixer
from ..engine.saliency import Saliency, SaliencyGuided, peaks, pinned_saliency
from ..geometry import boxes_around
from ..sites import Leaf
from ..transfer import to_device
from .cutmix import draw_box, paste_boxes, pinned_boxes


class SaliencyMix(SaliencyGuided, RegionMixer):
    """SaliencyMix (Uddin et al. 2021) at any layer whose output is ``(B, C, H, W)`` (or, with ``tokens``,
    a ViT block's tokens), with saliency from the same forward or from a gradient pass.

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``,
    ``lam ~ Beta(alpha, alpha)``, a permutation ``index`` and the saliency ``S`` of every sample's map
    (:mod:`mixhook.engine.saliency`); a CutMix box (side ratio ``sqrt(1 - lam)``, clipped to the borders)
    is centred on the partner's most salient position and the partner's box is pasted into the sample at
    the same place:

    - ``mode="batch"`` (the authors' code): one box for the batch, centred on the peak of the saliency
      of ``index[0]``'s map, the first partner (as ``saliency_bbox(input[rand_index[0]], lam)``);
    - ``mode="elem"``: each sample's box centred on its own partner's peak; one lam per sample (``loss``
      then needs a per-sample criterion, ``reduction="none"``).

    lam is corrected to the area kept: ``1 - box area / (H * W)``. ``.last.info["box"]`` is the box, a
    ``(4,)`` int64 tensor ``(y1, y2, x1, x2)`` (``(B, 4)`` in ``mode="elem"``), ``["saliency"]`` the
    ``(B, H, W)`` map it was placed by (``None`` for a pinned box). The box, lam and the paste are
    computed on the map's device from its saliency: nothing in the mix waits for a GPU (reading the box
    or lam on the host does).

    The authors compute the saliency of the **image** with OpenCV's fine-grained static saliency;
    mixhook's sources are the activation (``saliency="activation"``, at a hidden layer: no extra pass)
    and the loss gradient (``"gradient"``, anywhere, the input included: one more forward and backward,
    and ``use_targets(y)`` before each forward). ``pin(saliency=...)`` takes a ``(B, H, W)`` map of
    your own, e.g. the OpenCV maps, which reproduces the paper's recipe exactly.

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output ``(B, C, H, W)``.
        alpha: Beta concentration, > 0 (the paper: 1.0).
        saliency: ``"activation"`` (default) or ``"gradient"``.
        saliency_layer: with ``"activation"``, an earlier layer whose channel-mean magnitude (resized)
            is the saliency; ``None``: the mixed map's own.
        mode: ``"batch"`` or ``"elem"``, as above.
        prob: probability that a batch is mixed (the paper's ``mix_prob``, 0.5 in its CIFAR runs).
        generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout, tokens, prefix: as :class:`~mixhook.engine.regions.RegionMixer` (maps in any layout, a
            ViT's tokens as maps).

    ``pin`` also takes ``box`` (as :class:`~mixhook.CutMix`) and ``saliency``.
    """

    card = Card(
        paper="Uddin et al. 2021",
        mixes="a box around the partner's salient peak",
        where="input, any map, ViT tokens (+ a gradient pass)",
        family="saliency",
        traits=("tokens",),
        signature='SaliencyMix(layer, alpha=1.0, saliency="activation", saliency_layer=None, mode="batch")',
        hook='forward, `(B,C,H,W)` outputs or ViT tokens (+ one forward/backward for `"gradient"`)',
        commands="`mixup=saliencymix mixup.layer=layer1`, `mixup.saliency=gradient mixup.layer=input`",
        details=(
            "CutMix's box centred on the partner's most salient position, `h[index]`'s box pasted at the "
            "same place; `mode=\"batch\"`: one box on the first partner's peak (the authors' code), "
            '`"elem"`: one per sample; lam ← kept area; saliency `mean_c abs(h)` of the mixed map or of an '
            "earlier `saliency_layer` (same forward, no extra pass; not at `input`) or `sqrt(mean_c g²)` of "
            "the label loss's gradient (`use_targets(y)` first); `pin(saliency=...)` takes your own (the "
            "authors' OpenCV maps); box equal to the authors' `saliency_bbox` on the same map; "
            '`.last.info["box"]`, `["saliency"]`'
        ),
        example={"layer": "input", "saliency": "gradient"},
    )

    pin_keys = ("box", "saliency")

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 1.0,
        saliency: str = "activation",
        saliency_layer: str | None = None,
        mode: str = "batch",
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout, tokens, prefix)
        self.saliency = Saliency("SaliencyMix", saliency, saliency_layer, self.layers)
        if mode not in ("batch", "elem"):
            raise ValueError(f"mode must be 'batch' or 'elem', got {mode!r}")
        self.mode = mode

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, {self.saliency!r}, mode={self.mode!r})"

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        h = check_spatial("SaliencyMix", spec, leaves)
        if min(h.shape[-2:]) < 2:
            raise ValueError(
                f"SaliencyMix at {spec!r}: its {h.shape[-2]}x{h.shape[-1]} map is too small to ever paste a "
                "box; choose an earlier layer"
            )

    def needs_saliency(self, pinned: Mapping) -> bool:
        return "box" not in pinned  # a pinned box is where it goes

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        n, height, width = h.shape[0], h.shape[-2], h.shape[-1]
        if draw.lam.ndim:
            raise ValueError(f"SaliencyMix draws one lam per batch: pin one lam, not {draw.lam.shape[0]}")
        pinned = draw.pinned.get("box")
        if pinned is not None:
            saliency = None
            if self.mode == "elem":
                boxes = pinned_boxes("SaliencyMix(mode='elem')", pinned, n, height, width, draw.layer)
            else:
                boxes = torch.tensor([draw_box(draw, height, width)])
        else:  # placed on the map's device: the peaks are never read on the host
            saliency = pinned_saliency("SaliencyMix", draw.pinned, n, height, width, h.device)
            index = to_device(draw.index, h.device)
            cy, cx = peaks(saliency[index if self.mode == "elem" else index[:1]])
            boxes = boxes_around(height, width, draw.lam, cy, cx)
        mixed = paste_boxes(h, path, draw.index, boxes)
        lam, weights, box = mixed.lam, mixed.weights, mixed.info["box"]
        if self.mode == "batch":
            lam, box = lam[0], box[0]
        return Mixed(mixed.tensors, lam=lam, info={"box": box, "saliency": saliency}, weights=weights)

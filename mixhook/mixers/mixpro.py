"""MixPro for ViTs: MaskMix (a random grid of cells from the partner) with progressive attention labelling
(the label weights move from the mask's area toward the class token's attention as the prediction agrees).

Paper: Zhao, Huang, Hu, Zhang, Liu. "MixPro: Data Augmentation with MaskMix and Progressive
Attention Labeling for Vision Transformer." ICLR 2023. https://arxiv.org/abs/2304.12043. Authors' code:
github.com/fistyee/MixPro (``utils.py``: ``MaskMix``, ``mixup_target``; ``main.py``: the labels and loss).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import recompute
from ..engine.card import Card
from ..engine.checks import check_non_negative, check_spatial
from ..engine.contract import Draw, Mixed, MixState
from ..engine.regions import RegionMixer
from ..engine.tokens import model_grid
from ..functional import sample_lam, smooth_one_hot
from ..layers import resolve_layer
from ..sites import INPUT, Leaf
from ..transfer import to_device
from .transmix import ReadsAttention, TransMix, attention_grid, check_attention, check_class_token


class MixPro(ReadsAttention, RegionMixer):
    """MixPro (Zhao et al. 2023) on a ViT: at the input (the paper), or on a block's tokens with ``tokens``.

    **MaskMix.** On each training forward, with probability ``prob``: ``lam ~ Beta(alpha, alpha)``, a
    permutation ``index``, and for each sample its own mask of ``cell x cell`` cells over the map
    (``ceil(H / cell) x ceil(W / cell)`` of them, the last row and column cropped): ``ceil(lam * N)`` of
    the ``N`` cells, drawn at random, keep the sample's own content, the rest come from its partner. The
    area weight is ``lam_a = ceil(lam * N) / N`` (the authors' ``mask_ratio``, also where the crop makes
    the kept pixels a little more or less).

    **Progressive attention labelling.** When ``attention`` runs (the last block's attention, after the
    mix, in the same forward: no extra pass), the class token's attention ``a`` over the patches
    (averaged over heads; recomputed without gradients from the module's inputs, as
    :class:`~mixhook.TransMix` reads it) gives ``lam_att = sum(a * M) / sum(a)``, ``M`` the mask at patch
    resolution. At the loss, with the forward's prediction ``p = softmax(logits)`` and the smoothed mixed
    target ``t = lam_a * s(y) + (1 - lam_a) * s(y[index])`` (``smoothing``):

        ``sim = cos(t, p)``,   ``lam = sim * lam_att + (1 - sim) * lam_a``

    one per sample (``loss`` needs a per-sample criterion, ``reduction="none"``; ``targets`` needs
    ``logits=``). ``.last.lam`` is ``lam_a``; ``.last.info``: ``"cells"`` (``(B, rows, cols)``),
    ``"attention_lam"``, and, once a loss was taken, ``"lam"`` and ``"similarity"``.

    Equal to the authors' ``MaskMix`` and labels on the same draws (tested), with the prediction in
    ``sim`` taken as a constant: their ``main.py`` leaves ``softmax(outputs)`` attached, so their loss
    also back-propagates through the label weights (a term the paper does not describe); OpenMixup's port
    detaches it, as here. OpenMixup's port also reads the attention from a second forward of the unmixed
    images, which the authors' code does not.

    Args:
        layer: ``"input"`` (the paper) or a ViT block with ``tokens``.
        attention: the attention module whose class-token row weighs the labels (the authors: the last
            block's, e.g. ``"blocks.11.attn"``); it must run after ``layer``.
        alpha: Beta concentration, > 0 (the authors' DeiT configs: 1.0).
        cell: a mask cell's side, in the mixed map's positions (pixels at the input, tokens on a block's
            tokens), a whole number of patches; ``None`` (default): four patches a side, read from the
            model's patch grid (the authors' DeiT configs: 56 pixels with 14-pixel patches, ``mask56``;
            OpenMixup's: 64 with 16).
        smoothing: the label smoothing of the target ``t`` the prediction is compared with (theirs: 0.1).
        prob, generator, batch_dim, padding, tokens, prefix, layout: as :class:`~mixhook.CutMix`.

    ``pin`` also takes ``cells`` (``(B, rows, cols)``, 1: own).
    """

    card = Card(
        paper="Zhao et al. 2023",
        mixes="random cells; labels moving to attention",
        where="ViT input or tokens; needs attention",
        family="attention",
        traits=("tokens", "attention"),
        signature="MixPro(layer, attention, alpha=1.0, cell=None, smoothing=0.1)",
        hook="forward, ViT inputs or tokens, + a forward hook on the attention layer",
        commands="`mixup=mixpro`",
        details=(
            "MaskMix: each sample keeps `ceil(lam·N)` random `cell×cell` cells of its own (default four "
            "patches a side), the rest from `h[index]`; lam_a ← kept cells' share; at the loss `lam = "
            "sim·lam_att + (1-sim)·lam_a`, `lam_att` the class token's attention over the kept patches (the "
            "named attention layer of the same forward, as TransMix), `sim` the cosine between the "
            "prediction and the smoothed mixed target (one per sample); equal to the authors' `MaskMix` and "
            "labels on the same draws (their prediction in `sim` is not detached; OpenMixup's port detaches "
            "it, as here)"
        ),
        # (the ViT TransMix is shown on, its attention layer the same; cells of one patch: its 4x4 patch
        # grid is one cell of the default four patches a side, which mixes nothing and is refused)
        app=(*TransMix.card.app, "mixup.cell=2"),
        shown_on="vit",
        example={**TransMix.card.example, "cell": 2},  # (one patch: 16 cells; the default is one cell there)
        drawn={
            "attention": TransMix.card.drawn["attention"],
            "input": {"cell": 16},  # cells of 2x2 patches: 16 pixels at the input, 2 tokens on the tokens
            "hidden": {"tokens": "auto", "cell": 2},
        },
    )

    pin_keys = ("cells",)
    region_dims = (2,)

    dense_targets = (
        "weighs each image's labels by its attention and its prediction: it has no per-position labels for "
        "a dense target"
    )

    def __init__(
        self,
        layer: str | Sequence[str],
        attention: str,
        alpha: float = 1.0,
        cell: int | None = None,
        smoothing: float = 0.1,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout, tokens, prefix)
        if not isinstance(attention, str) or not attention:
            raise ValueError(f"attention must be the name of an attention module, got {attention!r}")
        if cell is not None and (isinstance(cell, bool) or not isinstance(cell, int) or cell < 1):
            raise ValueError(f"cell must be a mask cell's side in positions, an int >= 1, got {cell!r}")
        smoothing = check_non_negative("smoothing", smoothing)
        if smoothing >= 1:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        self.attention, self.cell, self.smoothing = attention, cell, smoothing

    def __repr__(self) -> str:
        return (
            f"MixPro(layer={self._layer_spec!r}, attention={self.attention!r}, alpha={self.alpha}, "
            f"cell={self.cell}, prob={self.prob})"
        )

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        _, module = resolve_layer(model, self.attention, "attention")
        check_attention("MixPro", self.attention, module)
        super()._register(model, modules, handles)
        read = self._attention_reader(model, "attention_lam", self._attended)
        handles.append(module.register_forward_hook(recompute.hook(read), with_kwargs=True))

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return sample_lam(self.alpha, generator)

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        """A map, cut into more than one cell (one cell: every sample would keep all its own content, a mix
        of nothing; refused in one line, before training where the app checks a sample batch)."""
        check_spatial("MixPro", spec, leaves)
        height, width = leaves[0].tensor.shape[2:4]
        cell = self._cell(spec, height)
        if math.ceil(height / cell) * math.ceil(width / cell) < 2:
            raise ValueError(
                f"MixPro at {spec!r}: cell={cell} covers the whole {height}x{width} map in one cell, so "
                "nothing would be mixed; pass a smaller cell, a whole number of patches "
                f"(cell={max(cell // 4, 1)} is one patch where the default is four)"
            )

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        n, (height, width) = h.shape[0], h.shape[2:]
        if draw.lam.ndim:
            raise ValueError(f"MixPro draws one lam per batch: pin one lam, not {draw.lam.shape[0]}")
        cell = self._cell(draw.layer, height)
        rows, cols = math.ceil(height / cell), math.ceil(width / cell)
        cells = self._cells(n, rows, cols, draw)
        kept = cells.flatten(1).sum(1).to(torch.float64) / (rows * cols)
        own = cells.repeat_interleave(cell, 1).repeat_interleave(cell, 2)[:, :height, :width]
        mixed = torch.where(to_device(own, h.device)[:, None], h, h[to_device(draw.index, h.device)])
        info = {"cells": cells, "map": (height, width), "cell": cell}
        return Mixed({path: mixed}, lam=kept, info=info, weights=own)

    def _cell(self, spec: str, height: int) -> int:
        """The cell side at ``spec``: ``cell``, or four patches of the model's patch grid."""
        if self.cell is not None:
            return self.cell
        if self.token_grid is not None and self.sites[spec].layer != INPUT:
            return 4  # (the block's tokens: one position per patch)
        stated = model_grid(self._model, within=self.attention)
        if stated is None:
            raise TypeError(
                f"MixPro: {type(self._model).__name__} does not state its patch grid; give cell=... (a mask "
                "cell's side in positions, a whole number of patches)"
            )
        return 4 * (height // stated.rows)

    def _attended(self, model: nn.Module, last: MixState, weights: torch.Tensor) -> MixState:
        """``last`` with ``lam_att``, from the class token's attention ``weights`` ``(B, T)`` (with the clean
        batch kept, its mixed rows)."""
        if last.clean:
            weights = weights[last.index.shape[0] :]
        patch_rows, patch_cols, prefix = attention_grid(self, model, weights.shape[1])
        check_class_token(self, model, prefix, "MixPro weighs the labels by the class token's attention")
        height, width = last.info["map"]
        patch, cell = height // patch_rows, last.info["cell"]
        if height % patch_rows or width % patch_cols or width // patch_cols != patch or cell % patch:
            raise ValueError(
                f"MixPro: cell={cell} is not a whole number of the patches of the {height}x{width} map "
                f"({patch_rows}x{patch_cols} of them, as attention layer {self.attention!r} attends over)"
            )
        step = cell // patch
        cells = last.info["cells"]
        on_patches = cells.repeat_interleave(step, 1).repeat_interleave(step, 2)[:, :patch_rows, :patch_cols]
        a = weights[:, prefix:].to(torch.float64)
        m = to_device(on_patches.flatten(1), a.device, torch.float64)
        w_own, w_partner = (a * m).sum(1), (a * (1 - m)).sum(1)
        info = {**last.info, "attention_lam": (w_own / (w_own + w_partner)).cpu()}
        return dataclasses.replace(last, info=info)

    def _cells(self, n: int, rows: int, cols: int, draw: Draw) -> torch.Tensor:
        """The ``(n, rows, cols)`` boolean cells each sample keeps: pinned (checked), or ``ceil(lam * N)``
        of the ``N`` cells drawn without replacement per sample from ``draw.generator``."""
        cells = draw.pinned.get("cells")
        if cells is not None:
            cells = torch.as_tensor(cells).to(torch.bool).cpu()
            if cells.shape != (n, rows, cols):
                raise ValueError(
                    f"pinned cells of shape {tuple(cells.shape)} do not fit the batch of {n} and the "
                    f"{rows}x{cols} cells of layer {draw.layer!r}"
                )
            return cells
        count = rows * cols
        kept = math.ceil(count * float(draw.lam))
        g = draw.generator
        order = torch.rand(n, count, generator=g, device=g.device).argsort(1).cpu()
        cells = torch.zeros(n, count, dtype=torch.bool)
        cells.scatter_(1, order[:, :kept], True)
        return cells.view(n, rows, cols)

    def labelled(self, last: MixState, logits: torch.Tensor, target: torch.Tensor) -> MixState:
        if "attention_lam" not in last.info:
            raise RuntimeError(
                f"MixPro: attention layer {self.attention!r} did not run after the mix in the forward that "
                "produced these logits; name the last block's attention"
            )
        if target.dtype.is_floating_point or target.ndim != 1:
            raise ValueError(
                f"MixPro compares its prediction with smoothed class labels: give (B,) class indices, got "
                f"{target.dtype} {tuple(target.shape)}"
            )
        if last.clean:  # (clean=True: the logits' mixed rows follow the clean ones)
            logits = logits[last.index.shape[0] :]
        classes = logits.shape[1]
        area = to_device(last.lam, logits.device, torch.float64)
        index = to_device(last.index, logits.device)
        soft = smooth_one_hot(target.to(logits.device), classes, self.smoothing, torch.float64)
        mixed = area[:, None] * soft + (1 - area[:, None]) * soft[index]
        p = F.softmax(logits.detach().to(torch.float64), dim=-1)
        sim = F.cosine_similarity(mixed, p, dim=1)
        attention = to_device(last.info["attention_lam"], logits.device, torch.float64)
        lam = (sim * attention + (1 - sim) * area).cpu()
        last.info.update(lam=lam, similarity=sim.cpu())  # (readable from .last.info once a loss was taken)
        return dataclasses.replace(last, lam=lam)

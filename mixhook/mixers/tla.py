"""TL-Align (token-label alignment) for ViTs: CutMix on the patch grid whose labels are carried token by
token through every attention layer, the class token's (or the pooled tokens') label the one trained on.

Paper: Xiao, Zheng, Zhu, Zhou, Lu. "Token-Label Alignment for Vision Transformers." ICCV 2023.
https://arxiv.org/abs/2210.06455. Authors' code: github.com/Euphoria16/TL-Align (``tla.py``, ``TL_AlignMix``;
``timm/models/vision_transformer.py``, ``Attention.forward`` and ``Block.forward`` with ``label_embed``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import recompute
from ..engine.card import Card
from ..engine.contract import Draw, Mixed, MixState
from ..engine.tokens import grid_holder
from ..geometry import box_slices
from ..layers import resolve_layers
from ..sites import INPUT, Leaf
from ..transfer import to_device
from .cutmix import CutMix, draw_region, pasted
from .transmix import ReadsAttention, attention_grid, check_attention, check_class_token, stated_grid

READOUTS = ("auto", "class", "mean")


class TLA(ReadsAttention, CutMix):
    """TL-Align (Xiao et al. 2023): CutMix of a ViT's patches (at the input, the box drawn on the patch grid;
    or on a block's tokens with ``tokens``) whose labels follow the tokens through the attention layers.

    Each token carries a label: after the mix, a patch token's is its sample's one-hot, or its partner's
    inside the box, and the leading (class, register) tokens' is the mixed target (``lam`` of the sample's,
    ``1 - lam`` of its partner's; with ``prefix="keep"`` on a block's tokens, the sample's own). Every
    attention layer of ``attention`` that runs after the mix carries them on as the authors' blocks do,
    ``L <- (mean_heads(A) @ L + L) / 2``, ``A`` that layer's attention weights (softmax, before attention
    dropout, recomputed without gradients from the layer's inputs: fused attention never forms them), and
    the target is the label of the token the head reads: the class token's, or the patch tokens' mean for a
    model that pools them (``readout``). Each token's label is a convex combination of the two samples'
    labels, so the target is one lam per sample (``loss`` needs a per-sample criterion,
    ``reduction="none"``); equal to the authors' ``label_embed[:, 0]`` on the same box and partners (the
    authors pair each sample with the batch flipped; here ``index`` is drawn, or pinned).

    ``.last.info``: ``"box"`` (the box on the patch grid, ``(y1, y2, x1, x2)`` in patches: the authors'
    ``rand_token_bbox``, CutMix's box drawn on that grid), ``"area_lam"`` (the patches kept: CutMix's
    lam), ``"token_labels"`` (``(B, T)`` float64, each token's partner share after the last attention layer),
    ``"prefix"`` (the leading tokens among them) and ``"aligned"`` (the attention layers the labels went
    through).

    Args:
        layer: ``"input"`` (the paper: the box on the model's patch grid, pasted in pixels) or a block
            with ``tokens``.
        attention: the attention modules that carry the labels: a name, a glob or a list
            (``"blocks.*.attn"`` in timm, ``"encoder.layers.*.self_attention"`` in torchvision,
            ``"vit.layers.*.attention"`` in HuggingFace; the paper: every block's). Those that run before
            the mixed layer carry nothing; a training forward that mixed and ran none of them after the mix
            is refused in one line (it would be CutMix).
        alpha: Beta concentration of the box size, > 0 (the authors: 1.0).
        readout: the token whose label is the target: ``"class"`` (the first token), ``"mean"`` (the mean
            of the patch tokens, the leading ones left out, as timm's ``global_pool="avg"``) or ``"auto"``
            (default: what the model states: timm's ``global_pool``, the class token of torchvision's and
            HuggingFace's ViTs; a model that states nothing is refused in one line).
        prob, generator, batch_dim, padding, tokens, prefix, layout: as :class:`~mixhook.CutMix`.
        rounding: the box's, as :class:`~mixhook.CutMix` (``"paper"``: the authors' ``rand_token_bbox``).

    ``pin`` takes what CutMix's does; a pinned ``box`` is on the patch grid.
    """

    card = Card(
        paper="Xiao et al. 2023",
        mixes="CutMix on the patch grid, the labels carried through the attention",
        where="ViT input or tokens; needs attention",
        family="attention",
        traits=("tokens", "attention"),
        signature='TLA(layer, attention, alpha=1.0, readout="auto")',
        hook="forward, ViT inputs or tokens, + forward hooks on the attention layers and the model",
        commands="`mixup=tla experiment=vit_digits` (the app's ViT recipe)",
        details=(
            "CutMix's box drawn on the patch grid; each token carries a label (its sample's, its partner's "
            "inside the box, the mixed target on the class token) and every named attention layer after the "
            "mix carries them on, `L ← (mean_heads(A)·L + L)/2`; the target is the class token's label (or "
            "the patch tokens' mean, `readout`); one lam per sample; equal to the authors' `label_embed` on "
            'the same box; `.last.info["token_labels"]`, `["aligned"]`, `["area_lam"]`'
        ),
        app=("experiment=vit_digits",),  # (timm's ViT-Tiny on digits with AdamW: the app's ViT recipe)
        shown_on="vit",
        example={"layer": "input", "attention": "blocks.*.attn"},
        drawn={"attention": "encoder.layers.*.self_attention", "hidden": {"tokens": "auto"}},
    )

    dense_targets = (
        "weighs each image's labels by the labels its tokens carried through the attention: it has no "
        "per-position labels for a dense target"
    )

    def __init__(
        self,
        layer: str | Sequence[str],
        attention: str | Sequence[str],
        alpha: float = 1.0,
        readout: str = "auto",
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        rounding: str = "paper",
        layout: str | dict | None = None,
    ):
        super().__init__(
            layer, alpha, prob, generator, batch_dim, padding, "batch", tokens, prefix, rounding, layout
        )
        names = [attention] if isinstance(attention, str) else list(attention or ())
        if not names or not all(isinstance(a, str) and a for a in names):
            raise ValueError(
                "attention must name the attention modules (a name, a glob such as 'blocks.*.attn', or a "
                f"list), got {attention!r}"
            )
        if readout not in READOUTS:
            raise ValueError(f"readout must be one of {', '.join(READOUTS)}, got {readout!r}")
        self._check_patch_sites("its labels follow a ViT's tokens", "'input' (the box on the patch grid)")
        self.attention = attention if isinstance(attention, str) else tuple(names)
        self.readout = readout
        self._pool: str | None = None  # the readout the attached model states ("class" or "mean")
        self._within: str | None = None  # the first attention layer's real name (where a grid is looked for)
        self._grid: tuple[int, int] | None = None  # the patch grid of each mix (set by the mix)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, attention={self.attention!r}, readout={self.readout!r})"

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        names = [self.attention] if isinstance(self.attention, str) else list(self.attention)
        found = resolve_layers(model, names)
        for name, module in found.items():
            check_attention("TLA", name, module)
        self._within = next(iter(found))
        self._pool = self._stated_readout(model, self._within)
        # (before the path's own hooks: the model's forward hook must see the forward before it ends)
        handles.append(model.register_forward_hook(recompute.hook(self._check_aligned)))
        super()._register(model, modules, handles)
        for module in found.values():
            handles.append(module.register_forward_hook(recompute.hook(self._carry(model)), with_kwargs=True))

    def _reset(self) -> None:
        super()._reset()
        self._pool, self._within, self._grid = None, None, None

    def _stated_readout(self, model: nn.Module, attention: str) -> str:
        """``readout``, or with ``"auto"`` the token the model's head reads: timm's ``global_pool``
        (``"token"``: the class token, ``"avg"``: the patch tokens' mean), torchvision's and HuggingFace's
        ViTs' class token; else a one-line error."""
        if self.readout != "auto":
            return self.readout
        holder = grid_holder(model, attention)  # (the ViT that states the grid: its head's pooling)
        pool = getattr(holder, "global_pool", None)
        if isinstance(pool, str):
            if pool in ("token", "avg"):
                return "class" if pool == "token" else "mean"
            raise ValueError(
                f"TLA: {type(holder).__name__} pools its tokens with global_pool={pool!r}, whose label TLA "
                "cannot carry (it carries the class token's, 'token', or the patch tokens' mean, 'avg')"
            )
        if holder is not None:
            return "class"  # (torchvision's and HuggingFace's ViTs: the head reads the class token)
        raise ValueError(
            f"TLA: {type(model).__name__} does not state which token its head reads; pass readout='class' "
            "(the first token) or readout='mean' (the mean of the patch tokens)"
        )

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        if draw.lam.ndim:
            raise ValueError(f"TLA cuts one box per batch: pin one lam, not {draw.lam.shape[0]}")
        height, width = h.shape[2:]
        if self.sites[draw.layer].layer != INPUT:  # (a block's tokens: the map is the patch grid)
            self._grid = (height, width)
            mixed = pasted(h, path, draw.index, draw_region(draw, (height, width), self.rounding))
            return dataclasses.replace(mixed, info={**mixed.info, "area_lam": mixed.lam})
        rows, cols = self._input_grid(height, width)
        self._grid = (rows, cols)
        box = draw_region(draw, (rows, cols), self.rounding)
        ph, pw = height // rows, width // cols
        pixels = (box[0] * ph, box[1] * ph, box[2] * pw, box[3] * pw)
        mixed = pasted(h, path, draw.index, pixels)  # (its lam: the patches kept, as the box is on the grid)
        return dataclasses.replace(mixed, info={"box": box, "area_lam": mixed.lam})

    def _input_grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid of the model's ``height x width`` input (from ``tokens``, else from the model),
        dividing it evenly; else a one-line error."""
        if self.token_grid is not None and self.token_grid.grid is not None:
            rows, cols = self.token_grid.grid
        else:
            stated = stated_grid("TLA", self._model, self._within)
            rows, cols = stated.rows, stated.cols
        if height % rows or width % cols:
            raise ValueError(
                f"TLA at 'input': the {height}x{width} input is not a whole number of patches of the "
                f"{rows}x{cols} patch grid, so no box on the grid is a box of pixels"
            )
        return rows, cols

    def _carry(self, model: nn.Module):
        """The hook on one attention layer that, in a training forward after the mix, carries the tokens'
        labels through it."""

        def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            if self._reading or not model.training or self.in_gradient_pass:
                return
            draw, last = self.current, self.last
            if draw is None or not draw.done or last is None:  # (no mix, or the mix is yet to come)
                return
            self.last = self._carried(model, last, self._read(module, args, kwargs))

        return hook

    def _carried(self, model: nn.Module, last: MixState, weights: torch.Tensor) -> MixState:
        """``last`` with its tokens' labels carried through one attention layer's ``weights``
        ``(B, T, T)`` (with the clean batch kept, its mixed rows), and the lam its readout gives."""
        if last.clean:
            weights = weights[last.index.shape[0] :]
        labels, prefix = last.info.get("token_labels"), last.info.get("prefix")
        if labels is None:
            labels, prefix = self._first_labels(model, last, weights)
        elif labels.shape[1] != weights.shape[1]:
            raise ValueError(
                f"TLA: an attention layer of {weights.shape[1]} tokens ran after one of {labels.shape[1]}; "
                "the labels follow one sequence of tokens: name attention layers over the same tokens"
            )
        carried = (weights @ labels.to(weights.dtype).unsqueeze(-1)).squeeze(-1)  # (float32 at least)
        labels = (carried.to(torch.float64) + labels) / 2
        partner = labels[:, 0] if self._pool == "class" else labels[:, prefix:].mean(1)
        aligned = last.info.get("aligned", 0) + 1
        info = {**last.info, "token_labels": labels, "prefix": prefix, "aligned": aligned}
        return dataclasses.replace(last, lam=1 - partner, info=info)

    def _first_labels(self, model: nn.Module, last: MixState, weights: torch.Tensor) -> tuple:
        """The ``(B, T)`` partner shares of the tokens' labels as the mix left them: 1 on the patches of the
        box, 0 on the others; the leading tokens ``1 - lam`` (the mixed target; with ``prefix="keep"`` on
        a block's tokens, 0), and the number of leading tokens."""
        rows, cols, prefix = attention_grid(self, model, weights.shape[1])
        if self._pool == "class":
            check_class_token(self, model, prefix, "readout='class' reads its label", self._within)
        if (rows, cols) != self._grid:
            raise ValueError(
                f"TLA: the attention layers see a {rows}x{cols} patch grid, the mix cut a "
                f"{self._grid[0]}x{self._grid[1]} one; mix the tokens those layers attend over"
            )
        cells = torch.zeros(rows, cols, dtype=torch.float64)
        cells[box_slices(last.info["box"])] = 1
        keep = self.sites[last.layer].layer != INPUT and self.token_grid.prefix == "keep"
        lead = torch.full((prefix,), 0.0 if keep else 1 - float(last.info["area_lam"]), dtype=torch.float64)
        labels = to_device(torch.cat([lead, cells.flatten()]), weights.device)
        return labels.expand(weights.shape[0], -1), prefix

    def _check_aligned(self, model: nn.Module, args: tuple, output) -> None:
        """At the end of a training forward that mixed: refused in one line where no attention layer ran
        after the mix (its labels would be CutMix's, without a word)."""
        if not model.training or self.in_gradient_pass:
            return
        draw, last = self.current, self.last
        if draw is not None and draw.done and last is not None and "aligned" not in last.info:
            raise RuntimeError(
                f"TLA: no attention layer of attention={self.attention!r} ran after the mixed layer "
                f"{last.layer!r}, so no label was carried; name the attention layers after it (the paper: "
                "every block's)"
            )

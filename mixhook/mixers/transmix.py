"""TransMix for ViTs: CutMix whose label weights follow the class token's attention over the pasted patches.

Paper: Chen, Sun, He, Torr, Yuille, Bai. "TransMix: Attend to Mix for Vision
Transformers." CVPR 2022. https://arxiv.org/abs/2111.09833. Authors' code: github.com/Beckschen/TransMix
(``transmix.py``, ``transmix_label``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import recompute
from ..engine.card import Card
from ..engine.checks import check_fraction
from ..engine.tokens import grid_holder, model_grid
from ..geometry import boxes_mask
from ..layers import resolve_layer
from ..sites import INPUT, Inputs
from .cutmix import CutMix


def class_attention(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """The class token's attention over every token, averaged over heads, ``(B, T)``: the first row of
    :func:`attention_weights`."""
    return attention_weights(module, args, kwargs, first=True)[:, 0]


def attention_weights(module: nn.Module, args: tuple, kwargs: dict, first: bool = False) -> torch.Tensor:
    """The attention weights of every query over every token, averaged over heads, ``(B, T, T)`` (with
    ``first``, of the first query only, ``(B, 1, T)``), recomputed (without gradients) from the inputs an
    attention module was called with: timm's ``Attention`` (its ``qkv``, ``q_norm``/``k_norm``,
    ``scale``; fused or not), HuggingFace's ViT attention (``q_proj``/``k_proj``, whatever attention
    implementation is set) or ``nn.MultiheadAttention`` (batch first or not, called again in eval mode:
    its weights before attention dropout, and no draw from the global random state). The softmax is taken
    in float32 at least (as HuggingFace's eager attention does), so a bfloat16 forward reads its weights
    at float32 precision."""
    kind = _attention_kind(module)
    if kind == "mha":
        inputs = Inputs(module, args, kwargs)
        query, key = inputs.get("query"), inputs.get("key")
        value = inputs.get("value")
        masks = {k: inputs.get(k) for k in ("key_padding_mask", "attn_mask") if inputs.get(k) is not None}
        training = module.training
        module.training = False  # (its dropout would drop weights, and draw from the global generator)
        try:
            _, weights = module(query, key, value, need_weights=True, average_attn_weights=True, **masks)
        finally:
            module.training = training
        return weights[:, :1] if first else weights  # (B, L, S) whatever the layout
    x = args[0] if args else kwargs.get("x", kwargs.get("hidden_states"))
    b, t, _ = x.shape
    if kind == "timm":
        qkv = module.qkv(x).reshape(b, t, 3, module.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, scale = module.q_norm(qkv[0]), module.k_norm(qkv[1]), module.scale
    else:  # HuggingFace: (B, T, heads * head_dim) projections
        q = module.q_proj(x).view(b, t, -1, module.head_dim).transpose(1, 2)
        k = module.k_proj(x).view(b, t, -1, module.head_dim).transpose(1, 2)
        scale = module.scaling
    q = q[:, :, :1] if first else q
    scores = (q * scale) @ k.transpose(-2, -1)  # (B, heads, 1 or T, T)
    return scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).mean(1)


def _attention_kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.MultiheadAttention):
        return "mha"
    if all(hasattr(module, a) for a in ("qkv", "num_heads", "scale", "q_norm", "k_norm")):
        return "timm"
    if all(hasattr(module, a) for a in ("q_proj", "k_proj", "head_dim", "scaling")):
        return "hf"
    return None


def stated_grid(kind: str, model: nn.Module, within: str):
    """The patch grid ``model`` states (:func:`~mixhook.engine.tokens.model_grid`, looking into the modules
    around ``within``, an attention layer's name), or a one-line ``TypeError`` naming the method ``kind``."""
    stated = model_grid(model, within=within)
    if stated is None:
        raise TypeError(
            f"{kind}: {type(model).__name__} does not state its patch grid; use a timm, torchvision or "
            "HuggingFace ViT, or mix its tokens with tokens=(rows, columns)"
        )
    return stated


def attention_grid(mixer, model: nn.Module, count: int) -> tuple[int, int, int]:
    """The patch grid ``(rows, columns)`` and the number of leading tokens of the ``count`` tokens the
    attention layer ``mixer.attention`` attends over: from ``mixer.token_grid`` (``tokens=``), else from
    the model (a timm, torchvision or HuggingFace ViT); else a one-line error."""
    kind = type(mixer).__name__
    if mixer.token_grid is not None and mixer.token_grid.grid is not None:
        rows, cols = mixer.token_grid.grid
        return rows, cols, count - rows * cols
    stated = stated_grid(kind, model, mixer.attention)
    prefix = count - stated.rows * stated.cols
    if prefix < 0 or (stated.prefix is not None and prefix != stated.prefix):
        raise ValueError(
            f"{kind}: attention layer {mixer.attention!r} has {count} tokens, which do not fit the "
            f"model's {stated.rows}x{stated.cols} patches and {stated.prefix} leading tokens"
        )
    return stated.rows, stated.cols, prefix


def check_class_token(mixer, model: nn.Module, prefix: int, reads: str, within: str | None = None) -> None:
    """A one-line ``ValueError`` where the tokens ``mixer.attention`` (or the attention layer ``within``)
    attends over have no class token first (no leading token, or a model that states it has none, timm's
    ``class_token=False`` with registers), for a method that ``reads`` it: it would read a patch's or a
    register's attention without a word."""
    stated = getattr(grid_holder(model, within or mixer.attention), "has_class_token", None)
    if prefix == 0 or stated is False:
        what = "its leading tokens are registers" if prefix else "it attends over patches alone"
        raise ValueError(
            f"{type(mixer).__name__}: attention={mixer.attention!r} has no class token ({what}), and "
            f"{reads}; train a ViT with a class token"
        )


def check_attention(kind: str, name: str, module: nn.Module) -> None:
    """A one-line ``TypeError`` unless ``module`` (named ``name``) is an attention module whose class
    token's weights :func:`class_attention` can read."""
    if _attention_kind(module) is None:
        raise TypeError(
            f"{kind}: attention={name!r} is a {type(module).__name__}, not an attention module whose weights "
            "can be read (timm's Attention, HuggingFace's ViT attention, nn.MultiheadAttention); name the "
            "block's attention, e.g. 'blocks.11.attn' or 'encoder.layers.encoder_layer_11.self_attention'"
        )


class ReadsAttention:
    """What the methods that read a ViT's attention share (listed before their mixer base): reading an
    attention layer's weights from inside a hook on it (:meth:`_read`), reading them in a forward of the
    unmixed batch (:meth:`_unmixed_attention`: SMMix, MergeMix), the patch grid of the mixed map
    (:meth:`_patch_grid`), and TransMix's and MixPro's forward hook that reads the class token's attention
    once per training forward that mixed."""

    _reading = False  # (True while this mixer reads a layer's weights: the layer may be called again)
    _recording: list | None = None  # (the weights read while :meth:`_unmixed_attention` runs the model)

    def _read(self, module: nn.Module, args: tuple, kwargs: dict, read=attention_weights):
        """``read(module, args, kwargs)`` without gradients, from a hook on ``module``, with
        :attr:`_reading` set meanwhile: ``nn.MultiheadAttention`` is called again to give its weights,
        and this mixer's hooks on it, called with it, return at once while it is set."""
        self._reading = True
        try:
            with torch.no_grad():
                return read(module, args, kwargs)
        finally:
            self._reading = False

    def _recorder(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        """The forward hook (``with_kwargs``) on ``attention`` that records its weights while
        :meth:`_unmixed_attention` runs the model; it does nothing otherwise."""
        if self._recording is None or self._reading:
            return
        self._recording.append(self._read(module, args, kwargs))

    def _unmixed_attention(self, model: nn.Module, args: tuple, kwargs: dict):
        """The model once more on the unmixed batch, in eval mode without gradients
        (:meth:`~mixhook.engine.mixer.Mixer.unmixed_forward`), and the weights ``(B, T, T)`` of the last
        call of ``attention`` in it (read by :meth:`_recorder`, registered on it); a one-line error where
        it did not run."""
        self._recording = []
        try:
            output = self.unmixed_forward(model, args, kwargs)
            recorded = self._recording
        finally:
            self._recording = None
        if not recorded:
            raise RuntimeError(
                f"{type(self).__name__}: attention={self.attention!r} did not run in the model's forward"
            )
        return output, recorded[-1]

    def _check_patch_sites(self, why: str, at_input: str = "'input'") -> None:
        """At construction: a one-line refusal of a hidden layer named without ``tokens=`` (the method
        works on a ViT's patches: ``why``), for the methods that mix at the input or on a block's tokens."""
        hidden = [s for s in self.specs if self.sites[s].layer != INPUT]
        if hidden and self.token_grid is None:
            raise ValueError(
                f"{type(self).__name__} at {hidden[0]!r}: {why}, so it mixes at {at_input} or on a block's "
                "tokens; pass tokens='auto' or tokens=(rows, columns)"
            )

    def _patch_grid(self, spec: str, height: int, width: int) -> tuple[int, int, int, int]:
        """The patch grid of a ``height x width`` map mixed at ``spec``, and the positions a patch spans:
        on a block's tokens the map is the grid, ``(height, width, 1, 1)``; at the input, the grid of
        ``tokens=`` or the model's (:func:`stated_grid`), whole patches of pixels, or a one-line error
        where the input is not a whole number of them."""
        if self.sites[spec].layer != INPUT:
            return height, width, 1, 1
        if self.token_grid is not None and self.token_grid.grid is not None:
            rows, cols = self.token_grid.grid
        else:
            stated = stated_grid(type(self).__name__, self._model, self.attention)
            rows, cols = stated.rows, stated.cols
        if height % rows or width % cols:
            raise ValueError(
                f"{type(self).__name__} at 'input': the {height}x{width} input is not a whole number of "
                f"patches of the model's {rows}x{cols} patch grid"
            )
        return rows, cols, height // rows, width // cols

    def _attention_reader(self, model: nn.Module, recorded: str, labelled):
        """The hook that, once per training forward that mixed, after the mix, reads the class token's
        attention (:func:`class_attention`, without gradients) and makes ``self.last`` what
        ``labelled(model, last, weights)`` returns; ``recorded``: the key of ``last.info`` that says it
        was read (a second call of the layer reads nothing). An attention layer that runs before the
        mixed layer is refused in one line."""

        def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            if self._reading or not model.training or self.in_gradient_pass:
                return
            draw, last = self.current, self.last
            if draw is not None and not draw.done:
                raise RuntimeError(
                    f"{type(self).__name__}: attention layer {self.attention!r} ran before the mixed layer "
                    f"{draw.layer!r}; name an attention layer after it (the paper: the last block's)"
                )
            if draw is None or last is None or recorded in last.info:  # no mix, or a second call
                return
            self.last = labelled(model, last, self._read(module, args, kwargs, class_attention))

        return hook


class TransMix(ReadsAttention, CutMix):
    """TransMix (Chen et al. 2022): CutMix on a ViT (at the input, or on a block's tokens with ``tokens``)
    whose target weights are re-weighted by the class token's attention in a named attention layer of the
    same forward.

    The mix is :class:`~mixhook.CutMix`'s (one box per batch). When ``attention`` runs, the class token's
    attention ``a_i`` over the patch tokens (averaged over heads) is read and each sample's weight of its
    partner's label becomes ``ratio * (pasted area) + (1 - ratio) * sum(a_i * P) / sum(a_i)``, ``P`` the
    pasted region on the patch grid (the box resized to it, nearest); the sample keeps the rest. So
    ``.last.lam`` is one value per sample (``loss`` needs a per-sample criterion,
    ``reduction="none"``); ``.last.info["area_lam"]`` is CutMix's, ``["attention"]`` the ``(B, N)``
    attention. Equal to the authors' ``transmix_label`` on the same attention (``ratio=0.5``, theirs).

    The attention is recomputed from the layer's inputs without gradients (fused attention never forms
    it): one ``qkv`` projection of one block for timm's ``Attention``, the query and key projections for
    HuggingFace's ViT attention (``vit.layers.11.attention``), one attention call for
    ``nn.MultiheadAttention`` (torchvision's ViT). The patch grid and the leading tokens come from the
    model (timm, torchvision and HuggingFace ViTs state them) or from ``tokens``.

    Args:
        layer: where CutMix cuts: ``"input"`` (the paper) or a block with ``tokens``.
        attention: the attention module whose class-token row weighs the labels (the paper: the last
            block's, e.g. ``"blocks.11.attn"`` in timm, ``"encoder.layers.encoder_layer_11.self_attention"``
            in torchvision); it must run after ``layer``.
        alpha: Beta concentration of the box size, > 0 (the paper: 1.0).
        ratio: the weight of the area in the label weights, in [0, 1] (the authors' code: 0.5).
        prob, generator, batch_dim, padding, tokens, prefix, layout: as :class:`~mixhook.CutMix`.
        rounding: the box's, as :class:`~mixhook.CutMix`: ``"paper"`` by default, the rounding of the
            timm their code pins (0.5.0) had; ``"timm"`` is timm >= 1.0's.

    ``pin`` takes what CutMix's does.
    """

    card = Card(
        paper="Chen et al. 2022",
        mixes="CutMix labelled by the class token's attention",
        where="ViT input or tokens; needs attention",
        family="attention",
        traits=("tokens", "attention"),
        signature="TransMix(layer, attention, alpha=1.0, ratio=0.5)",
        hook="forward, ViT inputs or tokens, + a forward hook on the attention layer",
        commands="`mixup=transmix experiment=vit_digits` (the app's ViT recipe)",
        details=(
            "CutMix's mix; each sample's partner weight ← `ratio·(pasted area) + (1-ratio)·Σ a·P / Σ a`, `a` "
            "the class token's attention over the patches (heads averaged) in the named attention layer of "
            "the same forward (recomputed without gradients from timm's `Attention`, HuggingFace's ViT "
            "attention or `nn.MultiheadAttention`: fused attention never forms it), `P` the box on the patch "
            "grid; one lam per sample; equal to the authors' `transmix_label` on the same attention; "
            '`.last.info["attention"]`, `["area_lam"]`'
        ),
        app=("experiment=vit_digits",),  # (timm's ViT-Tiny on digits with AdamW: the app's ViT recipe)
        shown_on="vit",
        example={"layer": "input", "attention": "blocks.1.attn"},
        drawn={"attention": "encoder.layers.encoder_layer_1.self_attention", "hidden": {"tokens": "auto"}},
    )

    region_dims = (2,)  # the attention map scores a 2-D patch grid

    dense_targets = (
        "weighs each image's labels by the class token's attention over the pasted patches: it has no "
        "per-position labels for a dense target"
    )

    def __init__(
        self,
        layer: str | Sequence[str],
        attention: str,
        alpha: float = 1.0,
        ratio: float = 0.5,
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
        if not isinstance(attention, str) or not attention:
            raise ValueError(f"attention must be the name of an attention module, got {attention!r}")
        self.attention = attention
        self.ratio = check_fraction("ratio", ratio)
        self._map_size: tuple[int, int] | None = None  # the cut map's (H, W), set by each mix

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, attention={self.attention!r}, ratio={self.ratio})"

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        _, module = resolve_layer(model, self.attention, "attention")
        check_attention("TransMix", self.attention, module)
        super()._register(model, modules, handles)
        handles.append(
            module.register_forward_hook(recompute.hook(self._attention_hook(model)), with_kwargs=True)
        )

    def _attention_hook(self, model: nn.Module):
        return self._attention_reader(model, "attention", self._reweighted)

    def _reweighted(self, model: nn.Module, last, weights: torch.Tensor):
        if last.clean:  # (the clean batch kept: its mixed rows follow the clean ones)
            weights = weights[last.index.shape[0] :]
        rows, cols, prefix = self._grid(model, weights.shape[1])
        check_class_token(self, model, prefix, "TransMix weighs the labels by the class token's attention")
        attention = weights[:, prefix:].to("cpu", torch.float64)
        box = torch.as_tensor(last.info["box"]).view(1, 4)
        height, width = self._map_size
        pasted = boxes_mask(box, height, width)[0].to(torch.float64)  # (1, H, W): 1 inside the box
        if (height, width) != (rows, cols):
            pasted = F.interpolate(pasted[None], size=(rows, cols), mode="nearest")[0]
        pasted = pasted.flatten()
        w_partner, w_own = (attention * pasted).sum(1), (attention * (1 - pasted)).sum(1)
        partner = self.ratio * (1 - last.lam) + (1 - self.ratio) * w_partner / (w_own + w_partner)
        info = {**last.info, "area_lam": last.lam, "attention": attention}
        return dataclasses.replace(last, lam=1 - partner, info=info)

    def _grid(self, model: nn.Module, count: int) -> tuple[int, int, int]:
        return attention_grid(self, model, count)

    def mix(self, leaves, draw):
        self._map_size = tuple(leaves[0].tensor.shape[-2:])
        return super().mix(leaves, draw)

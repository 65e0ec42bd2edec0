"""MergeMix for ViTs: each image keeps its ``int(lam * N)`` most attended patches, read from the model's own
attention on the unmixed batch, and takes the rest from its partner; the label weighs the patches kept.

Paper: Jin, Li, Jian, Yu, Wang. "MergeMix: A Unified Augmentation Paradigm for Visual and Multi-Modal
Understanding." ICLR 2026. https://arxiv.org/abs/2510.23479. Authors' code: for image classification,
OpenMixup (github.com/Westlake-AI/openmixup, ``openmixup/models/classifiers/mergemix.py``, ``MergeMix``:
``ranking_mixup``, ``process_attention_map``, ``maximum_saliency``, ``forward_mix``), as their repository
(github.com/JinXins/MergeMix) directs; for LLaVA, ``LLaVA/llava/model/augment/augmenter.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import recompute
from ..engine.card import Card
from ..engine.checks import check_spatial
from ..engine.contract import Draw, Mixed
from ..engine.regions import RegionMixer
from ..layers import resolve_layer
from ..sites import Leaf
from ..transfer import to_device
from .transmix import ReadsAttention, attention_grid, check_attention, check_class_token

# What ranks the patches, from the attention weights A (B, T, T) of `attention` (query rows, key columns)
SCORES = ("to_class", "from_class", "patches", "first_patch")


class MergeMix(ReadsAttention, RegionMixer):
    """MergeMix (Jin et al. 2026) without its token merging: on a ViT (at the input, or on a block's tokens
    with ``tokens``), each image keeps its ``k = int(lam * N)`` patches of the highest score, read from the
    model's own attention on the unmixed batch, and takes the other ``N - k`` from its partner, position
    for position; ``lam ~ Beta(alpha, alpha)`` (one per batch), and the label's weight is the patches kept,
    ``k / N``.

    On each training forward that mixes, the model runs once more on the unmixed batch, in eval mode and
    without gradients (:meth:`~mixhook.engine.mixer.Mixer.unmixed_forward`), and the ``attention`` layer's
    weights ``A`` (heads averaged; the authors sum them, which ranks alike) score each patch (``score``):

    - ``"to_class"`` (default): the attention the patch pays the class token, ``A[:, patches, 0]``: the
      authors' classification code (``attn_based="tome"``), which reads the rows of the merged tokens'
      attention at the class token's column, read here with no token merged;
    - ``"from_class"``: the class token's attention to the patch, ``A[:, 0, patches]`` (the authors'
      LLaVA augmenter's ``attention[:, :, 0, 1:]``);
    - ``"patches"``: the attention the patches pay it, averaged over them (SMMix's; a ViT without a class
      token);
    - ``"first_patch"``: ``A[:, patches, patches][:, :, 0]``, the attention each patch pays the first patch:
      OpenMixup's ``attn_based="topk"`` as written (its class column dropped before the column is taken).

    Patches of equal score are ranked by position (the first kept first). The authors' runs merge tokens
    in that forward (ToMe: ``merge_num``; with their ``tome_in_mix=False`` in the training forwards too),
    which edits the blocks' forward and is not built; ``pin(scores=...)`` takes scores of your own,
    ``(B, N)``, such as a merged forward's recovered attention. Their ``lam_scale`` (most of their configs)
    replaces the label weight ``k / N`` by normal draws min-max normalised over the batch, which depend
    neither on ``k`` nor on the merging, and is not built. Their scoring forward runs in training mode
    (with drop-path: scores of a random sub-network); here it runs in eval mode, so the two agree on a model
    without dropout or drop-path. Their partners are a permutation redrawn (up to ten times) to avoid
    fixed points; here ``index`` is drawn as every mixer's (or pinned). Their step also adds the loss of a
    second forward of plain input mixup (``Beta(0.8, 0.8)``, their ``switch_off < 0``):
    ``OneOf([MergeMix(...), ManifoldMixup("input", alpha=0.8)])`` with ``pin(choice=1)`` then
    ``pin(choice=0)`` before two forwards, the two losses summed, is their step
    (tests/mixers/test_mergemix.py); their ``switch_off > 0`` (plain mixup with that probability) is that
    ``OneOf`` drawn with ``p=[1 - switch_off, switch_off]``.
    Equal to their lines on the same lam, partners, attention layer and scores.

    ``.last.info``: ``"scores"`` (``(B, N)``, float64) and ``"kept"`` (``(B,)``: the patches each image
    kept). Dense targets take each position's own share (its patch kept or not).

    Args:
        layer: ``"input"`` (the paper: whole patches of pixels) or a block with ``tokens``.
        attention: the attention module whose weights score the patches (the authors' configs: the last
            block's, the ninth of twelve, the sixth of eight, the eighteenth of twenty-four).
        alpha: the Beta concentration of lam, > 0 (the authors: 1).
        score: ``"to_class"`` (the authors'), ``"from_class"``, ``"patches"`` or ``"first_patch"``.
        prob, generator, batch_dim, padding, tokens, prefix, layout: as :class:`~mixhook.CutMix`.

    ``pin`` also takes ``scores``; a pinned lam may be one per sample (each keeps its own ``int(lam_i * N)``).
    """

    card = Card(
        paper="Jin et al. 2026",
        mixes="each image's most attended patches kept, the rest its partner's",
        where="ViT input or tokens; needs attention (+ an unmixed forward)",
        family="attention",
        traits=("tokens", "attention"),
        signature='MergeMix(layer, attention, alpha=1.0, score="to_class")',
        hook="forward, ViT inputs or tokens, + a forward hook on the attention layer",
        commands="`mixup=mergemix experiment=vit_digits` (the app's ViT recipe)",
        details=(
            "An unmixed eval forward scores each patch by the attention it pays the class token (the "
            "authors' classification code; `score=` the class token's attention to it, the LLaVA "
            "augmenter's, or OpenMixup's first-patch column); each image keeps its `int(lam·N)` top patches "
            "and takes the rest from its partner, lam ~ Beta(α, α), label weight = patches kept; their ToMe "
            "merging of that forward is not built (`pin(scores=...)`), their second plain-mixup forward is "
            "a `OneOf` pinned twice; equal to the authors' lines"
        ),
        app=("experiment=vit_digits",),  # (timm's ViT-Tiny on digits with AdamW: the app's ViT recipe)
        shown_on="vit",
        example={"layer": "input", "attention": "blocks.1.attn"},
        drawn={
            "attention": "encoder.layers.encoder_layer_1.self_attention",
            "hidden": {"tokens": "auto"},
        },
    )

    pin_keys = ("scores",)
    region_dims = (2,)

    def __init__(
        self,
        layer: str | Sequence[str],
        attention: str,
        alpha: float = 1.0,
        score: str = "to_class",
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
            raise ValueError(f"attention must be the name of a module, got {attention!r}")
        if score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {score!r}")
        self._check_patch_sites("it keeps a ViT's most attended patches")
        self.attention, self.score = attention, score

    def __repr__(self) -> str:
        return (
            f"MergeMix(layer={self._layer_spec!r}, attention={self.attention!r}, alpha={self.alpha}, "
            f"score={self.score!r})"
        )

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        _, attention = resolve_layer(model, self.attention, "attention")
        check_attention("MergeMix", self.attention, attention)
        super()._register(model, modules, handles)
        handles.append(attention.register_forward_hook(recompute.hook(self._recorder), with_kwargs=True))

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        check_spatial("MergeMix", spec, leaves)

    def before_forward(self, model, args, kwargs, spec: str, pinned: Mapping, targets, generator) -> Mapping:
        """The unmixed forward's scores of the patches (a recomputation and ``pin_last`` reuse them; pinned
        scores skip it)."""
        if "scores" in pinned:
            return {}
        _, weights = self._unmixed_attention(model, args, kwargs)  # (B, T, T), heads averaged
        _, _, prefix = attention_grid(self, model, weights.shape[1])
        if self.score in ("to_class", "from_class"):
            check_class_token(self, model, prefix, f"score={self.score!r} reads it; use score='patches'")
        if self.score == "to_class":
            scores = weights[:, prefix:, 0]
        elif self.score == "from_class":
            scores = weights[:, 0, prefix:]
        elif self.score == "patches":
            scores = weights[:, prefix:, prefix:].mean(1)
        else:  # (OpenMixup's topk mode: the first patch's column)
            scores = weights[:, prefix:, prefix]
        return {"scores": scores}

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        n, (height, width) = h.shape[0], h.shape[2:]
        rows, cols, ph, pw = self._patch_grid(draw.layer, height, width)
        count = rows * cols
        scores = torch.as_tensor(draw.pinned["scores"])
        if tuple(scores.shape) != (n, count):
            raise ValueError(
                f"MergeMix: the scores are {tuple(scores.shape)}, the mixed map has {n} samples of "
                f"{rows}x{cols} patches; score the patches the mix cuts ({(n, count)})"
            )
        kept = torch.floor(draw.lam * count).to(torch.int64)  # (the authors' int(lam * N); host, float64)
        order = to_device(scores, h.device).argsort(dim=1, descending=True, stable=True)
        ranks = torch.empty_like(order).scatter_(1, order, torch.arange(count, device=h.device).expand(n, -1))
        own = ranks < to_device(kept, h.device).view(-1, 1)  # (B, N): each image's top-k patches
        grid = own.view(n, 1, rows, cols).repeat_interleave(ph, 2).repeat_interleave(pw, 3)
        partners = to_device(draw.index, h.device)
        mixed = torch.where(grid, h, h[partners])
        lam = kept.to(torch.float64) / count
        info = {"scores": scores.detach().to(torch.float64), "kept": kept.expand(n)}
        return Mixed({path: mixed}, lam=lam, info=info, weights=grid[:, 0])

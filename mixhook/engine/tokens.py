"""Token maps: the region and mask mixers on ``(B, T, D)`` token sequences (a ViT's blocks), through a
declared patch grid.

A ViT block returns ``T = P + gh * gw`` tokens of width ``D``: ``P`` leading tokens that are not patches
(the class token, a distillation token, registers) and ``gh * gw`` patch tokens in row-major order. Given
the grid, a mixer that cuts regions (CutMix, FMix, PatchUp, ResizeMix, SmoothMix, GridMix, TokenMix) sees
the patch tokens as a ``(B, D, gh, gw)`` map, a view of the same values, cuts it exactly as it cuts a
convolutional feature map, and the mixed map is put back in the tokens' order. Its lam (``loss``,
``targets``) is the mixed fraction of **patch** tokens, as the method defines it on a map.

The leading tokens follow ``prefix``:

- ``"blend"`` (default): ``lam * t + (1 - lam) * t[index]`` with the lam the targets get (per sample
  where the method draws one per sample). Past the first block the class token summarises the whole
  image, so it is mixed in the proportion the label is.
- ``"keep"``: each sample keeps its own.

Nothing is guessed: the grid is declared (``tokens=(gh, gw)``) or read from the model
(``tokens="auto"``: timm's ``VisionTransformer`` and ``Eva``, torchvision's ``VisionTransformer``,
HuggingFace's ViT-style models), and where the model states its grid and its number of leading tokens,
a declared grid or a sequence that disagrees with them is refused in one line (a wrong grid would cut
regions that are not regions of the image). A sequence of exactly the grid's tokens has no leading tokens
(the patch embedding's output, before the class token is added). Trailing non-patch tokens are not
supported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..functional import blend, lerp_rows
from ..sites import INPUT, Leaf, parse_site

PREFIX_RULES = ("blend", "keep")


@dataclass(frozen=True)
class ModelGrid:
    """What a ViT states about its tokens: the patch grid and, where known, the leading tokens."""

    rows: int
    cols: int
    prefix: int | None
    source: str


# Models whose every block carries the same tokens: timm's plain ViT family (DeiT, registers, ... are
# subclasses or configurations of these) and HuggingFace's ViT-style models. Hierarchical ones (Swin, PiT,
# PVT) change the grid from stage to stage and state no one grid that a block's tokens must have.
_TIMM_VITS = ("VisionTransformer", "Eva")
_HF_VITS = ("vit", "deit", "beit", "data2vec-vision", "dinov2", "vit_msn", "vit_mae")


def model_grid(model: nn.Module | None, within: str | None = None) -> ModelGrid | None:
    """The patch grid ``model`` states, where it is a plain ViT that states one at a fixed image size:
    timm's ``VisionTransformer`` and ``Eva`` (``patch_embed.grid_size``, ``num_prefix_tokens``),
    torchvision's ``VisionTransformer`` (``image_size // patch_size``, one class token), a HuggingFace
    ViT-style model (``config.image_size // config.patch_size``, one class token; DeiT's a distillation
    token too); else ``None``. With ``within`` (a module's name in ``model``, such as an attention layer),
    a model that states nothing is looked into: the innermost module around ``within`` that states one
    (the ViT a LightningModule, a DDP or a wrapper for the HuggingFace Trainer holds)."""
    found = _stating(model, within)
    return None if found is None else found[0]


def grid_holder(model: nn.Module | None, within: str | None = None) -> nn.Module | None:
    """The module whose patch grid :func:`model_grid` reads (``model``, or the innermost module around
    ``within`` that states one), where a method reads more of what it states (its head's pooling); else
    ``None``."""
    found = _stating(model, within)
    return None if found is None else found[1]


def _stating(model: nn.Module | None, within: str | None) -> tuple[ModelGrid, nn.Module] | None:
    """:func:`model_grid`'s grid and the module that states it."""
    if model is None:
        return None
    found = _stated_grid(model)
    if found is not None or not within:
        return None if found is None else (found, model)
    parts = within.split(".")
    for end in range(len(parts) - 1, 0, -1):
        try:
            inner = model.get_submodule(".".join(parts[:end]))
        except AttributeError:
            continue
        found = _stated_grid(inner)
        if found is not None:
            return found, inner
    return None


def _stated_grid(model: nn.Module) -> ModelGrid | None:
    classes = {c.__name__ for c in type(model).__mro__}
    embed = getattr(model, "patch_embed", None)
    grid = getattr(embed, "grid_size", None)
    if classes & set(_TIMM_VITS) and grid is not None and hasattr(model, "num_prefix_tokens"):
        if getattr(model, "dynamic_img_size", False) or not getattr(embed, "flatten", True):
            return None  # tokens at whatever size the input has: nothing fixed to check against
        prefix = int(model.num_prefix_tokens)
        return ModelGrid(int(grid[0]), int(grid[1]), prefix, "timm patch_embed.grid_size")
    size, patch = getattr(model, "image_size", None), getattr(model, "patch_size", None)
    if "VisionTransformer" in classes and isinstance(size, int) and isinstance(patch, int):
        side = size // patch
        return ModelGrid(side, side, 1, "torchvision image_size // patch_size")
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in _HF_VITS:
        size, patch = config.image_size, config.patch_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        patch = (patch, patch) if isinstance(patch, int) else tuple(patch)
        prefix = 2 if config.model_type == "deit" else 1  # (the class token; DeiT's distillation token too)
        return ModelGrid(size[0] // patch[0], size[1] // patch[1], prefix, "config image_size // patch_size")
    return None


def token_grid(tokens, prefix: str, kind: str) -> TokenGrid | None:
    """The :class:`TokenGrid` a mixer's ``tokens``/``prefix`` arguments ask for (``None``: maps only), or a
    one-line ``ValueError``."""
    if prefix not in PREFIX_RULES:
        raise ValueError(f"prefix must be one of {', '.join(PREFIX_RULES)}, got {prefix!r}")
    if tokens is None:
        return None
    if tokens == "auto":
        return TokenGrid(None, prefix, kind)
    try:
        rows, cols = tokens
    except (TypeError, ValueError):
        rows = cols = None
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (rows, cols)):
        raise ValueError(
            f"tokens must be the patch grid (rows, columns) as two ints >= 1, 'auto' (read from the model) "
            f"or None, got {tokens!r}"
        )
    return TokenGrid((rows, cols), prefix, kind)


@dataclass(frozen=True)
class TokenGrid:
    """Turns ``(B, T, D)`` token leaves into ``(B, D, gh, gw)`` maps of their patch tokens and back."""

    grid: tuple[int, int] | None  # None: read from the model ("auto")
    prefix: str
    kind: str

    def __str__(self) -> str:
        return "'auto'" if self.grid is None else str(self.grid)

    def resolve(self, spec: str, model: nn.Module | None) -> tuple[tuple[int, int], ModelGrid | None]:
        """The grid to use at ``spec``, checked against what ``model`` (or the ViT around ``spec`` in it)
        states about its own."""
        layer = parse_site(spec).layer
        stated = model_grid(model, within=None if layer == INPUT else layer)
        if self.grid is None:
            if stated is None:
                name = type(model).__name__ if model is not None else "the model"
                raise TypeError(
                    f"{self.kind} at {spec!r}: tokens='auto' but {name} does not state a fixed patch grid "
                    "(timm, torchvision and HuggingFace ViTs do); declare it, e.g. tokens=(14, 14)"
                )
            return (stated.rows, stated.cols), stated
        if stated is not None and self.grid != (stated.rows, stated.cols):
            raise ValueError(
                f"{self.kind} at {spec!r}: tokens={self.grid} but the model's patch grid is "
                f"{stated.rows}x{stated.cols} ({stated.source}); declare tokens=({stated.rows}, "
                f"{stated.cols}) or tokens='auto'"
            )
        return self.grid, stated

    def to_maps(self, spec: str, leaves: list[Leaf], model: nn.Module | None) -> list[Leaf]:
        """Each ``(B, T, D)`` leaf (batch at any dim) as a leaf holding the ``(B, D, gh, gw)`` view of its
        patch tokens, batch first; a leaf of another shape, or a sequence that does not fit the grid, is
        refused in one line."""
        (rows, cols), stated = self.resolve(spec, model)
        maps = []
        for leaf in leaves:
            t, element = leaf.tensor, f" element {leaf.name}" if leaf.path else ""
            if t.ndim != 3:
                raise TypeError(
                    f"{self.kind} at {spec!r} with tokens={self} needs (B, T, D) tokens, but{element} has "
                    f"shape {tuple(t.shape)}; a (B, C, H, W) map needs no tokens argument"
                )
            tokens = t.movedim(leaf.dim, 0)
            count, prefix = tokens.shape[1], tokens.shape[1] - rows * cols
            if prefix < 0:
                raise ValueError(
                    f"{self.kind} at {spec!r}:{element} has {count} tokens, fewer than the {rows}x{cols} = "
                    f"{rows * cols} patch tokens of the grid tokens={self}"
                )
            if stated is not None and stated.prefix is not None and prefix not in (stated.prefix, 0):
                raise ValueError(
                    f"{self.kind} at {spec!r}:{element} has {count} tokens, which with the {rows}x{cols} "
                    f"patch grid leaves {prefix} leading tokens, but the model has {stated.prefix} (class "
                    "token, registers): this layer's tokens are not the model's patch sequence"
                )
            patches = tokens[:, prefix:].transpose(1, 2).unflatten(2, (rows, cols))
            maps.append(Leaf(leaf.path, patches, 0))
        return maps

    def from_map(
        self,
        leaf: Leaf,
        mixed: torch.Tensor,
        lam: torch.Tensor,
        index: torch.Tensor,
        permutation: bool,
    ) -> torch.Tensor:
        """``leaf``'s tokens with the patch tokens taken from the mixed ``(B, D, gh, gw)`` map and the
        leading tokens mixed by the ``prefix`` rule with ``lam`` (the targets' weight)."""
        return self._join(leaf, mixed, lambda prefix: blend(prefix, lam, index, permutation=permutation))

    def from_map_traced(
        self, leaf: Leaf, mixed: torch.Tensor, weight: torch.Tensor | None, index: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`from_map` in a compiled graph: the leading tokens blended with ``weight``, the targets'
        lam per sample as :func:`traced_weight` rounds it (``None`` with ``prefix="keep"``)."""
        return self._join(leaf, mixed, lambda prefix: lerp_rows(prefix, weight, index, one=False))

    def _join(self, leaf: Leaf, mixed: torch.Tensor, blend_prefix) -> torch.Tensor:
        tokens = leaf.tensor.movedim(leaf.dim, 0)
        patches = mixed.flatten(2).transpose(1, 2)
        prefix = tokens[:, : tokens.shape[1] - patches.shape[1]]
        if prefix.shape[1] and self.prefix == "blend":
            prefix = blend_prefix(prefix)
        return torch.cat([prefix, patches], dim=1).movedim(0, leaf.dim)


def traced_weight(lam: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The targets' ``lam`` (one, or one per sample) as ``n`` float64 weights with which
    :func:`~mixhook.functional.lerp_rows` blends tokens of ``dtype`` bit for bit as
    :func:`~mixhook.functional.blend` blends them with ``lam`` (a tensor, which it rounds to the tokens'
    dtype)."""
    return lam.to(dtype).to(torch.float64).expand(n)

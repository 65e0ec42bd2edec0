"""The one-line checks the mixers share: numbers in range, the map a region method cuts, pinned masks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..sites import Leaf


def check_one_map(kind: str, spec: str, leaves: list[Leaf], does: str = "cuts one map") -> None:
    """A one-line ``TypeError`` naming the elements to choose from, unless the layer returns one tensor
    that carries the batch (the map a region method cuts, or AlignMix aligns)."""
    if len(leaves) != 1:
        names = ", ".join(f"{leaf.name} {tuple(leaf.tensor.shape)}" for leaf in leaves)
        raise TypeError(
            f"{kind} at {spec!r}: the layer returns {len(leaves)} tensors that carry the batch ({names}); "
            f"{kind} {does}: select it, e.g. '{spec.split('[')[0]}{leaves[0].name}'"
        )


def check_spatial(kind: str, spec: str, leaves: list[Leaf]) -> torch.Tensor:
    """The one ``(B, C, H, W)`` map (batch at dim 0) that the mixers cutting regions act on, or a one-line
    ``TypeError`` naming the elements to choose from."""
    if len(leaves) != 1:
        check_one_map(kind, spec, leaves)
    h = leaves[0].tensor
    if h.ndim != 4 or leaves[0].dim != 0:
        element = f" element {leaves[0].name}" if leaves[0].path else ""
        hint = "; for (B, T, D) tokens declare their patch grid: tokens=(rows, columns) or 'auto'"
        raise TypeError(
            f"{kind} at {spec!r} needs a (B, C, H, W) map with the batch first, but{element} has shape "
            f"{tuple(h.shape)} with the batch at dim {leaves[0].dim}{hint if h.ndim == 3 else ''}"
        )
    return h


MAP_SHAPES = {1: "(B, C, L)", 2: "(B, C, H, W)", 3: "(B, C, D, H, W)"}


def map_size(h: torch.Tensor) -> str:
    """The positions of a ``(B, C, ...)`` map as ``"HxW"`` (``"L"``, ``"DxHxW"``)."""
    return "x".join(str(s) for s in h.shape[2:])


def check_region(kind: str, spec: str, leaves: list[Leaf], dims: tuple[int, ...] = (2,)) -> torch.Tensor:
    """The one map (batch at dim 0) with ``dims`` position dimensions (after the channels: 1 for
    ``(B, C, L)``, 2 for ``(B, C, H, W)``, 3 for ``(B, C, D, H, W)``) that a region method cuts, or a
    one-line ``TypeError`` naming what it needs."""
    if dims == (2,):
        return check_spatial(kind, spec, leaves)
    if len(leaves) != 1:
        check_one_map(kind, spec, leaves)
    h = leaves[0].tensor
    if h.ndim - 2 not in dims or leaves[0].dim != 0:
        element = f" element {leaves[0].name}" if leaves[0].path else ""
        shapes = [MAP_SHAPES[d] for d in dims]
        needs = f"{', '.join(shapes[:-1])} or {shapes[-1]}" if len(shapes) > 1 else shapes[0]
        raise TypeError(
            f"{kind} at {spec!r} needs a {needs} map with the batch first, but{element} has shape "
            f"{tuple(h.shape)} with the batch at dim {leaves[0].dim}"
        )
    return h


def check_splittable(kind: str, spec: str, leaves: list[Leaf], dims: tuple[int, ...] = (2,)) -> torch.Tensor:
    """:func:`check_region`, and a one-line ``ValueError`` for a single-position map, which no mask can
    split (the mask methods: FMix, SmoothMix)."""
    h = check_region(kind, spec, leaves, dims)
    if h.shape[2:].numel() < 2:
        what = "pixel" if h.ndim == 4 else "position"
        raise ValueError(
            f"{kind} at {spec!r}: its {map_size(h)} map has a single {what}, which a mask cannot split; "
            "choose an earlier layer"
        )
    return h


def check_pinned_mask(mask, *shape: int) -> torch.Tensor:
    """A pinned mask of weights in [0, 1] over a map's positions ``shape`` (``height, width``; one size or
    three for a 1-D or 3-D map), as a float64 CPU tensor, or a one-line ``ValueError``."""
    mask = torch.as_tensor(mask, dtype=torch.float64).cpu()
    if tuple(mask.shape) != tuple(shape):
        size = "x".join(str(s) for s in shape)
        raise ValueError(f"pinned mask of shape {tuple(mask.shape)} does not fit the {size} map")
    if not bool(((mask >= 0) & (mask <= 1)).all()):
        raise ValueError("pinned mask must hold weights in [0, 1]")
    return mask


def _number(name: str, value) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None


def check_positive(name: str, value) -> float:
    """``value`` as a finite float > 0, or a ``ValueError`` naming ``name``."""
    number = _number(name, value)
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number


def check_non_negative(name: str, value) -> float:
    """``value`` as a finite float >= 0, or a ``ValueError`` naming ``name``."""
    number = _number(name, value)
    if not (number >= 0 and math.isfinite(number)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


def check_layer_weights(layers: Sequence[str], weights) -> tuple[float, ...]:
    """``weights`` as floats, once they give each of ``layers`` a weight >= 0, not all 0 (else one line)."""
    try:
        values = [float(w) for w in weights]
    except (TypeError, ValueError):
        values = None
    if (
        values is None
        or len(values) != len(layers)
        or any(not math.isfinite(v) or v < 0 for v in values)
        or not sum(values) > 0
    ):
        shown = list(weights) if isinstance(weights, Sequence) and not isinstance(weights, str) else weights
        raise ValueError(f"layer_weights={shown!r}: one weight >= 0 per layer of {list(layers)}, not all 0")
    return tuple(values)


def check_fraction(name: str, value) -> float:
    """``value`` as a float in [0, 1], or a ``ValueError`` naming ``name``."""
    number = _number(name, value)
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return number


def check_per_sample(kind: str, loss: torch.Tensor, rows: torch.Tensor) -> None:
    """Refuse a criterion's ``loss`` that is neither a number nor one loss per sample (``rows``' shape)."""
    if loss.ndim and loss.shape != rows.shape:
        raise ValueError(
            f"{kind}.loss(): the criterion returned shape {tuple(loss.shape)}: return one loss per sample "
            "(reduction='none') or a number"
        )


def check_class_logits(kind: str, logits: torch.Tensor, target: torch.Tensor) -> None:
    """Refuse, in one line, what a loss on class confidences cannot take: logits other than ``(B, K)``,
    targets other than ``(B,)`` class indices (RankMixup, MixupE)."""
    if logits.ndim != 2:
        raise ValueError(f"{kind}.loss() needs (B, K) class logits, got shape {tuple(logits.shape)}")
    if target.dtype.is_floating_point or target.dtype == torch.bool or target.shape != logits.shape[:1]:
        raise ValueError(
            f"{kind}.loss() compares class confidences, so target must be ({logits.shape[0]},) class "
            f"indices, got {target.dtype} {tuple(target.shape)}"
        )


def check_class_labels(kind: str, target: torch.Tensor) -> None:
    """Refuse, in one line, labels that are not ``(B,)`` class indices, for a method whose loss compares
    class confidences (RankMixup, MixupE): on regression targets it has nothing to compare."""
    if target.dtype.is_floating_point or target.dtype == torch.bool or target.ndim != 1:
        raise ValueError(
            f"{kind} compares class confidences, so its labels must be (B,) class indices, got "
            f"{target.dtype} {tuple(target.shape)}"
        )


def check_grid(grid) -> tuple[int, int]:
    """A 2-D grid given as an int or ``(rows, columns)``: the pair, or a one-line ``ValueError``."""
    values = (grid, grid) if isinstance(grid, int) and not isinstance(grid, bool) else grid
    try:
        gh, gw = values
    except (TypeError, ValueError):
        raise ValueError(f"grid must be an int or two ints (rows, columns), got {grid!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (gh, gw)) or gh * gw < 2:
        raise ValueError(f"grid must be ints >= 1 with at least 2 cells in all, got {grid!r}")
    return gh, gw


def check_normalisation(mean, std) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    """An input's per-channel normalisation, as the methods that read its pixel values take it (PuzzleMix's
    smoothness, AugMix's operations): ``mean`` and ``std`` together or neither, each std finite and > 0; as
    float tuples, or a one-line ``ValueError``."""
    if (mean is None) != (std is None):
        raise ValueError("mean and std are given together (the input's normalisation), or neither")
    if mean is None:
        return None, None
    return tuple(float(m) for m in mean), tuple(check_positive("std", s) for s in std)


def per_channel(kind: str, h: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> tuple:
    """``mean`` and ``std`` as ``(1, C, 1, 1)`` tensors on ``h``'s device and dtype (``x * std + mean`` are
    ``h``'s pixels), or a one-line ``ValueError`` where they have neither one value nor one per channel."""
    if len(mean) not in (1, h.shape[1]):
        raise ValueError(f"{kind}: mean/std have {len(mean)} values for an input of {h.shape[1]} channels")
    return tuple(torch.tensor(v, dtype=h.dtype, device=h.device).view(1, -1, 1, 1) for v in (mean, std))

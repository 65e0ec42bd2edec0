"""Case 12, vit: the methods that read a ViT's attention (their cards' trait ``"attention"``: TransMix,
MixPro, TL-Align, SMMix, MergeMix today), each at its card's layers, in a training step (forward, ``loss``,
backward, SGD) of timm's ViT-Tiny, against no mixing and against CutMix, side by side in one process. Their
attention reads recompute the query and key projections without gradients: one block's for TransMix and
MixPro (the paper's: the last), every block's for TL-Align (its labels go through all of them), so TL-Align's
cost grows with the depth; SMMix runs the model once more, without gradients, on the unmixed batch (its
motivating forward), and its token head; MergeMix runs that forward too, for its scores."""

from __future__ import annotations

import statistics

import torch

from benchmarks.cases.methods import training_steps
from benchmarks.timing import ratio
from mixhook.engine.card import LAYER_ARGUMENTS, METHODS, methods_with


def _layers_of(example: dict, depth: int) -> dict:
    """The layers a card's example names on the matrix's two-block ViT (``blocks.1`` its last block), on
    this ViT of ``depth`` blocks; its other arguments left at their defaults (a size in the matrix's patches:
    MixPro's ``cell``)."""
    return {
        key: value.replace("blocks.1.", f"blocks.{depth - 1}.") if isinstance(value, str) else value
        for key, value in example.items()
        if key in LAYER_ARGUMENTS
    }


def makers(depth: int) -> dict:
    """What the case measures on a ViT of ``depth`` blocks: no mixing, CutMix, and every method whose card
    states the trait ``"attention"``, at its card's layers."""
    from mixhook import CutMix

    out = {"none": None, "CutMix": lambda: CutMix("input")}
    for name in methods_with("attention"):
        out[name] = lambda cls=METHODS[name]: cls(**_layers_of(cls.card.example, depth))
    return out


def vit_methods(device, timer, reps: int, inner: int, batch: int, size: int, depth: int) -> dict:
    import timm

    torch.manual_seed(0)
    base = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=size, patch_size=4, depth=depth
    ).to(device).train()  # fmt: skip
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    steps = training_steps(base, makers(depth), x, y)
    times = timer.side_by_side(steps, reps=reps, inner=inner, warmup=2)
    return {
        "model": f"timm vit_tiny_patch16_224, {depth} blocks, 4-pixel patches",
        "batch": batch,
        "image_size": size,
        "depth": depth,
        "seconds_per_step": {k: statistics.median(v) for k, v in times.items()},
        "vs_none": {k: ratio(times, k, "none") for k in times if k != "none"},
        "vs_cutmix": {k: ratio(times, k, "CutMix") for k in times if k not in ("none", "CutMix")},
    }

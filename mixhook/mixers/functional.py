"""The mixing math, as small pure functions: sampling lam, the blend, soft targets.

Every mixer is built from these; they are public for code that mixes by hand (a custom loop, a test).
Draws take an explicit ``torch.Generator`` and are made in float64 on the generator's device, so that a
seed gives the same draw on every device; they are cast to the activation's dtype where they are used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from ..transfer import to_device


def sample_beta(a: float, b: float, generator: torch.Generator, size: int | None = None) -> torch.Tensor:
    """Draw from ``Beta(a, b)`` with ``generator``: a 0-d float64 tensor, or ``size`` of them.

    ``torch.distributions.Beta`` cannot take a generator, so this draws the same Dirichlet(a, b) sample
    it would (Beta is its first coordinate) through the generator-aware kernel. Values are float64 and
    are cast to the activation's (or the loss's) dtype where they are used.
    """
    concentration = torch.tensor([a, b], dtype=torch.float64, device=generator.device)
    if size is not None:
        concentration = concentration.expand(size, 2).contiguous()
    return torch._sample_dirichlet(concentration, generator=generator)[..., 0]


def sample_lam(alpha: float, generator: torch.Generator) -> torch.Tensor:
    """``lam ~ Beta(alpha, alpha)`` as a 0-d float64 tensor (see :func:`sample_beta`)."""
    return sample_beta(alpha, alpha, generator)


def per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` in ``like``'s dtype and device; one value per sample (1-D) is shaped to broadcast over
    ``like``'s non-batch dimensions, a 0-d tensor is left as it is."""
    values = to_device(values, like.device, like.dtype)
    return values.view(-1, *([1] * (like.ndim - 1))) if values.ndim == 1 else values


class _PermutedBlend(torch.autograd.Function):
    """``lerp(h[index], h, lam)`` whose backward gathers through the inverse permutation.

    Indexing's own backward scatter-adds into a zeroed tensor; when ``index`` is a permutation the
    gradient of ``h[index]`` is just ``g[inverse]``, so the backward is one gather and one fused
    multiply-add: ``lam * g + ((1 - lam) * g)[inverse]``."""

    @staticmethod
    def forward(ctx, h, lam, index, inverse):
        ctx.save_for_backward(lam, inverse)
        return torch.lerp(h[index], h, lam)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        lam, inverse = ctx.saved_tensors
        return torch.addcmul(((1 - lam) * grad)[inverse], lam, grad), None, None, None


def inverse_permutation(index: torch.Tensor) -> torch.Tensor | None:
    """The inverse of ``index`` if it is a permutation of ``0..n-1``, else ``None``."""
    if not torch.equal(torch.sort(index).values, torch.arange(index.shape[0], device=index.device)):
        return None
    return _scatter_inverse(index)


def _scatter_inverse(index: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation ``index``, by one scatter (no check that it is one)."""
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.shape[0], device=index.device)
    return inverse


def blend(
    h: torch.Tensor, lam: torch.Tensor | float, index: torch.Tensor, inverse: torch.Tensor | None = None
) -> torch.Tensor:
    """``lam * h + (1 - lam) * h[index]``, in ``h``'s dtype on ``h``'s device.

    ``lam`` is a number, a 0-d tensor, or one value per sample (a 1-D tensor of the batch's length).
    Computed as one gather and one ``torch.lerp`` (equal to the formula up to rounding). Differentiable
    in ``h`` through both terms, exactly like the hand-edited forward of the papers; given ``inverse``
    (``index``'s inverse permutation), the backward gathers through it instead of scatter-adding.
    """
    lam = per_sample(torch.as_tensor(lam, dtype=torch.float64), h)
    index = to_device(index, h.device)
    if inverse is not None and h.requires_grad and torch.is_grad_enabled():
        return _PermutedBlend.apply(h, lam, index, to_device(inverse, h.device))
    return torch.lerp(h[index], h, lam)


def mask_blend(h: torch.Tensor, mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``mask * h + (1 - mask) * h[index]`` for ``h`` (B, C, H, W) and one ``(H, W)`` mask of weights (1:
    the sample's own), in ``h``'s dtype on ``h``'s device; gradients flow to both terms."""
    m = to_device(mask, h.device, h.dtype)
    return m * h + (1 - m) * h[to_device(index, h.device)]


def smooth_one_hot(
    target: torch.Tensor, num_classes: int, smoothing: float = 0.0, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """One-hot class probabilities with label smoothing (timm's convention), in ``dtype`` (torch's
    default dtype if ``None``).

    The true class gets ``1 - smoothing + smoothing / num_classes``, every other class
    ``smoothing / num_classes``; rows sum to 1.
    """
    off = smoothing / num_classes
    out = torch.full((target.shape[0], num_classes), off, device=target.device, dtype=dtype)
    return out.scatter_(1, target.unsqueeze(1), 1.0 - smoothing + off)


def mix_targets(
    target: torch.Tensor,
    num_classes: int,
    lam: torch.Tensor | float,
    index: torch.Tensor,
    smoothing: float = 0.0,
) -> torch.Tensor:
    """``lam * s(target) + (1 - lam) * s(target[index])`` with ``s`` = :func:`smooth_one_hot`."""
    soft = smooth_one_hot(target, num_classes, smoothing)
    return blend(soft, lam, index)


def along(dim: int, fn: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """``fn`` applied with the batch moved to dim 0 and moved back (a view; nothing copied for dim 0)."""
    if dim == 0:
        return fn(h)
    return fn(h.movedim(dim, 0)).movedim(0, dim)

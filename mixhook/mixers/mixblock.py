"""The Mix Block of AutoMix and SAMix: a network that turns two samples' features and lam into a mixing mask.

Papers: Liu, Li, Wang, Tian, Wu, Huang, Li. "AutoMix: Unveiling the Power of Mixup for Stronger
Classifiers." ECCV 2022. https://arxiv.org/abs/2103.13027 -- Li, Liu, Wang, Tan, Liu, Wu, Li.
"Boosting Discriminative Visual Representation Learning with Scenario-Agnostic Mixup." 2021.
https://arxiv.org/abs/2111.15454. The code: Westlake-AI/openmixup, ``openmixup/models/heads/pmix_block.py``
(``PixelMixBlock``) and ``openmixup/models/necks/conv_necks.py`` (``ConvNeck``, SAMix's value network).

This module holds the network and its mask loss; :mod:`mixhook.mixers.automix` is the method that trains it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

UPSAMPLING = ("nearest", "bilinear", "bicubic")
MASK_LOSSES = ("L1", "L1+Variance", "L2+Variance", "Sparsity")


class MixBlock(nn.Module):
    """OpenMixup's ``PixelMixBlock``: the mask of the partner's share at each position, from a cross
    attention between a sample's features and its partner's.

    For features ``x`` ``(B, C, h, w)`` of the batch, partners ``index`` and one ``lam``:
    ``x_lam = x``, ``x_lam_ = x[index]`` (SAMix: scaled by lam, ``lam_mul``); the value ``v`` is a 1x1
    convolution of ``x_lam_`` to one channel (SAMix: a two-layer network, ``value_hidden``); the query and
    key are 1x1 convolutions to ``C / reduction`` channels of ``x_lam`` and ``x_lam_`` (one shared
    convolution; SAMix: two, both of ``cat(x_lam, x_lam_)``); the attention ``softmax(q k / sqrt(C/r))``
    ``(B, hw, hw)`` weighs ``v`` into the partner's logit at each position, which is upsampled to the mixed
    map's size and squashed: ``sigmoid``. The sample keeps ``1 - mask`` of each position.

    Initialised as OpenMixup initialises it: every convolution ``N(0, 0.01)`` with zero bias, batch norm
    ``(1, 0)``. Computed in the features' dtype promoted to at least float32 (OpenMixup: float32 always).

    Args:
        channels: the features' channels ``C``.
        reduction: the query and key have ``C // reduction`` channels (at least 1). OpenMixup: 2.
        use_scale: divide the attention logits by ``sqrt(C // reduction)``.
        lam_concat: lam as one more channel of the query, key and value inputs (``1 - lam`` for the
            partner's).
        lam_concat_v: lam as one more channel of the value input only.
        lam_mul: SAMix's lam encoding: ``x_lam * lam'`` and ``x_lam_ * (1 - lam')`` (with
            ``lam_residual``: ``x_lam * (1 + lam' * lam_mul)`` and ``x_lam_ * (1 + (1 - lam') * lam_mul)``),
            ``lam'`` lam rescaled by ``lam_mul_k`` (:func:`rescale_lam`); 0: off.
        lam_mul_k: the rescaling's ``k`` (one drawn per call where several), < 0: lam as it is.
        lam_residual: see ``lam_mul``.
        value_hidden: SAMix's value network: 1x1 convolution to ``value_hidden`` channels (no bias), batch
            norm, ELU, 1x1 convolution to 1 (no bias); ``None``: one 1x1 convolution (with bias).
        x_qk_concat: SAMix's query and key: two convolutions of ``cat(x_lam, x_lam_)``.
        x_v_concat: the value of ``cat(x_lam, x_lam_)``.
        upsampling: how the ``(h, w)`` mask is resized to the mixed map: a mode or a list of modes (one
            drawn per call where several) among nearest, bilinear, bicubic.
    """

    def __init__(
        self,
        channels: int,
        reduction: int = 2,
        use_scale: bool = True,
        lam_concat: bool = False,
        lam_concat_v: bool = False,
        lam_mul: float = 0.0,
        lam_mul_k: float | Sequence[float] = -1,
        lam_residual: bool = False,
        value_hidden: int | None = None,
        x_qk_concat: bool = False,
        x_v_concat: bool = False,
        upsampling: str | Sequence[str] = "nearest",
    ):
        super().__init__()
        self.upsampling = checked_shape("MixBlock", channels, reduction, upsampling)
        if not 0 <= float(lam_mul) <= 1:
            raise ValueError(f"MixBlock: lam_mul must be in [0, 1], got {lam_mul!r}")
        ks = (lam_mul_k,) if isinstance(lam_mul_k, (int, float)) else tuple(lam_mul_k)
        if not ks:
            raise ValueError("MixBlock: lam_mul_k needs at least one value")
        if lam_concat and lam_concat_v:
            raise ValueError(
                "MixBlock: lam_concat (query, key and value) and lam_concat_v (value only) exclude each other"
            )
        if lam_concat and (lam_mul or x_qk_concat):
            raise ValueError(
                "MixBlock: lam_concat excludes lam_mul and x_qk_concat (both change q, k, v by lam)"
            )
        self.channels, self.reduction, self.use_scale = channels, reduction, bool(use_scale)
        self.inter = max(channels // reduction, 1)
        self.lam_concat, self.lam_concat_v = bool(lam_concat), bool(lam_concat_v)
        self.lam_mul = float(lam_mul)
        self.lam_mul_k = tuple(min(float(k), 10.0) if k >= 0 else -1.0 for k in ks)
        self.lam_residual, self.x_qk_concat, self.x_v_concat = (
            bool(lam_residual),
            bool(x_qk_concat),
            bool(x_v_concat),
        )
        qk_in = channels + 1 if self.lam_concat else channels
        v_in = channels + 1 if self.lam_concat or self.lam_concat_v else channels
        if self.x_qk_concat:
            qk_in = 2 * channels
        if self.x_v_concat:
            v_in = 2 * channels
        if value_hidden is None:
            self.value = nn.Conv2d(v_in, 1, 1)
        else:
            self.value = nn.Sequential(
                nn.Conv2d(v_in, int(value_hidden), 1, bias=False),
                nn.BatchNorm2d(int(value_hidden)),
                nn.ELU(),
                nn.Conv2d(int(value_hidden), 1, 1, bias=False),
            )
        self.key = nn.Conv2d(qk_in, self.inter, 1) if self.x_qk_concat else None
        self.query = nn.Conv2d(qk_in, self.inter, 1)
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """OpenMixup's initialisation (``init_weights(init_linear='normal')``), its normal draws from
        ``generator`` (on its device; ``None``: torch's global CPU generator)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                with torch.no_grad():
                    device = None if generator is None else generator.device
                    m.weight.copy_(torch.randn(m.weight.shape, generator=generator, device=device) * 0.01)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, reduction={self.reduction}, upsampling={self.upsampling}"

    def forward(
        self,
        x: torch.Tensor,
        lam: float,
        index: torch.Tensor,
        size: tuple[int, int],
        upsampling: str | None = None,
        lam_k: float | None = None,
    ) -> torch.Tensor:
        """The partner's share ``(B, 1, *size)`` in ``(0, 1)`` for features ``x`` ``(B, C, h, w)``, one
        ``lam`` and the partners ``index``; ``upsampling`` and ``lam_k`` are the call's choices (the first
        of each list when not given)."""
        n, _, h, w = x.shape
        work = torch.promote_types(x.dtype, torch.float32)
        x_lam, x_lam_ = x, x[index]
        if self.lam_mul > 0:
            k = self.lam_mul_k[0] if lam_k is None else lam_k
            scaled = rescale_lam(lam, k) if k >= 0 else lam
            if self.lam_residual:
                x_lam = x_lam * (1 + scaled * self.lam_mul)
                x_lam_ = x_lam_ * (1 + (1 - scaled) * self.lam_mul)
            else:
                x_lam, x_lam_ = x_lam * scaled, x_lam_ * (1 - scaled)
        if self.lam_concat:
            block = torch.full((n, 1, h, w), float(lam), dtype=x.dtype, device=x.device)
            x_lam, x_lam_ = torch.cat([x_lam, block], 1), torch.cat([x_lam_, 1 - block], 1)
        v = x_lam_
        if self.x_v_concat:
            v = torch.cat([x_lam, x_lam_], 1)
        if self.lam_concat_v:
            block = torch.full((n, 1, h, w), float(lam), dtype=x.dtype, device=x.device)
            v = torch.cat([x_lam_, 1 - block], 1)
        v = self.value(v).view(n, 1, -1).permute(0, 2, 1)  # (B, hw, 1)
        if self.x_qk_concat:
            x_lam = x_lam_ = torch.cat([x_lam, x_lam_], 1)
        q = self.query(x_lam).view(n, self.inter, -1).permute(0, 2, 1)  # (B, hw, C/r)
        k = (self.key if self.key is not None else self.query)(x_lam_).view(n, self.inter, -1)  # (B, C/r, hw)
        weight = torch.matmul(q.to(work), k.to(work))
        if self.use_scale:
            weight = weight / q.shape[-1] ** 0.5
        weight = weight.softmax(dim=-1)  # (B, hw, hw)
        logit = torch.matmul(weight, v.to(work)).view(n, 1, h, w)
        logit = F.interpolate(logit, size=tuple(size), mode=upsampling or self.upsampling[0])
        return torch.sigmoid(logit)


def checked_shape(kind: str, channels, reduction, upsampling) -> tuple[str, ...]:
    """A Mix Block network's ``channels`` and ``reduction`` (integers >= 1) and its upsampling modes, as a
    tuple (one mode or a list, each among :data:`UPSAMPLING`); refused in one line naming ``kind``."""
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        raise ValueError(f"{kind}: channels must be an integer >= 1, got {channels!r}")
    if isinstance(reduction, bool) or not isinstance(reduction, int) or reduction < 1:
        raise ValueError(f"{kind}: reduction must be an integer >= 1, got {reduction!r}")
    modes = (upsampling,) if isinstance(upsampling, str) else tuple(upsampling)
    if not modes or any(m not in UPSAMPLING for m in modes):
        raise ValueError(f"{kind}: upsampling must be among {', '.join(UPSAMPLING)}, got {upsampling!r}")
    return modes


def rescale_lam(lam: float, k: float) -> float:
    """SAMix's lam rescaling (``PixelMixBlock.rescale_lam_mult``): ``(4/3 lam^3 - 2 lam^2 + (k+1) lam) /
    (k + 1/3)``, which keeps 0, 1/2 and 1 and bends lam toward 1/2 less as ``k`` grows."""
    k = k + 1
    lam = float(lam)
    return 1 / (k - 2 / 3) * (4 / 3 * math.pow(lam, 3) - 2 * lam**2 + k * lam)


def mask_loss(mask: torch.Tensor, lam: float, mode: str = "L1", margin: float = 0.0) -> torch.Tensor:
    """OpenMixup's ``PixelMixBlock.mask_loss`` of the partner's share ``mask`` ``(B, 1, H, W)``: with ``m``
    its mean, ``L1``: ``max(|1 - m - lam| - margin, 0)`` (the sample's share close to lam);
    ``L1+Variance``: that minus twice the mask's variance (SAMix: sharper masks); ``L2+Variance``: the
    squared version; ``Sparsity``: ``max(mean |mask (mask - 1)| - margin, 0)``."""
    n, _, h, w = mask.shape
    mean = mask.sum() / (n * h * w)
    if mode == "L1":
        return torch.clamp((1 - mean - lam).abs() - margin, min=0.0)
    if mode == "Sparsity":
        return torch.clamp((mask * (mask - 1)).abs().sum() / (n * h * w) - margin, min=0.0)
    variance = torch.clamp(((mask - mean) ** 2).sum() / (n * h * w), min=0.0)
    if mode == "L1+Variance":
        return torch.clamp((1 - mean - lam).abs() - margin, min=0.0) - 2 * variance
    if mode == "L2+Variance":
        return torch.clamp((1 - mean - lam) ** 2 - margin**2, min=0.0) - 2 * variance
    raise ValueError(f"mask_loss: mode must be one of {', '.join(MASK_LOSSES)}, got {mode!r}")

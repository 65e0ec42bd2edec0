"""Image operations on batches of images on their device, each sample with its own parameter: AugMix's
operations (google-research/augmix ``augmentations.py``), written to give what PIL gives on 8-bit images.

Images are ``(N, C, H, W)`` floats in ``[0, 1]``; every operation returns its result rounded to 8 bits (a
multiple of ``1/255``), as a PIL image holds it. The intensity operations (``autocontrast``, ``equalize``,
``posterize``, ``solarize``) equal PIL's ``ImageOps`` on 8-bit images, the enhancements (``color``,
``contrast``, ``brightness``, ``sharpness``) its ``ImageEnhance``; the geometric ones (``affine``:
rotation, shear, translation) are PIL's affine ``transform`` with bilinear sampling and black fill, to
within its 8-bit rounding of the interpolation. torch only: no PIL, no torchvision, no host read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LEVELS = 255


def to_8_bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest multiple of ``1/255`` (the values an 8-bit image holds)."""
    return torch.round(x * LEVELS) / LEVELS


def _codes(x: torch.Tensor) -> torch.Tensor:
    """The 8-bit codes ``0..255`` of ``x`` as int64."""
    return torch.round(x * LEVELS).clamp(0, LEVELS).to(torch.int64)


def _by_lut(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """``x``'s codes looked up in ``lut`` (``(N, C, 256)`` codes, one table per sample and channel)."""
    codes = _codes(x).flatten(2)
    return (torch.gather(lut, 2, codes).view_as(x).to(x.dtype)) / LEVELS


def autocontrast(x: torch.Tensor) -> torch.Tensor:
    """``ImageOps.autocontrast`` (no cutoff) of each channel: its darkest code to 0, its lightest to 255,
    ``int(i * scale + offset)`` between (a flat channel kept)."""
    codes = _codes(x).flatten(2)
    lo, hi = codes.amin(2, keepdim=True), codes.amax(2, keepdim=True)
    spread = (hi - lo).clamp_min(1).to(torch.float64)
    scale = torch.full_like(spread, LEVELS).div(
        spread
    )  # (255 / spread, as Python divides: not via 1 / spread)
    i = torch.arange(LEVELS + 1, device=x.device, dtype=torch.float64)
    lut = (i * scale - lo * scale).clamp(0, LEVELS).to(torch.int64)  # (int(): truncation, PIL's)
    lut = torch.where(hi > lo, lut, torch.arange(LEVELS + 1, device=x.device))
    return _by_lut(x, lut)


def equalize(x: torch.Tensor) -> torch.Tensor:
    """``ImageOps.equalize`` of each channel: its histogram's cumulative counts as the table, ``step =
    (pixels - the lightest code's count) // 255``, the channel kept where ``step`` is 0."""
    n, c = x.shape[:2]
    codes = _codes(x).flatten(2)
    hist = torch.zeros(n, c, LEVELS + 1, dtype=torch.int64, device=x.device)
    hist.scatter_add_(2, codes, torch.ones_like(codes))
    last = torch.gather(hist, 2, codes.amax(2, keepdim=True))  # (the lightest code's count)
    step = (codes.shape[2] - last) // LEVELS
    before = torch.cumsum(hist, 2) - hist  # (the pixels below each code)
    lut = (step // 2 + before) // step.clamp_min(1)
    lut = torch.where(step > 0, lut.clamp(0, LEVELS), torch.arange(LEVELS + 1, device=x.device))
    return _by_lut(x, lut)


def posterize(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``ImageOps.posterize``: each code's top ``bits`` bits kept (``bits``: ``(N,)`` ints, 1 to 8)."""
    drop = (8 - bits.to(device=x.device, dtype=torch.int64)).view(-1, 1, 1, 1)
    codes = _codes(x)
    return ((codes >> drop) << drop).to(x.dtype) / LEVELS


def solarize(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``ImageOps.solarize``: each code at or above ``threshold`` (``(N,)``, in codes) inverted."""
    codes = _codes(x)
    above = codes >= threshold.to(device=x.device, dtype=torch.int64).view(-1, 1, 1, 1)
    return torch.where(above, LEVELS - codes, codes).to(x.dtype) / LEVELS


def affine(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """PIL's ``Image.transform(size, AFFINE, (a, b, c, d, e, f), BILINEAR)`` of each sample: the output
    pixel whose centre is at ``(x, y)`` samples the input at ``(a x + b y + c, d x + e y + f)`` (pixel
    units, centres at half-integers), bilinearly (the edge pixels extended to the image's border), black
    outside the image. ``matrix``: ``(N, 2, 3)``."""
    n, _, height, width = x.shape
    matrix = matrix.to(device=x.device, dtype=torch.float64)
    ys = torch.arange(height, device=x.device, dtype=torch.float64) + 0.5
    xs = torch.arange(width, device=x.device, dtype=torch.float64) + 0.5
    py, px = torch.meshgrid(ys, xs, indexing="ij")
    points = torch.stack([px, py, torch.ones_like(px)], -1)  # (H, W, 3)
    source = torch.einsum("nij,hwj->nhwi", matrix, points)  # (N, H, W, 2): x, y in pixels
    grid = torch.stack([2 * source[..., 0] / width - 1, 2 * source[..., 1] / height - 1], -1)
    out = F.grid_sample(x, grid.to(x.dtype), mode="bilinear", padding_mode="border", align_corners=False)
    inside = (
        (source[..., 0] >= 0) & (source[..., 0] < width) & (source[..., 1] >= 0) & (source[..., 1] < height)
    )
    return to_8_bits(
        out * inside[:, None].to(out.dtype)
    )  # (PIL: edge pixels within the image, black outside)


def rotation(degrees: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """PIL's ``Image.rotate(degrees)`` (counter-clockwise, about the centre, same size) as the affine
    matrices :func:`affine` takes: ``(N, 2, 3)``."""
    angle = -torch.deg2rad(degrees.to(torch.float64))
    cos, sin = torch.cos(angle), torch.sin(angle)
    cx, cy = width / 2, height / 2
    c = cos * -cx + sin * -cy + cx
    f = -sin * -cx + cos * -cy + cy
    return matrices(cos, sin, c, -sin, cos, f)


def matrices(a, b, c, d, e, f) -> torch.Tensor:
    """The affine matrices ``(a, b, c, d, e, f)`` of PIL's transform (each ``(N,)``): ``(N, 2, 3)``."""
    return torch.stack([torch.stack([a, b, c], -1), torch.stack([d, e, f], -1)], -2)


def _blend(degenerate: torch.Tensor, codes: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's ``Image.blend(degenerate, image, factor)`` on 8-bit codes: ``degenerate + factor * (image -
    degenerate)`` in float32, clipped, truncated (``factor``: ``(N,)``)."""
    alpha = factor.to(device=codes.device, dtype=torch.float32).view(-1, 1, 1, 1)
    out = degenerate.to(torch.float32) + alpha * (codes - degenerate).to(torch.float32)
    return out.clamp(0, LEVELS).to(torch.int64)


def _gray(codes: torch.Tensor) -> torch.Tensor:
    """PIL's ``convert("L")`` of RGB codes, ``(r·19595 + g·38470 + b·7471 + 2**15) >> 16`` (one channel:
    itself)."""
    if codes.shape[1] != 3:
        return codes
    return (codes[:, 0:1] * 19595 + codes[:, 1:2] * 38470 + codes[:, 2:3] * 7471 + 0x8000) >> 16


def color(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``ImageEnhance.Color(image).enhance(factor)``: each image blended with its grayscale."""
    codes = _codes(x)
    return _blend(_gray(codes).expand_as(codes), codes, factor).to(x.dtype) / LEVELS


def contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``ImageEnhance.Contrast(image).enhance(factor)``: each image blended with the gray of its
    grayscale's mean (rounded)."""
    codes = _codes(x)
    mean = torch.floor(_gray(codes).flatten(1).to(torch.float64).mean(1) + 0.5).to(torch.int64)
    return _blend(mean.view(-1, 1, 1, 1).expand_as(codes), codes, factor).to(x.dtype) / LEVELS


def brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``ImageEnhance.Brightness(image).enhance(factor)``: each image blended with black."""
    codes = _codes(x)
    return _blend(torch.zeros_like(codes), codes, factor).to(x.dtype) / LEVELS


def sharpness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``ImageEnhance.Sharpness(image).enhance(factor)``: each image blended with its ``SMOOTH`` filtering
    (3x3 kernel ``[[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13``, rounded; the border pixels kept)."""
    codes = _codes(x)
    n, channels, height, width = codes.shape
    kernel = torch.tensor([[1.0, 1, 1], [1, 5, 1], [1, 1, 1]], device=x.device) / 13
    smooth = codes.clone()
    if height > 2 and width > 2:
        inner = F.conv2d(
            codes.to(torch.float32).reshape(n * channels, 1, height, width), kernel.view(1, 1, 3, 3)
        )
        smooth[:, :, 1:-1, 1:-1] = (
            torch.floor(inner + 0.5).clamp(0, LEVELS).to(torch.int64).view(n, channels, height - 2, width - 2)
        )
    return _blend(smooth, codes, factor).to(x.dtype) / LEVELS

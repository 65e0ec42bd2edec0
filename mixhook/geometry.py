"""Geometry: small pure functions that place regions on maps, the way timm keeps ``rand_bbox`` and
``cutmix_bbox_and_lam`` beside its Mixup.

Boxes (CutMix, ResizeMix, SaliencyMix, TransMix), grids of cells (GridMix, TokenMix, Attentive
CutMix), Fourier masks (FMix), Gaussian masks (SmoothMix) and token masks (TokenMix), in 1, 2 or 3
dimensions where a method allows. Each takes sizes, ratios and a generator and returns plain values or
tensors: no module, no hook, no mixer state. The methods in :mod:`mixhook.mixers` draw their regions here
and blend with them there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .transfer import to_device

# -------------- Boxes: CutMix's, in 1, 2 or 3 dimensions (the 2-D names as timm's rand_bbox family)


def _sides(cut, rounding: str):
    """How many rows (columns) of a ``cut``-long side lie before the centre and from it on: ``cut // 2``
    each (``"paper"``: the authors' code and torchvision's; a box of even side), or ``cut // 2`` and
    ``(cut + 1) // 2`` (``"timm"``: timm >= 1.0's ``rand_bbox``; the side is ``cut``)."""
    return cut // 2, (cut + 1) // 2 if rounding == "timm" else cut // 2


def side_ratio(cut: float, dims: int) -> float:
    """The side ratio of a box that covers the fraction ``cut`` of a ``dims``-D map: ``cut``, ``sqrt(cut)``
    or the cube root (the double nearest to it, so that ``cut = 1/8`` gives sides of exactly half)."""
    if dims == 3:
        return float(side_ratios(torch.tensor([cut], dtype=torch.float64), 3)[0])
    return cut if dims == 1 else math.sqrt(cut)


def side_ratios(cut: torch.Tensor, dims: int) -> torch.Tensor:
    """:func:`side_ratio` of each value of ``cut`` (float64). The cube root is ``cut ** (1/3)`` moved to
    whichever neighbouring double has the cube nearest to ``cut``, the smaller of two as near
    (``0.125 ** (1/3)`` is not 0.5), so that one value and many give the same root."""
    if dims == 1:
        return cut
    if dims == 2:
        return torch.sqrt(cut)
    root = cut.pow(1.0 / 3.0)
    for _ in range(2):  # the best of each root's neighbours, ties to the smaller (pow may be 1 ulp off)
        candidates = torch.stack([torch.nextafter(root, root - 1), root, torch.nextafter(root, root + 1)])
        miss = (candidates * candidates * candidates - cut).abs()
        root = candidates.gather(0, miss.argmin(0, keepdim=True))[0].clamp(min=0.0)
    return root


def rand_region(
    shape: Sequence[int], lam: float, generator: torch.Generator, rounding: str = "paper"
) -> tuple[int, ...]:
    """A box of volume ratio about ``1 - lam`` in a map of positions ``shape`` (1, 2 or 3 sizes), with a
    uniformly drawn centre, clipped to the borders: :func:`rand_box` in any number of dimensions.

    Side ratio :func:`side_ratio` of ``1 - lam`` (for a 1-D map the length ratio ``1 - lam``, for a 3-D
    map the cube root), each side ``int(size * ratio)`` around a centre drawn uniformly along each
    dimension in order, rounded as ``rounding`` says. Returns ``(a1, b1, a2, b2, ...)``: positions
    ``a_k:b_k`` along dimension ``k`` (for a 2-D map ``(y1, y2, x1, x2)``)."""
    ratio = math.sqrt(1.0 - lam) if len(shape) == 2 else side_ratio(1.0 - lam, len(shape))
    box = []
    for size in shape:
        cut = int(size * ratio)
        centre = int(torch.randint(size, (), generator=generator, device=generator.device))
        before, after = _sides(cut, rounding)
        box += [max(centre - before, 0), min(centre + after, size)]
    return tuple(box)


def rand_box(
    height: int, width: int, lam: float, generator: torch.Generator, rounding: str = "paper"
) -> tuple[int, int, int, int]:
    """A box of area ratio about ``1 - lam`` with a uniformly drawn centre, clipped to the borders.

    Side ratio ``sqrt(1 - lam)``, sides ``cut_h = int(H * ratio)`` and ``cut_w = int(W * ratio)`` around a
    centre ``(cy, cx)`` uniform over the map (rows first). ``rounding="paper"``: rows
    ``cy - cut_h // 2 : cy + cut_h // 2``, as the paper's reference code and torchvision's ``v2.CutMix``;
    ``"timm"``: rows ``cy - cut_h // 2 : cy + (cut_h + 1) // 2``, as timm >= 1.0's ``rand_bbox`` (the
    paper's rounding drops a row and a column when ``cut`` is odd). Columns alike. Returns
    ``(y1, y2, x1, x2)``: rows ``y1:y2`` and columns ``x1:x2``.
    """
    return rand_region((height, width), lam, generator, rounding)


def rand_regions(
    shape: Sequence[int], lam: torch.Tensor, generator: torch.Generator, rounding: str = "paper"
) -> torch.Tensor:
    """One :func:`rand_region` per value of ``lam`` (1-D float64), vectorised: an ``(n, 2 * len(shape))``
    int64 tensor on the CPU. All ``n`` centres along the first dimension are drawn first, then along the
    next."""
    n = lam.shape[0]
    centres = [
        torch.randint(size, (n,), generator=generator, device=generator.device).cpu() for size in shape
    ]
    return regions_around(shape, lam, centres, rounding)


def rand_boxes(
    height: int, width: int, lam: torch.Tensor, generator: torch.Generator, rounding: str = "paper"
) -> torch.Tensor:
    """One :func:`rand_box` per value of ``lam`` (1-D float64), vectorised: an ``(n, 4)`` int64 tensor of
    ``(y1, y2, x1, x2)`` rows, on the CPU. Box ``i`` is the box :func:`rand_box` makes from ``lam[i]`` and
    the centre ``(cy[i], cx[i])``, where all ``n`` row centres are drawn first, then all column centres."""
    return rand_regions((height, width), lam, generator, rounding)


def regions_around(
    shape: Sequence[int], lam: torch.Tensor, centres: Sequence[torch.Tensor], rounding: str = "paper"
) -> torch.Tensor:
    """:func:`rand_region`'s boxes around given centres (one tensor per dimension): side ratio
    :func:`side_ratios` of ``1 - lam`` (one value or one per centre), the sides rounded as ``rounding``
    says, clipped to the borders; ``(n, 2 * len(shape))`` int64 rows on the centres' device."""
    device = centres[0].device
    ratio = side_ratios(1.0 - to_device(torch.as_tensor(lam, dtype=torch.float64), device), len(shape))
    bounds = []
    for size, centre in zip(shape, centres, strict=True):
        cut = (size * ratio).floor().long()
        centre = to_device(centre, device).long()
        before, after = _sides(cut, rounding)
        bounds += [(centre - before).clamp(min=0), (centre + after).clamp(max=size)]
    return torch.stack(torch.broadcast_tensors(*bounds), dim=1)


def boxes_around(
    height: int, width: int, lam: torch.Tensor, cy: torch.Tensor, cx: torch.Tensor, rounding: str = "paper"
) -> torch.Tensor:
    """:func:`rand_box`'s boxes around given centres: side ratio ``sqrt(1 - lam)`` (``lam`` one value or
    one per centre), the sides rounded as ``rounding`` says, clipped to the borders; ``(n, 4)`` int64
    ``(y1, y2, x1, x2)`` rows on the centres' device."""
    return regions_around((height, width), lam, (cy, cx), rounding)


def regions_mask(boxes: torch.Tensor, shape: Sequence[int], device=None) -> torch.Tensor:
    """``(n, 1, *shape)`` bool: True inside box ``i`` (positions ``a_k:b_k`` along each dimension ``k``)
    of sample ``i``."""
    boxes = boxes if device is None else to_device(boxes, device)  # queued, not a blocking copy
    inside = None
    for k, size in enumerate(shape):
        positions = torch.arange(size, device=device)
        along = (positions >= boxes[:, 2 * k : 2 * k + 1]) & (positions < boxes[:, 2 * k + 1 : 2 * k + 2])
        along = along.view(boxes.shape[0], *(size if j == k else 1 for j in range(len(shape))))
        inside = along if inside is None else inside & along
    return inside.unsqueeze(1)


def boxes_mask(boxes: torch.Tensor, height: int, width: int, device=None) -> torch.Tensor:
    """``(n, 1, height, width)`` bool: True inside box ``i`` (rows ``y1:y2``, columns ``x1:x2``) of
    sample ``i``."""
    return regions_mask(boxes, (height, width), device)


def box_slices(box: Sequence[int]) -> tuple[slice, ...]:
    """The positions of ``box`` (``(a1, b1, a2, b2, ...)``) as one slice per dimension: ``a_k:b_k``."""
    slices = []
    for k in range(0, len(box), 2):
        slices.append(slice(box[k], box[k + 1]))
    return tuple(slices)


def region_weights(box: tuple[int, ...], shape: Sequence[int]) -> torch.Tensor:
    """``(1, *shape)`` bool: the sample's own content, False inside the pasted ``box``."""
    weights = torch.ones((1, *shape), dtype=torch.bool)
    weights[(0, *box_slices(box))] = False
    return weights


def regions_lam(boxes: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Per sample, the lam its pasted box leaves: ``1 - box volume / map volume`` (float64)."""
    volume = (boxes[:, 1::2] - boxes[:, 0::2]).prod(dim=1)
    return 1.0 - volume.to(torch.float64) / math.prod(shape)


def region_lam(box: tuple[int, ...], shape: Sequence[int]) -> float:
    """The lam a pasted ``box`` leaves in a map of positions ``shape``: ``1 - box volume / map volume``."""
    volume = 1
    for k in range(0, len(box), 2):
        volume *= box[k + 1] - box[k]
    return 1.0 - volume / math.prod(shape)


def box_lam(box: tuple[int, int, int, int], height: int, width: int) -> float:
    """The lam a pasted ``box`` leaves: ``1 - box area / (height * width)``."""
    return region_lam(box, (height, width))


# --------------------------------------------- Grids of cells (GridMix, TokenMix, Attentive CutMix)


def cell_index(size: int, cells: int) -> torch.Tensor:
    """For each of ``size`` pixels, the cell it falls in when the side is cut into ``cells`` parts at
    ``floor(c * size / cells)``, ``c = 0..cells`` (cells differ by at most one pixel)."""
    edges = torch.arange(cells + 1) * size // cells
    return torch.searchsorted(edges, torch.arange(size), right=True) - 1


def grid_mask(cells: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The ``(height, width)`` float64 mask that gives every pixel the value of its cell in ``cells``
    (``(gh, gw)``, or ``(B, gh, gw)`` for one mask per sample; 1 = the sample's own, 0 = its partner's)."""
    gh, gw = cells.shape[-2:]
    rows, cols = (to_device(cell_index(size, n), cells.device) for size, n in ((height, gh), (width, gw)))
    return cells.to(torch.float64)[..., rows, :][..., cols]


def grid_volume(cells: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """:func:`grid_mask` over a map of positions ``shape`` (1, 2 or 3 sizes): the float64 mask of that
    shape that gives every position the value of its cell in ``cells`` (one cell count per dimension)."""
    mask = cells.to(torch.float64)
    for k, size in enumerate(shape):
        picks = to_device(cell_index(size, cells.shape[k]), cells.device)
        mask = mask.index_select(k, picks)
    return mask


# --------------------------------- Fourier masks (FMix): low-frequency noise, binarised to a volume


def fmix_frequencies(*shape: int) -> torch.Tensor:
    """The magnitude ``sqrt(fy^2 + fx^2)`` of each frequency of a real 2-D FFT of a ``height x width``
    image (float64, ``(height, width // 2 + 1)``; for odd ``width`` one column more, as the authors'
    ``fftfreqnd``). Given one size or three (a 1-D or 3-D map), the same over every dimension, the last
    one halved: ``(L // 2 + 1,)`` or ``(D, H, W // 2 + 1)`` (one more for odd ``L``, ``W``)."""
    *firsts, last = shape
    squared = torch.fft.fftfreq(last, dtype=torch.float64)[: last // 2 + (2 if last % 2 else 1)] ** 2
    for k, size in enumerate(reversed(firsts)):
        f = torch.fft.fftfreq(size, dtype=torch.float64).view(-1, *([1] * (k + 1)))
        squared = squared + f * f
    return torch.sqrt(squared)


def low_freq_image(
    param: torch.Tensor, decay_power: float, height: int, width: int, spectrum: str
) -> torch.Tensor:
    """A ``height x width`` image in [0, 1] of Fourier noise whose amplitudes decay as ``1 / f**decay_power``.

    ``param``: the Gaussian draws, ``(height, F, 2)`` with ``F`` columns of :func:`fmix_frequencies`, each
    frequency's scale ``1 / max(f, 1 / max(height, width)) ** decay_power`` times them. ``spectrum``:

    - ``"reference"``: the line the authors' ``make_low_freq_image`` (github.com/ecs-vlc/FMix,
      ``fmix.py``) carries commented out, ``#.reshape((1, *shape[:-1], -1))``, which reshapes the
      ``(..., F, 2)`` spectrum to ``(..., 2F)`` before ``irfftn``, so the draws are read as real
      coefficients (the ``2`` pairs interleaved along the frequency axis, the first ``width // 2 + 1``
      kept). Its images are point-symmetric (``m[y, x] == m[-y mod height, -x mod width]``: pixels tie
      in pairs) and isotropic blobs, like the paper's figures. mixhook's default on 2-D maps.
    - ``"authors"``: the line that code runs (at e5991dc, the repository's last commit, and in the copies
      of it in OpenMixup and elsewhere), ``spectrum[:, 0] + 1j * spectrum[:, 1]``: it indexes the
      spectrum's first two *rows* (``spectrum`` is ``(1, height, F, 2)``), so the coefficients are
      ``weighted[0] + i * weighted[1]``, ``(F, 2)``, which ``irfftn`` zero-pads to ``(height, width // 2
      + 1)``: only the horizontal frequencies 0 and 1 are used, and the masks are bands across the
      width. Masks equal theirs on the same draw.
    - ``"complex"``: the paper's description: ``param[..., 0] + i * param[..., 1]`` as complex
      coefficients.

    Then, as the authors' code: the real inverse FFT, minus its minimum, divided by its maximum.
    """
    freqs = fmix_frequencies(height, width)
    scale = 1.0 / torch.clamp(freqs, min=1.0 / max(height, width)) ** decay_power
    weighted = scale[..., None] * param
    if spectrum == "reference":
        coefficients = weighted.reshape(height, -1).to(torch.complex128)
    elif spectrum == "authors":
        coefficients = torch.complex(weighted[0], weighted[1])
    else:
        coefficients = torch.complex(weighted[..., 0], weighted[..., 1])
    image = torch.fft.irfftn(coefficients, s=(height, width))
    image = image - image.min()
    return image / image.max()


def binarise(image: torch.Tensor, lam: float, max_soft: float, round_up: bool) -> torch.Tensor:
    """The mask of the authors' ``binarise_mask``: the ``num`` highest pixels of ``image`` are 1, the rest
    0, with ``num = ceil(lam * size)`` if ``round_up`` else ``floor(lam * size)``; with ``max_soft > 0``
    the ``2 * soft`` pixels around the threshold (``soft = int(size * min(max_soft, lam, 1 - lam))``)
    fall linearly from 1 to 0. Its mean is ``num / size``."""
    flat = image.reshape(-1)
    size = flat.numel()
    order = torch.argsort(flat, stable=True).flip(0)  # as numpy's argsort()[::-1], ties included
    num = math.ceil(lam * size) if round_up else math.floor(lam * size)
    soft_fraction = max_soft if max_soft <= min(lam, 1 - lam) else min(lam, 1 - lam)
    soft = int(size * soft_fraction)
    low, high = num - soft, num + soft
    mask = torch.zeros(size, dtype=torch.float64)
    mask[order[:high]] = 1.0
    mask[order[low:]] = 0.0
    mask[order[low:high]] = _linspace_down(high - low)
    return mask.reshape(image.shape)


def _linspace_down(n: int) -> torch.Tensor:
    """``np.linspace(1, 0, n)`` to the last bit (torch's linspace rounds differently)."""
    if n <= 1:
        return torch.ones(n, dtype=torch.float64)
    values = torch.arange(n, dtype=torch.float64) * (-1.0 / (n - 1)) + 1.0
    values[-1] = 0.0
    return values


def low_freq_volume(param: torch.Tensor, decay_power: float, shape: tuple[int, ...]) -> torch.Tensor:
    """:func:`low_freq_image`'s ``"complex"`` spectrum over a map of positions ``shape`` (1, 2 or 3
    sizes): ``param`` (``(*fmix_frequencies(*shape).shape, 2)``) scaled by ``1 / max(f, 1 / max(shape))
    ** decay_power``, read as complex coefficients, the real inverse FFT over every dimension, minus its
    minimum, divided by its maximum. On a 2-D map it is ``low_freq_image(..., "complex")``."""
    freqs = fmix_frequencies(*shape)
    scale = 1.0 / torch.clamp(freqs, min=1.0 / max(shape)) ** decay_power
    weighted = scale[..., None] * param
    image = torch.fft.irfftn(torch.complex(weighted[..., 0], weighted[..., 1]), s=shape)
    image = image - image.min()
    return image / image.max()


def fmix_mask(
    height: int,
    width: int | None,
    lam: float,
    decay_power: float,
    max_soft: float,
    spectrum: str,
    generator: torch.Generator,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """One FMix mask (float64 ``(height, width)``, on the CPU): Gaussian spectrum draws and the rounding
    coin from ``generator`` (on its device: a CUDA generator's are read to the host), then
    :func:`low_freq_image` and :func:`binarise`. With ``shape`` (1 or 3 sizes; ``height`` and ``width``
    ignored) a mask of that shape from :func:`low_freq_volume` (the ``"complex"`` spectrum only)."""
    shape = (height, width) if shape is None else tuple(shape)
    device = generator.device
    param = torch.randn(
        *fmix_frequencies(*shape).shape, 2, dtype=torch.float64, generator=generator, device=device
    )
    round_up = bool(torch.rand((), dtype=torch.float64, generator=generator, device=device) > 0.5)
    param = param.cpu()
    if len(shape) == 2:
        image = low_freq_image(param, decay_power, *shape, spectrum)
    else:
        image = low_freq_volume(param, decay_power, shape)
    return binarise(image, lam, max_soft, round_up)


# ----------------------------------------------------------------------- Gaussian masks (SmoothMix)


def gaussian_mask(
    height: int, width: int, cy: float, cx: float, sigma_y: float, sigma_x: float
) -> torch.Tensor:
    """``G[y, x] = exp(-(y - cy)^2 / (2 sigma_y^2) - (x - cx)^2 / (2 sigma_x^2))``: float64
    ``(height, width)``, 1 at the centre ``(cy, cx)`` (in pixel indices), falling smoothly to 0."""
    ys = torch.arange(height, dtype=torch.float64) - cy
    xs = torch.arange(width, dtype=torch.float64) - cx
    return torch.exp(-(ys * ys)[:, None] / (2 * sigma_y**2) - (xs * xs)[None, :] / (2 * sigma_x**2))


def gaussian_volume(
    shape: tuple[int, ...], centre: tuple[float, ...], sigmas: tuple[float, ...]
) -> torch.Tensor:
    """:func:`gaussian_mask` over a map of positions ``shape`` (1, 2 or 3 sizes): float64, 1 at ``centre``,
    ``exp(-sum_k (p_k - c_k)^2 / (2 sigma_k^2))``."""
    if len(shape) == 2:
        return gaussian_mask(*shape, *centre, *sigmas)
    exponent = torch.zeros((), dtype=torch.float64)
    for k, (size, c, sigma) in enumerate(zip(shape, centre, sigmas, strict=True)):
        p = torch.arange(size, dtype=torch.float64) - c
        exponent = exponent - (p * p).view(*(size if j == k else 1 for j in range(len(shape)))) / (
            2 * sigma**2
        )
    return torch.exp(exponent)


# ----------------------------------------------------------- Token masks on a patch grid (TokenMix)

MIN_ASPECT = 0.3  # TokenMix's block aspect ratios (the authors'): log-uniform in [0.3, 1 / 0.3]


def _uniform(low: float, high: float, generator: torch.Generator) -> float:
    """Python's ``random.uniform(low, high)`` (``low + (high - low) * U``), drawn from ``generator``."""
    u = float(torch.rand((), dtype=torch.float64, generator=generator, device=generator.device))
    return low + (high - low) * u


def _randint(low: int, high: int, generator: torch.Generator) -> int:
    """Python's ``random.randint(low, high)`` (both ends included), drawn from ``generator``."""
    return low + int(torch.randint(high - low + 1, (), generator=generator, device=generator.device))


def block_token_mask(rows: int, cols: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """The authors' block mask: ``(rows, cols)`` bool, True on the tokens taken from the partner.

    As their ``generate_mask`` (BEiT's block-wise masking): until ``count`` tokens are masked, up to 10
    tries per round to draw a block of area ``U(1, remaining)`` and aspect ratio log-uniform in
    ``[0.3, 1 / 0.3]`` (sides ``round(sqrt(area * aspect))`` by ``round(sqrt(area / aspect))``, each
    smaller than the grid's), at a uniform position; a block is accepted when it masks between 1 and
    ``remaining`` new tokens. A round with no accepted block ends the loop, so the mask may hold fewer
    than ``count`` tokens (the method's lam is what it holds)."""
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    log_aspect = (math.log(MIN_ASPECT), math.log(1 / MIN_ASPECT))
    masked = 0
    while masked < count:
        remaining = min(count - masked, rows * cols)
        delta = 0
        for _ in range(10):
            area = _uniform(1, remaining, generator)
            aspect = math.exp(_uniform(*log_aspect, generator))
            h, w = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
            if w < cols and h < rows:
                top, left = _randint(0, rows - h, generator), _randint(0, cols - w, generator)
                block = mask[top : top + h, left : left + w]
                new = h * w - int(block.sum())
                if 0 < new <= remaining:
                    block.fill_(True)
                    delta += new
                if delta > 0:
                    break
        if delta == 0:
            break
        masked += delta
    return mask


def random_token_mask(rows: int, cols: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """The authors' random mask: ``(rows, cols)`` bool, True on ``count`` tokens drawn uniformly without
    replacement (the first ``count`` of a permutation)."""
    mask = torch.zeros(rows * cols, dtype=torch.bool)
    mask[torch.randperm(rows * cols, generator=generator, device=generator.device).cpu()[:count]] = True
    return mask.view(rows, cols)

"""FMix at any layer with a 2-D map (or a 1-D or 3-D one): masks cut from thresholded low-frequency noise.

Paper: Harris, Marcu, Painter, Niranjan, Prügel-Bennett, Hare. "FMix: Enhancing Mixed Sample Data
Augmentation." arXiv:2002.12047, 2020. Authors' code: github.com/ecs-vlc/FMix (``fmix.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..sites import Leaf
from .base import Mixer
from .checks import check_non_negative, check_pinned_mask, check_positive, check_splittable
from .contract import Draw
from .masked import MaskedMix
from .tokens import token_grid

SPECTRA = ("reference", "authors", "complex")


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
    coin from ``generator``, then :func:`low_freq_image` and :func:`binarise`. With ``shape`` (1 or 3
    sizes; ``height`` and ``width`` ignored) a mask of that shape from :func:`low_freq_volume` (the
    ``"complex"`` spectrum only)."""
    shape = (height, width) if shape is None else tuple(shape)
    param = torch.randn(*fmix_frequencies(*shape).shape, 2, dtype=torch.float64, generator=generator)
    round_up = bool(torch.rand((), dtype=torch.float64, generator=generator) > 0.5)
    if len(shape) == 2:
        image = low_freq_image(param, decay_power, *shape, spectrum)
    else:
        image = low_freq_volume(param, decay_power, shape)
    return binarise(image, lam, max_soft, round_up)


class FMix(MaskedMix, Mixer):
    """FMix (Harris et al. 2020) at the input or at any layer whose output is ``(B, C, H, W)`` (or a 1-D
    ``(B, C, L)`` or 3-D ``(B, C, D, H, W)`` map, as the authors' code offers).

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``,
    ``lam ~ Beta(alpha, alpha)``, a permutation ``index`` and a mask ``M`` (``H x W``, one for the batch,
    the same for every channel) that keeps the ``lam`` fraction of pixels where low-frequency Fourier
    noise is highest (:func:`fmix_mask`):

        ``h' = M * h + (1 - M) * h[index]``

    ``loss`` and ``targets`` use the mask's mean (the fraction of each sample actually kept), which
    differs from the drawn lam by the rounding to whole pixels (< 1 / (H * W)); the authors' code uses
    the drawn lam. ``.last.info["mask"]`` is ``M``.

    On a 1-D or 3-D map the mask is cut from the paper's spectrum over every dimension
    (:func:`low_freq_volume`; ``spectrum="complex"``): the authors' N-D spectrum is not one a
    ``(L,)`` or ``(D, H, W)`` inverse FFT reads as such (their 3-D frequencies are laid out
    ``(D, W, H // 2 + 1)``), so it is not reproduced; ``"reference"`` and ``"authors"`` are then
    refused. Layouts as :class:`~mixhook.CutMix`'s.

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output a map (see above).
        alpha: Beta concentration, > 0 (the authors' default 1.0).
        decay_power: the spectrum's decay ``1 / f**decay_power``, > 0: larger, smoother masks (the
            authors' default 3.0).
        max_soft: soften the mask's edge over up to this fraction of pixels, in [0, 0.5] (default 0.0,
            a binary mask).
        spectrum: on a 2-D map ``"reference"`` (the line the authors' code carries commented out),
            ``"authors"`` (the line it runs, masks equal to theirs on the same draw) or ``"complex"`` (the
            paper's description), see :func:`low_freq_image`; on a 1-D or 3-D map ``"complex"``. ``None``
            (default): ``"reference"`` on 2-D maps, ``"complex"`` on others.
        prob, generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout: ``"NHWC"``/``"NCHW"``, ``"NCL"``/``"NLC"`` or ``"NCDHW"``/``"NDHWC"`` (or a dict per
            layer) for a map whose layout the model does not state; see :class:`~mixhook.CutMix`.
        tokens, prefix: on ``(B, T, D)`` tokens (a ViT block), the patch grid ``(rows, columns)`` or
            ``"auto"`` and the rule for the leading tokens; see :mod:`mixhook.mixers.tokens`.

    ``pin`` also takes ``mask`` (an ``(H, W)`` tensor of weights in [0, 1]; ``(L,)``, ``(D, H, W)``).
    """

    pin_keys = ("mask",)
    region_dims = (1, 2, 3)

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 1.0,
        decay_power: float = 3.0,
        max_soft: float = 0.0,
        spectrum: str | None = None,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout=layout)
        self.token_grid = token_grid(tokens, prefix, "FMix")
        self.decay_power = check_positive("decay_power", decay_power)
        self.max_soft = check_non_negative("max_soft", max_soft)
        if self.max_soft > 0.5:
            raise ValueError(f"max_soft must be in [0, 0.5], got {max_soft!r}")
        if spectrum is not None and spectrum not in SPECTRA:
            raise ValueError(f"spectrum must be one of {', '.join(SPECTRA)}, got {spectrum!r}")
        self.spectrum = spectrum

    def __repr__(self) -> str:
        extra = f"decay_power={self.decay_power}, max_soft={self.max_soft}, spectrum={self.spectrum!r}"
        return f"{super().__repr__()[:-1]}, {extra})"

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        h = check_splittable("FMix", spec, leaves, self.region_dims)
        if h.ndim != 4 and self.spectrum in ("reference", "authors"):
            raise ValueError(
                f"FMix at {spec!r}: spectrum={self.spectrum!r} reproduces the authors' 2-D masks, but the "
                f"map is {h.ndim - 2}-D; use spectrum='complex' (the paper's spectrum) or leave it out"
            )

    def draw_mask(self, h: torch.Tensor, draw: Draw) -> tuple[torch.Tensor, dict]:
        shape = tuple(h.shape[2:])
        if draw.lam.ndim:
            raise ValueError(f"FMix cuts one mask per batch: pin one lam, not {draw.lam.shape[0]}")
        mask = draw.pinned.get("mask")
        if mask is not None:
            return check_pinned_mask(mask, *shape), {}
        lam, g = float(draw.lam), draw.generator
        spectrum = self.spectrum or ("reference" if len(shape) == 2 else "complex")
        mask = fmix_mask(0, 0, lam, self.decay_power, self.max_soft, spectrum, g, shape=shape)
        return mask, {}

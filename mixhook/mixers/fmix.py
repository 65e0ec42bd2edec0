"""FMix at any layer with a 2-D map (or a 1-D or 3-D one): masks cut from thresholded low-frequency noise.

Paper: Harris, Marcu, Painter, Niranjan, Prügel-Bennett, Hare. "FMix: Enhancing Mixed Sample Data
Augmentation." arXiv:2002.12047, 2020. Authors' code: github.com/ecs-vlc/FMix (``fmix.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.card import Card
from ..engine.checks import check_non_negative, check_pinned_mask, check_positive, check_splittable
from ..engine.contract import Draw
from ..engine.regions import MaskMixer
from ..geometry import fmix_mask
from ..hooks import Planned
from ..sites import Leaf

SPECTRA = ("reference", "authors", "complex")


class FMix(MaskMixer):
    """FMix (Harris et al. 2020) at the input or at any layer whose output is ``(B, C, H, W)`` (or a 1-D
    ``(B, C, L)`` or 3-D ``(B, C, D, H, W)`` map, as the authors' code offers).

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``,
    ``lam ~ Beta(alpha, alpha)``, a permutation ``index`` and a mask ``M`` (``H x W``, one for the batch,
    the same for every channel) that keeps the ``lam`` fraction of pixels where low-frequency Fourier
    noise is highest (:func:`~mixhook.geometry.fmix_mask`):

        ``h' = M * h + (1 - M) * h[index]``

    ``loss`` and ``targets`` use the mask's mean (the fraction of each sample actually kept), which
    differs from the drawn lam by the rounding to whole pixels (< 1 / (H * W)); the authors' code uses
    the drawn lam. ``.last.info["mask"]`` is ``M``.

    On a 1-D or 3-D map the mask is cut from the paper's spectrum over every dimension
    (:func:`~mixhook.geometry.low_freq_volume`; ``spectrum="complex"``): the authors' N-D spectrum is
    not one a ``(L,)`` or ``(D, H, W)`` inverse FFT reads as such (their 3-D frequencies are laid out
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
            paper's description), see :func:`~mixhook.geometry.low_freq_image`; on a 1-D or 3-D map
            ``"complex"``. ``None`` (default): ``"reference"`` on 2-D maps, ``"complex"`` on others.
        prob, generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout, tokens, prefix: as :class:`~mixhook.engine.regions.RegionMixer` (maps in any layout, a
            ViT's tokens as maps).

    ``pin`` also takes ``mask`` (an ``(H, W)`` tensor of weights in [0, 1]; ``(L,)``, ``(D, H, W)``).
    """

    card = Card(
        paper="Harris et al. 2020",
        mixes="a mask from low-frequency Fourier noise",
        where="input, any map, ViT tokens",
        family="region",
        traits=("tokens",),
        signature="FMix(layer, alpha=1.0, decay_power=3.0, max_soft=0.0, spectrum=None)",
        hook="forward, `(B,C,H,W)` outputs (or `(B,C,L)`, `(B,C,D,H,W)`) or ViT tokens",
        commands="`mixup=fmix mixup.layer=layer1`",
        details=(
            "Mask `M` (H×W, one per batch): the `lam` fraction of pixels where Fourier noise with amplitudes "
            "`∝ 1/f^decay_power` is highest; `h' = M h + (1-M) h[index]`; lam ← `mean(M)`; "
            '`spectrum="reference"` (the default on 2-D maps): the line the authors\' `fmix.py` carries '
            'commented out (isotropic blobs, point-symmetric: pixels tie in pairs), `"authors"`: the line it '
            "runs, equal to their code on the same draws (it reads the spectrum's first two rows, so its "
            'masks are bands across the width), `"complex"` (the default on 1-D and 3-D maps): the paper\'s '
            'description; `.last.info["mask"]`'
        ),
    )

    pin_keys = ("mask",)
    checks_by_signature = True  # (the map's kind and sides, and the spectrum)
    spectrum = Planned()
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
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout, tokens, prefix)
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

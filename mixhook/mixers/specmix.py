"""SpecMix on spectrograms: whole time and frequency bands of each sample come from its partner.

Paper: Kim, Han, Ko. "SpecMix: A Mixed Sample Data Augmentation method for Training with Time-Frequency
Domain Features." Interspeech 2021. https://arxiv.org/abs/2108.03020. Authors' code:
github.com/GT-KIM/specmix (``acoustic_scene_classification/utils.py``: ``masking`` and
``SpecmixGenerator.__data_generation``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.card import Card
from ..engine.checks import check_fraction, check_region, map_size
from ..engine.contract import Draw, Mixed
from ..engine.regions import RegionMixer
from ..functional import gather_rows
from ..sites import Leaf
from ..transfer import to_device


def band_starts(size: int, ratio: float) -> int:
    """How many starts a band of ``int(size * ratio)`` positions has: the authors' offsets are
    ``np.random.randint(0, (1 - ratio) * size + 1)``, whose float bound numpy truncates."""
    return int((1.0 - ratio) * size + 1)


def band_mask(bands: torch.Tensor, freq: int, time: int, ratio: float) -> torch.Tensor:
    """The ``(B, F, T)`` boolean own-content mask of per-sample ``bands`` (``(B, 2, K)`` int64: row 0 the
    time bands' first columns, row 1 the frequency bands' first rows, ``-1`` for no band): ``False`` inside
    a time band (``int(T * ratio)`` columns) or a frequency band (``int(F * ratio)`` rows). Device ops only
    (the traced path builds it in the graph)."""
    device = bands.device
    starts_t, starts_f = bands[:, 0, :, None], bands[:, 1, :, None]  # (B, K, 1)
    cols = torch.arange(time, device=device)
    rows = torch.arange(freq, device=device)
    in_time = ((starts_t >= 0) & (cols >= starts_t) & (cols < starts_t + int(time * ratio))).any(1)
    in_freq = ((starts_f >= 0) & (rows >= starts_f) & (rows < starts_f + int(freq * ratio))).any(1)
    return ~(in_time[:, None, :] | in_freq[:, :, None])


class SpecMix(RegionMixer):
    """SpecMix (Kim et al. 2021) at the input or at any layer whose output is a ``(B, C, F, T)``
    spectrogram map (frequency along dimension 2, time along dimension 3, as torchaudio's spectrograms;
    a ``(B, F, T, C)`` map takes ``layout="NHWC"``).

    On each training forward, with probability ``prob``: one layer is drawn from ``layer`` and a
    permutation ``index``; then for each sample its own mask: ``n_t`` and ``n_f`` uniform in
    ``0..bands``, ``n_t`` time bands of ``int(T * ratio)`` columns and ``n_f`` frequency bands of
    ``int(F * ratio)`` rows, each starting uniformly in ``0..int((1 - ratio) * size)`` (bands may overlap).
    Inside a band the sample takes its partner's content, elsewhere it keeps its own:

        ``h'_i = M_i * h_i + (1 - M_i) * h_index[i]``,   ``lam_i = mean(M_i)``

    so ``.last.lam`` is one value per sample (``loss`` needs a per-sample criterion,
    ``reduction="none"``), ``.last.weights`` the ``(B, F, T)`` masks (dense targets, e.g. frame labels
    ``(B, F, T)``, are mixed by them). No lam is drawn (``alpha`` is not an argument; the authors'
    generator takes one and does not use it). ``.last.info["bands"]`` is the ``(B, 2, bands)`` int64
    starts (row 0 time, row 1 frequency, ``-1``: no band).

    Equal to the authors' ``masking`` on the same draws (tested) with one difference, said here: their
    time band is ``mask[:, t:t + int(F * ratio)]`` with ``t < (1 - ratio) * F + 1``, its width and range
    taken from the frequency axis (and the frequency band's from the time axis); on their square
    crops it makes no difference, on an ``F != T`` map it would make a time band as wide as the
    spectrogram is tall, so here each band is measured along its own axis.

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output a ``(B, C, F, T)``
            map.
        ratio: each band's width as a fraction of its axis, in (0, 1) (the authors' acoustic scene
            classification: 0.7).
        bands: the most bands along each axis, >= 1 (the authors: ``np.random.randint(3)``, so 2).
        prob, generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout: as :class:`~mixhook.engine.regions.RegionMixer` (``"NHWC"`` for ``(B, F, T, C)``).

    ``pin`` also takes ``bands`` (``(B, 2, K)`` starts, ``K <= bands``, ``-1`` for none).
    """

    card = Card(
        paper="Kim et al. 2021",
        mixes="time and frequency bands of a spectrogram",
        where="input, `(B,C,F,T)` maps",
        family="region",
        signature="SpecMix(layer, ratio=0.7, bands=2)",
        hook='forward, `(B,C,F,T)` spectrogram maps (`layout="NHWC"` for `(B,F,T,C)`)',
        commands="`mixup=specmix`",
        details=(
            "Per sample `n_t, n_f ~ U{0..bands}` time bands of `int(T·ratio)` columns and frequency bands of "
            "`int(F·ratio)` rows from `h[index]`; lam ← each sample's kept fraction (one per sample, no Beta "
            "draw); equal to the authors' `masking` on the same draws (their band widths swap the axes on a "
            "non-square map: here each band is measured along its own axis)"
        ),
        drawn={"seed": 1, "ratio": 0.3},  # a draw with a band along each axis of image 0,
    )

    pin_keys = ("bands",)

    def __init__(
        self,
        layer: str | Sequence[str],
        ratio: float = 0.7,
        bands: int = 2,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, 1.0, prob, generator, batch_dim, padding, layout)
        ratio = check_fraction("ratio", ratio)
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"ratio must be in (0, 1) (a band's width over its axis' length), got {ratio!r}")
        if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
            raise ValueError(f"bands must be an int >= 1 (the most bands along each axis), got {bands!r}")
        self.ratio, self.bands = ratio, bands

    def __repr__(self) -> str:
        spec = self._layer_spec
        return f"SpecMix(layer={spec!r}, ratio={self.ratio}, bands={self.bands}, prob={self.prob})"

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """Nothing drawn: SpecMix's lam is each mask's mean (a placeholder until :meth:`mix`)."""
        return torch.ones((), dtype=torch.float64)

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        try:
            h = check_region("SpecMix", spec, leaves)
        except TypeError as e:
            raise TypeError(
                f"{e}; SpecMix cuts (B, C, F, T) spectrogram maps (frequency, then time; a (B, F, T, C) "
                "map takes layout='NHWC')"
            ) from None
        freq, time = h.shape[2:]
        if int(freq * self.ratio) < 1 or int(time * self.ratio) < 1:
            raise ValueError(
                f"SpecMix at {spec!r}: its {map_size(h)} (F x T) map is too small for bands of ratio "
                f"{self.ratio} (int(side * ratio) is 0); choose an earlier layer or a larger ratio"
            )

    def _bands(self, n: int, freq: int, time: int, draw: Draw) -> torch.Tensor:
        """The ``(n, 2, K)`` band starts of one mix: pinned (checked), or drawn from ``draw.generator``
        (the counts of all samples first, then the time starts, then the frequency starts)."""
        if "lam" in draw.pinned:
            raise ValueError("SpecMix draws no lam (its lam is each mask's mean): pin bands=... instead")
        bands = draw.pinned.get("bands")
        if bands is not None:
            bands = torch.as_tensor(bands).to(torch.int64).cpu()
            if bands.ndim != 3 or bands.shape[:2] != (n, 2) or bands.shape[2] > self.bands:
                raise ValueError(
                    f"pinned bands of shape {tuple(bands.shape)}: SpecMix(bands={self.bands}) takes ({n}, 2, "
                    f"K <= {self.bands}) starts (row 0 time, row 1 frequency, -1 for no band)"
                )
            bands = torch.cat([bands, bands.new_full((n, 2, self.bands - bands.shape[2]), -1)], 2)
            highs = torch.tensor([time, freq]).view(1, 2, 1) - torch.tensor(
                [int(time * self.ratio), int(freq * self.ratio)]
            ).view(1, 2, 1)
            if bool(((bands < -1) | (bands > highs)).any()):
                raise ValueError(
                    f"a pinned band does not fit the {freq}x{time} (F x T) map of layer {draw.layer!r}"
                )
            return bands
        g = draw.generator
        counts = torch.randint(self.bands + 1, (n, 2), generator=g, device=g.device).cpu()
        starts = [
            torch.randint(band_starts(size, self.ratio), (n, self.bands), generator=g, device=g.device).cpu()
            for size in (time, freq)
        ]
        bands = torch.stack(starts, 1)
        used = torch.arange(self.bands).view(1, 1, -1) < counts[:, :, None]
        return torch.where(used, bands, torch.full_like(bands, -1))

    def traced_params(self, n: int, leaves: list[Leaf]) -> list:
        return [((n,), torch.int64), ((n, 2, self.bands), torch.int64)]  # index, band starts

    def draw_traced(self, leaves: list[Leaf], draw: Draw) -> tuple[list[torch.Tensor], Mixed]:
        h = leaves[0].tensor
        n, (freq, time) = h.shape[0], tuple(h.shape[2:])
        bands = self._bands(n, freq, time, draw)
        own = band_mask(bands, freq, time, self.ratio)
        lam = own.to(torch.float64).mean((1, 2))
        return [draw.index, bands], Mixed({}, lam=lam, info={"bands": bands}, weights=own)

    def mix_traced(self, leaves: list[Leaf], values: list[torch.Tensor]) -> dict:
        index, bands = values
        h = leaves[0].tensor
        own = band_mask(bands, *h.shape[2:], self.ratio)[:, None]
        return {leaves[0].path: torch.where(own, h, gather_rows(h, to_device(index, h.device)))}

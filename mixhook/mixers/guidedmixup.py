"""GuidedMixup at any layer with two spatial dimensions (or on a ViT's tokens): each position blended by the
pair's saliency there, the pairs chosen so that their salient parts differ most.

Paper: Kang, Kim. "GuidedMixup: An Efficient Mixup Strategy Guided by Saliency Maps." AAAI 2023.
https://arxiv.org/abs/2306.16612. Authors' code: github.com/3neutronstar/GuidedMixup
(``FGVC/Implementor/guidedmixup.py``, ``mixup.py``'s ``guided`` branch, ``pairing.pyx``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..engine.card import Card
from ..engine.checks import check_positive, check_spatial
from ..engine.contract import Draw, Mixed
from ..engine.regions import RegionMixer
from ..engine.saliency import KEY, Saliency, SaliencyGuided, guided_maps, guided_pairs, pinned_saliency
from ..sites import Leaf
from ..transfer import to_device

PAIRINGS = ("greedy", "random")


class GuidedMixup(SaliencyGuided, RegionMixer):
    """GuidedMixup (Kang & Kim 2023) at any layer whose output is ``(B, C, H, W)`` (the input included; a
    ViT block's tokens with ``tokens``): every position of a sample and its partner blended in proportion
    to their saliency there.

    On each training forward, with probability ``prob``: one layer is drawn from ``layer`` and the saliency
    ``S`` of every sample's map is computed (:mod:`mixhook.engine.saliency`), blurred (a ``blur`` x
    ``blur`` Gaussian of standard deviation ``sigma``) and normalised to sum 1 per sample. The partners
    are chosen from it (``pairing="greedy"``, the authors' ``greedy_c``: a greedy cycle over the L2
    distances between the maps, so the pairs' salient parts differ most; ``"random"``: a random
    permutation). Each position's own-content weight is the pair's saliency ratio there,

        ``w = S / (S + S[index])``,  mixed ``= w * h + (1 - w) * h[index]``,

    (``1/2`` where both maps are 0) and each sample's label weight is its mean, ``lam_i = mean(w_i)``: one
    lam per sample, so ``loss`` needs a per-sample criterion (``reduction="none"``). Nothing is drawn
    from ``alpha``: the method has no lam of its own (``pin(lam=...)`` is refused).
    ``.last.info["saliency"]`` is the ``(B, H, W)`` saliency it mixed by, ``["weights"]`` the ``w``.

    The authors' ``guided-ap`` saliency is ``saliency="gradient"`` (default): ``sqrt(mean_c g**2)`` of the
    loss gradient with respect to what is mixed (one more forward and a backward, in eval mode, before the
    training forward; ``use_targets(y)`` before each). ``"activation"`` reads ``mean_c |h|`` of the mixed
    map itself (a hidden layer: no extra pass). ``pin(saliency=...)`` takes maps of your own (the authors'
    ``guided-sr`` spectral-residual maps of the images, for example).

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output ``(B, C, H, W)``.
        saliency: ``"gradient"`` (default, the authors') or ``"activation"``.
        saliency_layer: with ``"activation"``, an earlier layer whose channel-mean magnitude (resized) is
            the saliency; ``None``: the mixed map's own.
        pairing: ``"greedy"`` (default, the authors') or ``"random"``.
        blur: the Gaussian blur's kernel size (authors: 7; shrunk to what a small map can reflect; 0: none).
        sigma: its standard deviation (authors: 3).
        prob: probability that a batch is mixed (the authors' ``mix_prob``).
        generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout, tokens, prefix: as :class:`~mixhook.engine.regions.RegionMixer` (maps in any layout, a
            ViT's tokens as maps).

    ``pin`` also takes ``saliency``; a pinned ``index`` replaces the pairing. OpenMixup's port
    (``openmixup/models/augments/guidedmix.py``) computes the greedy cycle but mixes the images and
    labels of its first random permutation: it is ``pairing="random"`` (equal on the same permutation).
    """

    card = Card(
        paper="Kang & Kim 2023",
        mixes="each position by the pair's saliency ratio",
        where="input, any map, ViT tokens (+ a gradient pass)",
        family="saliency",
        traits=("tokens",),
        signature='GuidedMixup(layer, saliency="gradient", pairing="greedy", blur=7, sigma=3.0)',
        hook='forward, `(B,C,H,W)` outputs or ViT tokens (+ one forward/backward for `"gradient"`)',
        commands="`mixup=guidedmixup`, `mixup=guidedmixup mixup.layer=layer1 mixup.saliency=activation`",
        details=(
            "`w = S / (S + S[index])` per position from the blurred, sum-normalised saliency `S`, mixed "
            "`w·h + (1-w)·h[index]`; lam per sample `mean(w)`; partners by a greedy cycle over the "
            "saliency maps' distances (the authors' `greedy_c`) or at random; saliency `sqrt(mean_c g²)` "
            "of the label loss's gradient (the authors' `guided-ap`; `use_targets(y)` first) or "
            "`mean_c abs(h)` of the mixed map; mix and pairing equal to the authors' code on the same "
            'saliency (OpenMixup\'s port, which mixes its random pairs, is `pairing="random"`); '
            '`.last.info["saliency"]`, `["weights"]`'
        ),
        example={"layer": "input"},
    )

    pin_keys = ("saliency",)
    draws_in_mix = False  # (lam is not drawn, the partners are chosen before the mix)

    def __init__(
        self,
        layer: str | Sequence[str],
        saliency: str = "gradient",
        saliency_layer: str | None = None,
        pairing: str = "greedy",
        blur: int = 7,
        sigma: float = 3.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, 1.0, prob, generator, batch_dim, padding, layout, tokens, prefix)
        self.saliency = Saliency("GuidedMixup", saliency, saliency_layer, self.layers)
        if pairing not in PAIRINGS:
            raise ValueError(f"pairing must be one of {', '.join(PAIRINGS)}, got {pairing!r}")
        if isinstance(blur, bool) or not isinstance(blur, int) or blur < 0:
            raise ValueError(f"blur must be a kernel size >= 0 (0: no blur), got {blur!r}")
        self.pairing, self.blur, self.sigma = pairing, blur, check_positive("sigma", sigma)

    def __repr__(self) -> str:
        base = super().__repr__()[:-1].replace(", alpha=1.0", "")
        return f"{base}, {self.saliency!r}, pairing={self.pairing!r}, blur={self.blur}, sigma={self.sigma})"

    def pin(self, layer: str | None = None, lam=None, index=None, **values) -> None:
        if lam is not None:
            raise TypeError(
                "GuidedMixup.pin(lam=...): GuidedMixup draws no lam (each position's weight is the pair's "
                "saliency ratio, each label weight its mean); pin saliency= or index= instead"
            )
        super().pin(layer, index=index, **values)

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.ones((), dtype=torch.float64)  # unused: the saliency sets the weights

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        check_spatial("GuidedMixup", spec, leaves)

    def before_mix(self, spec: str, leaves: list[Leaf], pinned: Mapping, generator) -> Mapping:
        found = dict(super().before_mix(spec, leaves, pinned, generator))
        if self.pairing == "random" or "index" in pinned:
            return found
        saliency = found.get(KEY, pinned.get(KEY))
        if saliency is None or saliency.shape[0] != leaves[0].tensor.shape[0]:
            return found  # (the mix refuses it in one line)
        index = guided_pairs(torch.as_tensor(saliency).detach(), self.blur, self.sigma)
        return {**found, "index": index, "permutation": True}

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        n, height, width = h.shape[0], h.shape[-2], h.shape[-1]
        saliency = pinned_saliency("GuidedMixup", draw.pinned, n, height, width, h.device)
        index = to_device(draw.index, h.device)
        own = guided_maps(saliency, self.blur, self.sigma)
        partner = own[index]
        total = own + partner
        both = total > 0
        total = total.clamp_min(torch.finfo(total.dtype).tiny)
        w = torch.where(both, own / total, 0.5)  # (the authors' norm_sc_a; 1/2 where both maps are 0)
        w_partner = torch.where(both, partner / total, 0.5)  # (their norm_sc_b)
        m, m_partner = w.to(h.dtype)[:, None], w_partner.to(h.dtype)[:, None]
        mixed = m * h + m_partner * h[index]
        info = {"saliency": saliency, "weights": w}
        return Mixed({path: mixed}, lam=w.flatten(1).mean(1), info=info, weights=w)

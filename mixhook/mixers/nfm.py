"""Noisy Feature Mixup: Manifold Mixup followed by additive and multiplicative noise.

Paper: Lim, Erichson, Utrera, Xu, Mahoney. "Noisy Feature Mixup." ICLR 2022. https://arxiv.org/abs/2110.02180
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.checks import check_non_negative
from ..engine.contract import Draw, Mixed
from ..functional import sample_beta
from ..sites import Leaf
from ..transfer import to_device
from .manifold import ManifoldMixup


class NoisyFeatureMixup(ManifoldMixup):
    """Noisy Feature Mixup (Lim et al. 2022): Manifold Mixup, then additive and multiplicative noise.

    The mixed tensor ``m = lam * h + (1 - lam) * h[index]`` becomes ``mult * m + add`` with, as in the
    paper's code, ``add = add_noise * b1 * N(0, 1)`` and ``mult = 1 + mult_noise * b2 * U(-1, 1)``
    elementwise, where ``b1, b2 ~ Beta(2, 5)`` are drawn once per batch. With ``add_noise=0`` and
    ``mult_noise=0`` nothing more is drawn or computed: it equals :class:`ManifoldMixup` exactly.

    The noise is drawn on the generator's device, as lam and the partners are (so a seed gives the same
    mix on every device): with the default CPU generator, two tensors of the map's size are drawn on the
    host and copied at every mix, which on a GPU costs far more than the mix (22.5x a Manifold Mixup step
    of PreActResNet-18 at batch 128 on an H200).

    ``.last.info`` holds the batch's noise levels ``"mult_level"`` (``mult_noise * b2``) and
    ``"add_level"`` (``add_noise * b1``) where they were drawn.

    Args:
        layer, alpha, prob, generator, mode, batch_dim, padding: as :class:`ManifoldMixup` (alpha defaults
            to the paper's 1.0).
        add_noise: the additive noise level, >= 0 (paper: 0.4).
        mult_noise: the multiplicative noise level, >= 0 (paper: 0.2).
    """

    draws_in_mix = True  # its noise levels and noise

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 1.0,
        add_noise: float = 0.4,
        mult_noise: float = 0.2,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        mode: str = "batch",
        batch_dim: int | dict | None = None,
        padding: str = "union",
    ):
        super().__init__(layer, alpha, prob, generator, mode, batch_dim, padding)
        self.add_noise = check_non_negative("add_noise", add_noise)
        self.mult_noise = check_non_negative("mult_noise", mult_noise)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, add_noise={self.add_noise}, mult_noise={self.mult_noise})"

    def _noise(self, leaves: list[Leaf], draw: Draw) -> tuple[dict, dict, dict]:
        """The noise of one mix, drawn as the paper's code draws it (the levels once per batch, the noise
        per element; all multiplicative noise first): per leaf path, the float64 factor and the float64
        term on the generator's device, and the levels for ``info``."""
        g, factors, terms, info = draw.generator, {}, {}, {}
        if self.mult_noise > 0:
            level = self.mult_noise * sample_beta(2.0, 5.0, g)
            info["mult_level"] = level
            for leaf in leaves:
                uniform = torch.rand(leaf.tensor.shape, generator=g, device=g.device, dtype=torch.float64)
                factors[leaf.path] = 1 + level * (2 * uniform - 1)
        if self.add_noise > 0:
            level = self.add_noise * sample_beta(2.0, 5.0, g)
            info["add_level"] = level
            for leaf in leaves:
                normal = torch.randn(leaf.tensor.shape, generator=g, device=g.device, dtype=torch.float64)
                terms[leaf.path] = level * normal
        return factors, terms, info

    @staticmethod
    def _noisy(m: torch.Tensor, factor: torch.Tensor | None, term: torch.Tensor | None) -> torch.Tensor:
        if factor is not None:
            m = m * to_device(factor, m.device, m.dtype)
        return m if term is None else m + to_device(term, m.device, m.dtype)

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        mixed = super().mix(leaves, draw)
        factors, terms, info = self._noise(leaves, draw)
        tensors = {p: self._noisy(m, factors.get(p), terms.get(p)) for p, m in mixed.tensors.items()}
        return Mixed(tensors, lam=mixed.lam, info=info)

    def traced_params(self, n: int, leaves: list[Leaf]) -> list:
        noise = [(tuple(leaf.tensor.shape), torch.float64) for leaf in leaves]
        return [*super().traced_params(n, leaves), *(noise if self.mult_noise > 0 else []),
                *(noise if self.add_noise > 0 else [])]  # fmt: skip

    def draw_traced(self, leaves: list[Leaf], draw: Draw) -> tuple[list[torch.Tensor], Mixed]:
        values, mixed = super().draw_traced(leaves, draw)
        factors, terms, info = self._noise(leaves, draw)
        noise = [factors[leaf.path] for leaf in leaves if factors] + [
            terms[leaf.path] for leaf in leaves if terms
        ]
        return [*values, *noise], Mixed({}, mixed.lam, info)

    def mix_traced(self, leaves: list[Leaf], values: list[torch.Tensor]) -> dict:
        tensors = super().mix_traced(leaves, values[:2])
        noise, k = values[2:], len(leaves)
        factors = (
            dict(zip((leaf.path for leaf in leaves), noise[:k], strict=True)) if self.mult_noise > 0 else {}
        )
        terms = (
            dict(zip((leaf.path for leaf in leaves), noise[-k:], strict=True)) if self.add_noise > 0 else {}
        )
        return {p: self._noisy(m, factors.get(p), terms.get(p)) for p, m in tensors.items()}

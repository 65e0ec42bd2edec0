"""PatchUp: mix DropBlock-style blocks of a feature map with another sample's.

Paper: Faramarzi, Amini, Badrinaaraayanan, Verma, Chandar. "PatchUp: A Feature-Space Block-Level
Regularization Technique for Convolutional Neural Networks." AAAI 2022. https://arxiv.org/abs/2006.07794
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..engine.card import Card
from ..engine.checks import check_fraction, check_region, map_size
from ..engine.contract import Draw, Mixed
from ..engine.regions import RegionMixer
from ..functional import blend, gather_rows, lerp_rows
from ..sites import Leaf
from ..transfer import to_device

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def block_mask(
    channels: int,
    height: int,
    width: int | None,
    block_size: int,
    gamma: float,
    generator: torch.Generator,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """PatchUp's block mask ``(C, H, W)``: 1 inside the altered blocks, 0 elsewhere (float64).

    As the paper's code: block centres are Bernoulli draws with DropBlock's adjusted rate
    ``gamma * H * W / (block_size**2 * (H - block_size + 1) * (W - block_size + 1))`` over every feature
    of one sample's map, grown to ``block_size`` squares by a stride-1 max pool; the batch shares it.
    With ``shape`` (1 or 3 sizes; ``height`` and ``width`` ignored) the same over a 1-D or 3-D map:
    segments or cubes of side ``block_size``, the rate ``gamma * prod(size) / (block_size**d *
    prod(size - block_size + 1))``, a mask ``(C, *shape)``.
    """
    shape = (height, width) if shape is None else tuple(shape)
    dims = len(shape)
    rate = gamma * math.prod(shape) / (block_size**dims * math.prod(s - block_size + 1 for s in shape))
    probs = torch.full((1, channels, *shape), min(rate, 1.0), dtype=torch.float64, device=generator.device)
    centres = torch.bernoulli(probs, generator=generator)
    return _MAX_POOL[dims](centres, block_size, stride=1, padding=block_size // 2)[0]


class PatchUp(RegionMixer):
    """PatchUp (Faramarzi et al. 2022) at any layer whose output is ``(B, C, H, W)`` (or a 1-D ``(B, C, L)``
    or 3-D ``(B, C, D, H, W)`` map: segments or cubes of side ``block_size``, :func:`block_mask`).

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``, a block mask
    ``M`` (:func:`block_mask`), ``lam ~ Beta(alpha, alpha)`` and a permutation ``index``. With ``p`` the
    fraction of features inside the blocks (``M.mean()``):

    - ``mode="hard"``: ``h' = (1 - M) * h + M * h[index]``; the target weight is ``1 - p`` for the
      sample's own label and ``p`` for ``index``'s.
    - ``mode="soft"``: ``h' = (1 - M) * h + M * (lam * h + (1 - lam) * h[index])``; the own label keeps
      ``1 - p * (1 - lam)``.

    The kept fraction keeps its label, as in the paper's ``target_reweighted``; ``.last.lam`` is that
    weight and ``.last.info["mask"]`` the mask, and ``loss``/``targets`` use them.

    Args:
        layer: a name, ``"input"`` or a list (one drawn per batch); each must output a map (see above)
            with every side >= ``block_size``.
        block_size: odd side of the square blocks (paper: 7).
        gamma: the probability of altering a feature, in [0, 1] (paper: 0.5 hard, 0.75 soft).
        mode: ``"soft"`` or ``"hard"``.
        alpha: Beta concentration for soft PatchUp's lam (the paper's code: 2.0).
        prob: probability that a batch is mixed, in [0, 1].
        generator, batch_dim, padding: as :class:`~mixhook.ManifoldMixup`.
        layout, tokens, prefix: as :class:`~mixhook.engine.regions.RegionMixer` (maps in any layout, a
            ViT's tokens as maps).

    The layer (or the selected element) must give one map; ``.last.elements`` names it. ``pin`` also
    takes ``mask`` (a ``(C, H, W)`` 0/1 tensor; ``(C, L)``, ``(C, D, H, W)``); a pinned ``lam`` is soft
    mode's lam.
    """

    card = Card(
        paper="Faramarzi et al. 2022",
        mixes="DropBlock patches swapped or blended",
        where="any map, ViT tokens",
        family="region",
        traits=("tokens",),
        signature='PatchUp(layer, block_size=7, gamma=0.5, mode="soft")',
        hook="forward, `(B,C,H,W)` outputs (or `(B,C,L)`, `(B,C,D,H,W)`) or ViT tokens",
        commands="`mixup=patchup`",
        details=(
            "DropBlock mask `M`: hard `h' = (1-M)h + M h[index]`, own label keeps `1-p`; soft `h' = (1-M)h + "
            'M(lam h + (1-lam) h[index])`, keeps `1-p(1-lam)`; `p = mean(M)`; `.last.info["mask"]`'
        ),
        example={"layer": "conv1", "block_size": 3},
        drawn={"block_size": 5, "gamma": 0.5},
    )

    pin_keys = ("mask",)
    region_dims = (1, 2, 3)

    def __init__(
        self,
        layer: str | Sequence[str],
        block_size: int = 7,
        gamma: float = 0.5,
        mode: str = "soft",
        alpha: float = 2.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout, tokens, prefix)
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, int)
            or block_size < 1
            or block_size % 2 == 0
        ):
            raise ValueError(f"block_size must be an odd positive integer, got {block_size!r}")
        if mode not in ("soft", "hard"):
            raise ValueError(f"mode must be 'soft' or 'hard', got {mode!r}")
        self.block_size = block_size
        self.gamma = check_fraction("gamma", gamma)
        self.mode = mode

    def __repr__(self) -> str:
        extra = f"block_size={self.block_size}, gamma={self.gamma}, mode={self.mode!r}"
        return f"{super().__repr__()[:-1]}, {extra})"

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        h = check_region("PatchUp", spec, leaves, self.region_dims)
        if min(h.shape[2:]) < self.block_size:
            raise ValueError(
                f"PatchUp block_size={self.block_size} is larger than the {map_size(h)} feature map of layer "
                f"{spec!r}; use a smaller block_size or an earlier layer"
            )

    def _patches(self, h: torch.Tensor, draw: Draw) -> tuple[torch.Tensor, Mixed]:
        """The ``(C, H, W)`` float64 block mask of one mix of ``h`` (pinned, or drawn) and what ``loss``
        and ``targets`` use (no tensors)."""
        channels, shape = h.shape[1], tuple(h.shape[2:])
        mask = draw.pinned.get("mask")
        if mask is None:
            mask = block_mask(channels, 0, 0, self.block_size, self.gamma, draw.generator, shape=shape)
        else:
            mask = torch.as_tensor(mask, dtype=torch.float64)
            if tuple(mask.shape) != (channels, *shape):
                raise ValueError(
                    f"pinned mask of shape {tuple(mask.shape)} does not fit {tuple(h.shape[1:])}"
                )
        altered = float(mask.mean())
        share = 1.0 if self.mode == "hard" else 1.0 - float(draw.lam)  # of an altered feature, the partner's
        weights = 1.0 - mask.mean(0, keepdim=True) * share  # each position's own share, over the channels
        lam = torch.tensor(1.0 - altered * share, dtype=torch.float64)
        return mask, Mixed({}, lam=lam, info={"mask": mask}, weights=weights)

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        mask, mixed = self._patches(h, draw)
        m = to_device(mask, h.device, h.dtype)
        # (h first: a product's layout is its first operand's, and a channels-last map stays channels-last)
        if self.mode == "hard":
            out = h * (1 - m) + h[to_device(draw.index, h.device)] * m
        else:
            out = h * (1 - m) + blend(h, draw.weight, draw.index, permutation=draw.permutation) * m
        return Mixed({path: out}, mixed.lam, mixed.info, weights=mixed.weights)

    def traced_params(self, n: int, leaves: list[Leaf]) -> list:
        mask = (tuple(leaves[0].tensor.shape[1:]), torch.float64)
        return [((n,), torch.int64), mask, ((n,), torch.float64)]  # the index, the block mask, lam per sample

    def draw_traced(self, leaves: list[Leaf], draw: Draw) -> tuple[list[torch.Tensor], Mixed]:
        mask, mixed = self._patches(leaves[0].tensor, draw)
        n = draw.index.shape[0]
        return [draw.index, mask, draw.lam.expand(n) if draw.lam.ndim == 0 else draw.lam], mixed

    def mix_traced(self, leaves: list[Leaf], values: list[torch.Tensor]) -> dict:
        index, mask, lam = values
        h = leaves[0].tensor
        m = mask.to(h.dtype)
        partner = gather_rows(h, index) if self.mode == "hard" else lerp_rows(h, lam, index)
        return {leaves[0].path: h * (1 - m) + partner * m}

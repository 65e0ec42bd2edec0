"""Manifold Mixup and input mixup: the blend ``lam * h + (1 - lam) * h[index]`` at any layer.

Papers:
    - Zhang, Cisse, Dauphin, Lopez-Paz. "mixup: Beyond Empirical Risk Minimization." ICLR 2018.
      https://arxiv.org/abs/1710.09412 (mixing at the input)
    - Verma, Lamb, Beckham, Najafi, Mitliagkas, Lopez-Paz, Bengio. "Manifold Mixup: Better
      Representations by Interpolating Hidden States." ICML 2019. https://arxiv.org/abs/1806.05236
      (mixing at a hidden layer drawn per batch)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine import partners
from ..engine.card import Card
from ..engine.contract import Draw, Mixed
from ..engine.forward import Forward
from ..engine.mixer import Mixer
from ..engine.partners import check_partners, world
from ..functional import along, blend, lerp_rows, per_sample, sample_beta, sample_lam
from ..hooks import Planned
from ..sites import Leaf
from ..transfer import to_device


class ManifoldMixup(Mixer):
    """Manifold Mixup (Verma et al. 2019) at any named layer of any model, through forward hooks.

    On each forward in training mode (``model.training``), with probability ``prob``: one layer is drawn
    uniformly from ``layer``, ``lam ~ Beta(alpha, alpha)`` and a uniformly random permutation ``index``
    of the batch are drawn, and that layer's output ``h`` is replaced by
    ``lam * h + (1 - lam) * h[index]``. ``layer="input"`` mixes the model's input (its first positional
    argument): classic input mixup (Zhang et al. 2018). Gradients flow through ``h`` and ``h[index]``
    exactly as in a hand-edited ``forward()``. In eval mode nothing is mixed.

    Train with :meth:`loss` (the mixed criterion) or :meth:`targets` (mixed soft targets)::

        mix = ManifoldMixup(["input", "layer1", "layer2"], alpha=2.0)
        with mix.attach(model):
            logits = model(x)
            loss = mix.loss(F.cross_entropy, logits, y)

    Args:
        layer: a module name as ``model.named_modules()`` spells it, ``"input"``, or a list of names
            (one is drawn per training batch).
        alpha: the Beta distribution's concentration, > 0 (the paper uses 2.0; input mixup 1.0).
        prob: the probability that a training batch is mixed at all, in [0, 1].
        mode: ``"batch"`` (one lam for the batch, as in the papers), ``"elem"`` (one lam per sample,
            timm's elem mode; ``loss`` then needs a per-sample criterion, ``reduction="none"``) or
            ``"pair"`` (timm's pair mode: sample ``i`` and sample ``B - 1 - i`` mix with each other
            under one lam per pair, so each pair yields two mixes of the same two samples; an odd
            batch's middle sample is its own partner and stays as it is, with its own label; per-sample
            criterion as for ``"elem"``). timm draws each sample's or pair's mixing with ``mix_prob``;
            here ``prob`` decides for the whole batch.
        generator: the ``torch.Generator`` every draw comes from. By default a CPU generator seeded from
            ``torch.initial_seed()``, so ``torch.manual_seed(s)`` makes the draws reproducible without
            consuming the global random stream.
        batch_dim: where mixhook cannot find the batch dimension itself (see :mod:`mixhook.sites`): an
            int, or a dict from layer spec to int.
        padding: ``"union"`` (default): downstream of the mixed layer, every module that takes a padding
            mask (``attention_mask``, ``key_padding_mask``, ...) gets the union of the two partners'
            masks, so a mixed sample attends to the positions that are real in either; ``"keep"``:
            masks are left as they are.
        dominant: draw ``lam ← max(lam, 1 - lam)``, so that each sample's own label dominates its mix,
            as fastai's ``MixUp`` and ``ManifoldMixup`` callbacks (with ``mode="elem"``) do; a pinned lam
            is used as given.
        partners: ``"local"`` (default): partners from this process's batch; ``"global"``: from the
            batches of every rank of a data-parallel job, as if one process mixed the global batch
            (:mod:`mixhook.engine.partners`; ``.last.index`` then indexes the global batch, and ``loss``
            and ``targets`` gather the labels from every rank).

    A layer's output is mixed as a whole: every tensor in it that carries the batch, each along its
    own batch dimension, with one lam and one permutation; a selector (``"lstm[1.0]"``) restricts it.
    A layer called several times in one forward is mixed at its first call only.
    """

    card = Card(
        paper="Verma et al. 2019; Zhang et al. 2018",
        mixes="blends two samples: `lam·h + (1-lam)·h[index]`",
        where="input, any layer",
        family="blend",
        signature='ManifoldMixup(layer, alpha=2.0, prob=1.0, mode="batch", partners="local", dominant=False)',
        hook="forward (pre-hook at `input`)",
        commands="`mixup=manifold`, `mixup=input`",
        details=(
            '`h\' = lam*h + (1-lam)*h[index]`, lam ~ Beta(alpha, alpha); `mode="elem"`: one lam per sample; '
            "`mode=\"pair\"`: timm's pair mode (`i` ↔ `B-1-i`, one lam per pair, equal to timm's "
            '`Mixup(mode="pair")` on the same lam); `dominant=True`: lam ← max(lam, 1-lam), fastai\'s '
            'MixUp/ManifoldMixup (with `mode="elem"`, equal to fastai\'s draw; '
            "`layer=mixhook.fastai_layers(model)` is fastai's default layer choice, alpha 0.4 its default); "
            '`partners="global"`: `index` over every rank\'s batch (see DDP)'
        ),
        workflows="all + TRL",
        example={"layer": ["input", "conv1"], "alpha": 1.0},
    )

    layout_aware = False  # the blend treats every element alike: any layout
    partners = Planned()  # (whether mix() draws and the ranks agree are worked out at attach)

    @property
    def draws_in_mix(self) -> bool:
        """Whether :meth:`mix` draws from the generator itself (see :attr:`Mixer.draws_in_mix`), which it does
        only with partners from the global batch (rank 0's permutation of it); else lam and the index are
        all it draws."""
        return self.partners == "global"

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 2.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        mode: str = "batch",
        batch_dim: int | dict | None = None,
        padding: str = "union",
        partners: str = "local",
        dominant: bool = False,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding)
        if not isinstance(dominant, bool):
            raise TypeError(f"dominant must be True or False, got {dominant!r}")
        self.dominant = dominant
        if mode not in ("batch", "elem", "pair"):
            raise ValueError(f"mode must be 'batch', 'elem' or 'pair', got {mode!r}")
        self.mode = mode
        self.partners = check_partners(partners)
        if mode == "pair" and self.partners == "global":
            raise ValueError("mode='pair' pairs samples within this process's batch; use partners='local'")

    def __repr__(self) -> str:
        base = super().__repr__()
        base = base if self.mode == "batch" else f"{base[:-1]}, mode={self.mode!r})"
        base = base if self.partners == "local" else f"{base[:-1]}, partners={self.partners!r})"
        return f"{base[:-1]}, dominant=True)" if self.dominant else base

    def partner_pool(self, n: int) -> int:
        return n if self.partners == "local" else n * world(type(self).__name__)[0]

    def agree(self, draw: Forward | None) -> Forward | None:
        """With partners from the global batch, every rank follows rank 0's decision (whether to mix and
        where): the all-gather at the mixed layer must run on all ranks at once."""
        if self.partners == "local":
            return draw
        world(type(self).__name__)
        mine = [0, 0] if draw is None else [1, self.layers.index(draw.layer)]
        mixes, k = partners.broadcast(torch.tensor(mine, dtype=torch.int64)).tolist()
        if not mixes:
            return None
        if draw is None:
            return Forward(self.layers[k])
        draw.layer = self.layers[k]
        return draw

    def draw_index(self, n: int, generator: torch.Generator) -> torch.Tensor:
        if self.mode == "pair":  # timm's _mix_pair: j = B - i - 1
            return torch.arange(n - 1, -1, -1, device=generator.device)
        # (Mixer.draw_index's own line: a permutation of the batch)
        return torch.randperm(n, generator=generator, device=generator.device)

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        if self.mode == "batch" and not self.dominant:  # (the usual draw, first)
            return sample_lam(self.alpha, generator)
        if self.mode == "elem":
            lam = sample_beta(self.alpha, self.alpha, generator, size=n)
        elif self.mode == "pair":  # one lam per pair, the same for both of its samples (timm's _mix_pair)
            half = sample_beta(self.alpha, self.alpha, generator, size=(n + 1) // 2)
            lam = torch.cat([half, half[: n // 2].flip(0)])
        else:
            lam = sample_lam(self.alpha, generator)
        return torch.maximum(lam, 1 - lam) if self.dominant else lam

    @property
    def traceable(self) -> bool:  # partners from the global batch gather them in the forward
        return super().traceable and self.partners == "local"

    def _target_lam(self, draw: Draw) -> torch.Tensor | None:
        """A pinned number in a per-sample mode: the same for every sample (``None``: the drawn lam as it
        is)."""
        return draw.lam.expand(draw.index.shape[0]) if self.mode != "batch" and draw.lam.ndim == 0 else None

    def traced_params(self, n: int, leaves: list[Leaf]) -> list:
        return [((n,), torch.float64), ((n,), torch.int64)]  # lam per sample (one lam: repeated), index

    def draw_traced(self, leaves: list[Leaf], draw: Draw) -> tuple[list[torch.Tensor], Mixed]:
        lam = draw.lam.expand(draw.index.shape[0]) if draw.lam.ndim == 0 else draw.lam
        return [lam, draw.index], Mixed({}, self._target_lam(draw))

    def mix_traced(self, leaves: list[Leaf], values: list[torch.Tensor]) -> dict:
        lam, index = values

        def mixed(h: torch.Tensor) -> torch.Tensor:
            return lerp_rows(h, lam, index, one=self.mode == "batch")

        return {leaf.path: along(leaf.dim, mixed, leaf.tensor) for leaf in leaves}

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        lam = None if self.mode == "batch" else self._target_lam(draw)
        if self.partners == "global":
            return self._mix_global(leaves, draw, draw.lam if lam is None else lam)
        weight, index, permutation = draw.weight, draw.index, draw.permutation
        tensors = {}
        for leaf in leaves:  # lam * h + (1 - lam) * h[index], each along its batch dimension
            tensors[leaf.path] = blend(leaf.tensor, weight, index, permutation=permutation, dim=leaf.dim)
        return Mixed(tensors, lam=lam)

    def _mix_global(self, leaves: list[Leaf], draw: Draw, lam: torch.Tensor) -> Mixed:
        """Partners from every rank's batch: rank 0's permutation of the global batch (or the pinned
        global index), the layer's output gathered from all ranks (gradients go back to each partner's
        rank)."""
        size, rank = world(type(self).__name__)
        n = leaves[0].tensor.shape[leaves[0].dim]
        index = draw.index if "index" in draw.pinned else partners.global_index(n, draw.generator)

        def mixed(h: torch.Tensor) -> torch.Tensor:
            partner = partners.gather(h)[to_device(index, h.device)]
            return torch.lerp(partner, h, per_sample(lam, h))

        tensors = {leaf.path: along(leaf.dim, mixed, leaf.tensor) for leaf in leaves}
        info = {"partners": "global", "world": size, "rank": rank}
        return Mixed(tensors, lam=lam, info=info, index=index)

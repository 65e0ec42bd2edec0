"""AdAutoMix: AutoMix whose Mix Block, every other step, makes mixes the momentum copy finds hard.

Paper: Qin, Fang, Liu, Li, Li, Wang, Yu, Wu. "Adversarial AutoMixup." ICLR 2024.
https://arxiv.org/abs/2312.11954. The code: JinXins/Adversarial-AutoMixup,
``openmixup/models/classifiers/AdAutoMix.py`` (``AdAutoMix.forward_train``, ``mixup``, ``forward_k``,
``forward_q``) and ``openmixup/models/heads/Ada_mix_pine.py`` (``AdaptiveMask``, the generator), with the
values of ``configs/classification/cub200/adautomix/basic/r18_adautomix_bilinear.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.card import Card
from ..engine.checks import check_fraction
from ..engine.contract import Draw, Mixed, MixState
from ..transfer import to_device
from .automix import AutoMix
from .mixblock import UPSAMPLING


class AdaptiveMask(nn.Module):
    """AdAutoMix's generator (the authors' ``AdaptiveMask``): the share of each of ``N`` samples at each
    position, from a cross attention between each sample's features and the others'.

    For the features ``f_i`` ``(B, C, h, w)`` of the ``N`` samples mixed (each with its lam ``l_i`` as one
    more channel, ``lam_concat``): the query ``q_i`` and key ``k_i`` are 1x1 convolutions to ``C //
    reduction`` channels followed by ReLU (mmcv's ``ConvModule`` without norm), the value ``v_i`` a 1x1
    convolution to one channel; sample ``i``'s logit at each position is ``softmax(q_i (sum_{j != i} k_j) /
    sqrt(C // reduction)) v_i``; the ``N`` logits are upsampled to the mixed map's size and a softmax over
    the ``N`` gives the shares (they sum to one at every position). Two samples: the sample ``x`` with lam,
    its partner ``x[index]`` with ``1 - lam``.

    Initialised as the authors' ``init_weights(init_linear='normal')``: every convolution ``N(0, 0.01)``
    with zero bias. Computed in the features' dtype promoted to at least float32 (the authors: float32).
    Where the authors' attention overflows to ``inf`` or its mask is NaN they clamp or replace it with
    constants; here a non-finite loss is the trainer's to refuse (the app says so in one line).

    Args:
        channels: the features' channels ``C``.
        reduction: the query and key have ``C // reduction`` channels (at least 1); the authors': 2.
        use_scale: divide the attention logits by ``sqrt(C // reduction)``.
        lam_concat: each sample's lam as one more channel of its features.
        upsampling: a mode, or a list of modes (one drawn per call where several), among nearest, bilinear,
            bicubic (the authors' ``'None'`` draws one once, at the first call, and keeps it).
    """

    def __init__(
        self,
        channels: int,
        reduction: int = 2,
        use_scale: bool = True,
        lam_concat: bool = True,
        upsampling: str | Sequence[str] = "nearest",
    ):
        super().__init__()
        if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
            raise ValueError(f"AdaptiveMask: channels must be an integer >= 1, got {channels!r}")
        if isinstance(reduction, bool) or not isinstance(reduction, int) or reduction < 1:
            raise ValueError(f"AdaptiveMask: reduction must be an integer >= 1, got {reduction!r}")
        self.upsampling = (upsampling,) if isinstance(upsampling, str) else tuple(upsampling)
        if not self.upsampling or any(m not in UPSAMPLING for m in self.upsampling):
            raise ValueError(
                f"AdaptiveMask: upsampling must be among {', '.join(UPSAMPLING)}, got {upsampling!r}"
            )
        self.lam_mul_k = (-1.0,)  # (AutoMix's per-call choices: no lam rescaling here)
        self.channels, self.reduction = channels, reduction
        self.use_scale, self.lam_concat = bool(use_scale), bool(lam_concat)
        self.inter = max(channels // reduction, 1)
        qk_in = channels + 1 if self.lam_concat else channels
        self.query = nn.Conv2d(qk_in, self.inter, 1)
        self.key = nn.Conv2d(qk_in, self.inter, 1)
        self.value = nn.Conv2d(qk_in, 1, 1)
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """The authors' initialisation, its normal draws from ``generator`` (``None``: torch's global one)."""
        for m in (self.query, self.key, self.value):
            with torch.no_grad():
                device = None if generator is None else generator.device
                m.weight.copy_(torch.randn(m.weight.shape, generator=generator, device=device) * 0.01)
                nn.init.zeros_(m.bias)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, reduction={self.reduction}, upsampling={self.upsampling}"

    def shares(self, maps: Sequence[torch.Tensor], lams: Sequence[float], size, upsampling=None):
        """The ``N`` samples' shares ``(B, N, *size)`` (summing to one) for their features ``maps`` and
        lams ``lams``."""
        n, _, h, w = maps[0].shape
        work = torch.promote_types(maps[0].dtype, torch.float32)
        if self.lam_concat:
            maps = [
                torch.cat([f, torch.full((n, 1, h, w), float(lam), dtype=f.dtype, device=f.device)], 1)
                for f, lam in zip(maps, lams, strict=True)
            ]
        q = [F.relu(self.query(f)).view(n, self.inter, -1).permute(0, 2, 1).to(work) for f in maps]
        k = [F.relu(self.key(f)).view(n, self.inter, -1).to(work) for f in maps]
        logits = []
        for i, f in enumerate(maps):
            others = sum(k[j] for j in range(len(maps)) if j != i)
            weight = torch.matmul(q[i], others)  # (the sum of q_i k_j over j != i)
            if self.use_scale:
                weight = weight / self.inter**0.5
            v = self.value(f).view(n, 1, -1).permute(0, 2, 1).to(work)  # (B, hw, 1)
            logits.append(torch.matmul(weight.softmax(dim=-1), v).view(n, 1, h, w))
        logit = F.interpolate(torch.cat(logits, 1), size=tuple(size), mode=upsampling or self.upsampling[0])
        return logit.softmax(dim=1)

    def forward(
        self,
        x: torch.Tensor,
        lam: float,
        index: torch.Tensor,
        size: tuple[int, int],
        upsampling: str | None = None,
        lam_k: float | None = None,
    ) -> torch.Tensor:
        """The partner's share ``(B, 1, *size)`` of two samples' mix (AutoMix's Mix Block's call): ``x`` with
        ``lam``, ``x[index]`` with ``1 - lam`` (``lam_k`` is not used)."""
        return self.shares([x, x[index]], [lam, 1 - lam], size, upsampling)[:, 1:]


class AdAutoMix(AutoMix):
    """AdAutoMix (Qin et al. 2024): AutoMix with the authors' generator and an adversarial Mix Block.

    Each training forward is AutoMix's (:class:`~mixhook.AutoMix`): the momentum copy ``k`` gives
    ``features`` on the clean batch; the generator (:class:`AdaptiveMask`) makes the masks of two draws, the
    Mix Block's (``lam_mb``, ``index_mb``: ``k`` runs on it, gradients into the generator) and the model's
    (``lam``, ``index``: mask without gradient, plain mixup where lam is within ``lam_margin`` of 0 or 1);
    the model trains on its mix and on the clean batch beside it. What differs:

    - the generator: the two samples' shares from a softmax over their two logits (each from the
      attention of its features with the other's), where AutoMix's Mix Block gives one logit and a sigmoid;
    - the Mix Block's loss, on every ``adversarial_every``-th training forward (the first, the third, ...
      with the authors' 2): ``-beta * l_mix(k) + (1 - beta) * cos``, where ``cos`` is the mean over the
      batch of ``lam_mb * cos(k(mix), k(x)) + (1 - lam_mb) * cos(k(mix), k(x[index_mb]))``, the cosine
      similarity of the copy's logits on the mix with its logits on the two samples (``k``'s whole clean
      forward runs on those steps; ``k(x[index_mb])`` is ``k(x)``'s rows ``index_mb``: batch norm's
      statistics do not change under a permutation); on the other forwards ``l_mix(k)`` as AutoMix's;
    - no mask loss: the shares sum to one by construction.

    :meth:`loss` is the authors' ``forward_train``: ``clean_weight * l(clean) + l_mix(model) + block_weight
    * (the Mix Block's term)``; the forwards are counted (:attr:`iteration`, kept by ``state_dict``) so a
    resumed run keeps the alternation. ``pin(adversarial=True)`` chooses a forward's term.

    Where mixhook differs from the authors' code, and why: as AutoMix (one classifier for their two heads;
    the clean rows beside the mixed ones in one forward, batch norm after the mix normalising the two
    halves apart; ``k`` stops at ``features`` where its logits are not needed; the momentum update at the
    first training forward after an optimizer step); and the three-sample mix (the authors' ``mix_samples=3``,
    which also trains the model on a third forward of a plain three-way mixup) is not built: ``mix_samples``
    is 2 (refused otherwise, in one line).

    Args:
        layer, features, channels, momentum, end_momentum, momentum_scope, total_steps, lam_margin,
            clean_weight, block_weight, reduction, upsampling, block_lr, block_momentum, generator, batch_dim,
            padding, layout, feature_tokens: as :class:`~mixhook.AutoMix` (the defaults: the authors' CUB
            config's alpha 1, lam_margin 0.03, end_momentum 0.99999; CIFAR's nearest upsampling).
        beta: the Mix Block's mixed loss's weight in its adversarial term (the authors' ``beta_radio``, 0.3).
        adversarial_every: the adversarial term on one training forward of this many (2); 0: never (the
            Mix Block then minimises ``k``'s mixed loss, AutoMix's without its mask loss).
        mix_samples: the samples in each mix; 2.
    """

    card = Card(
        paper="Qin et al. 2024",
        mixes="AutoMix with the authors' generator; every other step, mixes made hard for the copy",
        where="as AutoMix",
        family="learned",
        signature=(
            'AdAutoMix(layer="input", features="layer3", alpha=1.0, beta=0.3, adversarial_every=2, '
            "lam_margin=0.03, end_momentum=0.99999, ...)"
        ),
        hook="as AutoMix (+ the copy's whole clean forward on adversarial steps)",
        commands="`mixup=adautomix`",
        details=(
            "AutoMix's forward (a momentum copy `k` gives `features`; two draws, the Mix Block's and the "
            "model's; the model trains on its mix and the clean batch) with the authors' generator "
            "(`AdaptiveMask`: each sample's logit from the attention of its features, lam concatenated, with "
            "the other's keys; a softmax over the two gives the shares) and their Mix Block loss: on every "
            "other training forward `-beta·l_mix(k) + (1-beta)·cos` (cos: the lam-weighted cosine similarity "
            "of `k`'s logits on the mix with its logits on the two samples), on the others `l_mix(k)`; no "
            "mask loss. Equal to the authors' `AdAutoMix.forward_train` (JinXins/Adversarial-AutoMixup) on "
            "the same draws, loss and every gradient, both kinds of step. The authors' three-sample mix "
            "(`mix_samples=3`, with its third forward of a plain three-way mixup) is not built: refused in "
            "one line. OpenMixup's port differs from the authors' code on that path (its `lam_margin` "
            "test reads `< 1 - lam` where theirs reads `> 1 - lam`, so its three-sample model nearly always "
            "trains on plain mixup); with two samples the two agree"
        ),
        example={"layer": "input", "features": "conv1"},
        drawn={"features": "features", "note": "\n(the generator as initialised)"},
    )

    pin_keys = ("lam_mb", "index_mb", "adversarial")
    block_type = AdaptiveMask

    def __init__(
        self,
        layer: str | Sequence[str] = "input",
        features: str = "layer3",
        channels: int | None = None,
        alpha: float = 1.0,
        beta: float = 0.3,
        adversarial_every: int = 2,
        mix_samples: int = 2,
        momentum: float = 0.999,
        end_momentum: float = 0.99999,
        momentum_scope: tuple[float, float] = (0.1, 1.0),
        total_steps: int | None = None,
        lam_margin: float = 0.03,
        clean_weight: float = 1.0,
        block_weight: float = 1.0,
        reduction: int = 2,
        upsampling: str | Sequence[str] = "nearest",
        block_lr: float | None = None,
        block_momentum: float | None = None,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        layout: str | dict | None = None,
        feature_tokens: tuple[int, int] | str | None = None,
    ):
        kind = type(self).__name__
        if mix_samples != 2 or isinstance(mix_samples, bool):
            raise ValueError(
                f"{kind}: mix_samples must be 2, got {mix_samples!r} (the authors' three-sample mix, with "
                "its third forward of a plain three-way mixup, is not built)"
            )
        every = adversarial_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"{kind}: adversarial_every must be an integer >= 0, got {adversarial_every!r}")
        super().__init__(
            layer, features, channels, alpha, momentum, end_momentum, momentum_scope, total_steps,
            mask_loss=0.0, lam_margin=lam_margin, clean_weight=clean_weight, block_weight=block_weight,
            reduction=reduction, upsampling=upsampling, block_lr=block_lr, block_momentum=block_momentum,
            generator=generator, batch_dim=batch_dim, padding=padding, layout=layout,
            feature_tokens=feature_tokens,
        )  # fmt: skip
        self.beta = check_fraction("beta", beta)
        self.adversarial_every, self.mix_samples = adversarial_every, mix_samples
        self.iteration = 0  # the training forwards counted so far (the authors' self.iter)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", beta={self.beta}, adversarial_every={self.adversarial_every})"

    # ------------------------------------------------------------------- the copy's pass, the turn

    def copy_pass(self, k: nn.Module, args: tuple, kwargs: dict, pinned: Mapping) -> tuple:
        """The features, and whether this forward's Mix Block term is adversarial (pinned, or this forward's
        turn: the authors' ``iter % 2 == 0``); on an adversarial forward ``k``'s whole clean forward runs
        and its logits are kept (the cosine term's)."""
        adversarial = pinned.get("adversarial")
        if adversarial is None:
            every = self.adversarial_every
            adversarial = bool(every) and self.iteration % every == 0
            self.iteration += 1
        adversarial = bool(adversarial)
        features, out = self._features(k, args, kwargs, whole=adversarial)
        clean = self._logits_of(out, "the cosine term") if adversarial else None
        return features, {"adversarial": adversarial, "k_clean": clean}

    def mix(self, leaves, draw: Draw) -> Mixed:
        mixed = super().mix(leaves, draw)
        mixed.info["adversarial"] = draw.pinned["adversarial"]
        mixed.info["k_clean"] = draw.pinned["k_clean"]
        return mixed

    # ------------------------------------------------------------------------------------ the loss

    def block_loss(self, criterion: Callable, target: torch.Tensor, last: MixState) -> torch.Tensor | float:
        """The Mix Block's term: ``block_weight * (-beta * l_mix(k) + (1 - beta) * cos)`` on an adversarial
        forward (the cosine term per sample where the criterion gives one loss per sample), ``block_weight
        * l_mix(k)`` on the others."""
        if self.block_weight == 0:
            return 0.0
        block_logits, _, lam_mb, index_mb = last.info["block"]
        loss = self.copy_mixed_loss(criterion, block_logits, target, lam_mb, index_mb)
        if last.info["adversarial"]:
            clean = last.info["k_clean"]
            partners = clean[to_device(index_mb, clean.device)]
            cos = lam_mb * F.cosine_similarity(block_logits, clean, dim=-1) + (1 - lam_mb) * (
                F.cosine_similarity(block_logits, partners, dim=-1)
            )
            loss = -self.beta * loss + (1 - self.beta) * (cos if loss.ndim else cos.mean())
        return self.block_weight * loss

    # ---------------------------------------------------------------------------------- the state

    def state_dict(self) -> dict:
        """AutoMix's, and the training forwards counted (the adversarial turn)."""
        return {**super().state_dict(), "iteration": self.iteration}

    def load_state_dict(self, state: Mapping) -> None:
        self.iteration = int(state.get("iteration", 0))
        super().load_state_dict(state)

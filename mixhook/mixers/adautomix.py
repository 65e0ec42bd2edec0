"""AdAutoMix: AutoMix whose Mix Block, every other step, makes mixes the momentum copy finds hard.

Paper: Qin, Jin, Jiang, El-Yacoubi, Gao. "Adversarial AutoMixup." ICLR 2024.
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
from ..engine.mixer import extending
from ..engine.targets import weighed_labels
from ..functional import sample_lam
from ..transfer import to_device
from .automix import AutoMix
from .mixblock import checked_shape


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
        self.upsampling = checked_shape("AdaptiveMask", channels, reduction, upsampling)
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
    """AdAutoMix (Qin et al. 2024): AutoMix with the authors' generator, mixes of several samples, and an
    adversarial Mix Block.

    Each training forward is AutoMix's (:class:`~mixhook.AutoMix`): the momentum copy ``k`` gives
    ``features`` on the clean batch; the generator (:class:`AdaptiveMask`) makes the masks of two draws, the
    Mix Block's (``k`` runs on it, gradients into the generator) and the model's (mask without gradient);
    the model trains on its mix and on the clean batch beside it. What differs:

    - **the generator**: each sample's share at each position from a softmax over the mixed samples'
      logits, each from the attention of its features with the others' (AutoMix's Mix Block: one logit and
      a sigmoid);
    - **mixes of** ``mix_samples`` **samples** (3, the authors' default; ``random_samples``: 2 to
      ``mix_samples``, drawn per forward, as their CUB configs): for three or more, ``N`` Beta(alpha,
      alpha) draws normalised to sum to one weigh the samples' labels, and each draw (the Mix Block's, the
      model's) mixes ``N`` random permutations of the batch (none of them the batch itself, as the
      authors'), ``sum_i m_i * h[p_i]``; the model is plain mixup where the first weight is within
      ``lam_margin`` of 0 or 1 (the authors' rule; ``margin_rule="openmixup"``: OpenMixup's port, whose
      test reads ``lam_margin < 1 - lam_0``, true for nearly every draw: nearly always plain mixup); and it
      trains on a third batch, the plain ``N``-way mixup ``sum_i lam_i * h[p_i]`` of the same partners,
      which takes ``mixup_ratio`` of the clean loss's weight (the authors' third forward: its rows sit
      between the clean rows and the mixed ones, ``3B`` rows, batch norm normalising the three apart). Two
      samples: the sample and a partner, lam and ``1 - lam``, as AutoMix;
    - **the Mix Block's loss**, on every ``adversarial_every``-th training forward (the first, the third,
      ... with the authors' 2): ``-beta * l_mix(k) + (1 - beta) * cos``, where ``cos`` is the mean over the
      batch of the label-weighted cosine similarity of ``k``'s logits on the mix with its logits on each
      mixed sample (``k``'s whole clean forward runs on those steps, its rows permuted: batch norm's
      statistics do not change under a permutation); on the other forwards ``l_mix(k)``, as AutoMix's;
    - no mask loss: the shares sum to one by construction.

    :meth:`loss` is the authors' ``forward_train``: ``clean_weight * ((1 - mixup_ratio) * l(clean) +
    mixup_ratio * l_mix(plain mixup)) + l_mix(model) + block_weight * (the Mix Block's term)`` (on a
    two-sample forward ``clean_weight * l(clean) + ...``, as theirs); the forwards are counted
    (:attr:`iteration`, kept by ``state_dict``) so a resumed run keeps the alternation. ``pin(adversarial=
    True)`` chooses a forward's term; ``pin(samples=3, lams=(...), block_indices=[...], mix_indices=[...])``
    its draws. ``targets()`` is refused: the loss is no criterion of mixed targets. On a three-sample
    forward ``last.lam`` and ``last.index`` are the first sample's label weight and rows; ``last.info``
    holds them all (``co_lams``, ``mix_indices``).

    Where mixhook differs from the authors' code, and why: as AutoMix (one classifier for their two heads;
    the clean rows, and the plain mixup's, beside the mixed ones in one forward, batch norm after the mix
    normalising each group apart as their separate forwards do; ``k`` stops at ``features`` where its
    logits are not needed; the momentum update at the first training forward after an optimizer step);
    their clamping of an attention that overflows and their replacement of a NaN mask are not copied (a
    non-finite loss is refused by the app in one line); without the clean rows (``clean_weight=0``) there is
    no plain mixup batch (their code then fails).

    Cost: a step 4.1x a Manifold Mixup step on 2 CPU cores at the input (PreActResNet-18, batch 16, three
    samples), where AutoMix's is 3.0x in the same run (``benchmarks/results/cpu-2026-11-29-methods-
    adautomix.md``): the model's ``3B`` rows for AutoMix's ``2B``, and the copy's whole clean forward on
    every other step.

    The other arguments are :class:`~mixhook.AutoMix`'s (``layer``, ``features``, ``channels``,
    ``momentum``, ``end_momentum``, ``momentum_scope``, ``total_steps``, ``clean_weight``, ``block_weight``,
    ``reduction``, ``upsampling``, ``block_lr``, ``block_momentum``, ``generator``, ``batch_dim``,
    ``padding``, ``layout``, ``feature_tokens``), with the authors' CUB config's ``end_momentum`` 0.99999
    and CIFAR's nearest upsampling.

    Args:
        alpha: the Beta distribution's concentration for every lam, > 0 (the authors' CUB config: 1).
        lam_margin: plain mixup for the model where the (first) lam is within it of 0 or 1 (0.03).
        beta: the Mix Block's mixed loss's weight in its adversarial term (the authors' ``beta_radio``, 0.3).
        adversarial_every: the adversarial term on one training forward of this many (2); 0: never (the
            Mix Block then minimises ``k``'s mixed loss, AutoMix's without its mask loss).
        mix_samples: the samples in each mix, >= 2 (3); random_samples: draw 2 to ``mix_samples`` per
            forward (the authors' ``is_random``).
        mixup_ratio: the plain mixup batch's share of the clean loss's weight on forwards of three or more
            samples (the authors' ``mixup_radio``, 0.5).
        margin_rule: ``"authors"`` (JinXins/Adversarial-AutoMixup) or ``"openmixup"`` (its port), for the
            ``lam_margin`` test of forwards of three or more samples.
    """

    card = Card(
        paper="Qin et al. 2024",
        mixes="AutoMix's learned masks over 3 samples; every other step, mixes made hard for the copy",
        where="as AutoMix",
        family="learned",
        traits=("several",),
        signature=(
            'AdAutoMix(layer="input", features="layer3", alpha=1.0, beta=0.3, adversarial_every=2, '
            'mix_samples=3, mixup_ratio=0.5, lam_margin=0.03, margin_rule="authors", ...)'
        ),
        hook="as AutoMix (`3B` rows after the mix; + the copy's whole clean forward on adversarial steps)",
        commands="`mixup=adautomix`",
        details=(
            "AutoMix's forward (a momentum copy `k` gives `features`; two draws, the Mix Block's and the "
            "model's; the model trains on its mix and the clean batch) with the authors' generator "
            "(`AdaptiveMask`: each sample's logit from the attention of its features, lam concatenated, with"
            " the others' keys; a softmax over the samples gives the shares), mixes of three samples (three "
            "random permutations, Beta draws normalised to one; the model also trains on their plain "
            "three-way mixup, `mixup_ratio` of the clean loss's weight, as the authors' third forward) and "
            "their Mix Block loss: on every other training forward `-beta·l_mix(k) + (1-beta)·cos` (cos: the"
            " label-weighted cosine similarity of `k`'s logits on the mix with its logits on each sample), "
            "on the others `l_mix(k)`; no mask loss. Equal to the authors' `AdAutoMix.forward_train` "
            "(JinXins/Adversarial-AutoMixup) on the same draws, loss and every gradient and batch norm's "
            "running statistics, two and three samples, both kinds of step. OpenMixup's port differs on the "
            "three-sample path: its `lam_margin` test reads `< 1 - lam` where the authors' reads `> 1 - "
            'lam`, so its model nearly always trains on plain mixup there (`margin_rule="openmixup"`)'
        ),
        example={"layer": "input", "features": "conv1"},
        drawn={
            "features": "features",
            "mix_samples": 2,
            "note": "\n(the generator as initialised, two samples)",
        },  # fmt: skip
    )

    pin_keys = ("lam_mb", "index_mb", "adversarial", "samples", "lams", "block_indices", "mix_indices")
    computed_each_forward = ("features", "mb", "k_clean")  # (copy_pass and the Mix Block run anew)
    block_type = AdaptiveMask
    MARGIN_RULES = ("authors", "openmixup")

    def _own(
        self,
        base,
        *,
        beta: float = 0.3,
        adversarial_every: int = 2,
        mix_samples: int = 3,
        random_samples: bool = False,
        mixup_ratio: float = 0.5,
        margin_rule: str = "authors",
    ) -> None:
        """What AdAutoMix takes beside AutoMix's arguments, checked and set (``base()``: AutoMix's own)."""
        kind = type(self).__name__
        for name, value, least in (
            ("mix_samples", mix_samples, 2),
            ("adversarial_every", adversarial_every, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{kind}: {name} must be an integer >= {least}, got {value!r}")
        if margin_rule not in self.MARGIN_RULES:
            raise ValueError(
                f"{kind}: margin_rule must be one of {', '.join(self.MARGIN_RULES)}, got {margin_rule!r}"
            )
        if not isinstance(random_samples, bool):
            raise ValueError(f"{kind}: random_samples must be True or False, got {random_samples!r}")
        base()
        self.beta, self.mixup_ratio = check_fraction("beta", beta), check_fraction("mixup_ratio", mixup_ratio)
        self.adversarial_every, self.mix_samples, self.random_samples = (
            adversarial_every,
            mix_samples,
            random_samples,
        )
        self.margin_rule = margin_rule
        self.iteration = 0  # the training forwards counted so far (the authors' self.iter)

    @property
    def samples_per_row(self) -> int:
        """The most samples a mixed row mixes, ``mix_samples``."""
        return self.mix_samples

    # AutoMix's arguments but its mask loss (the shares sum to one by construction), with the authors' CUB
    # config's alpha, end momentum and lam margin; then AdAutoMix's own (_own)
    __init__ = extending(
        AutoMix.__init__,
        _own,
        without=("mask_loss", "mask_loss_mode", "mask_margin", "mask_adjust"),
        mask_loss=0.0,
        alpha=1.0,
        end_momentum=0.99999,
        lam_margin=0.03,
    )

    def __repr__(self) -> str:
        return (
            super().__repr__()[:-1] + f", beta={self.beta}, adversarial_every={self.adversarial_every}, "
            f"mix_samples={self.mix_samples}{', random_samples=True' if self.random_samples else ''})"
        )

    # ------------------------------------------------------------- the copy's pass, the turn, the draws

    def copy_pass(self, k: nn.Module, args: tuple, kwargs: dict, pinned: Mapping, generator) -> tuple:
        """The features; whether this forward's Mix Block term is adversarial (pinned, or this forward's
        turn: the authors' ``iter % 2 == 0``), on which ``k``'s whole clean forward runs and its logits are
        kept (the cosine term's); and the samples this forward mixes (pinned, or drawn)."""
        adversarial = pinned.get("adversarial")
        if adversarial is None:
            every = self.adversarial_every
            adversarial = bool(every) and self.iteration % every == 0
            self.iteration += 1
        adversarial, g = bool(adversarial), generator
        samples = pinned.get("samples")
        if samples is None and pinned.get("lams") is not None:
            samples = len(pinned["lams"])
        if samples is None:  # (the authors' random.randint(2, mix_samples) where random)
            spread = self.mix_samples - 2 if self.random_samples else 0
            draw = int(torch.randint(spread + 1, (), generator=g, device=g.device)) if spread else 0
            samples = (2 + draw) if self.random_samples else self.mix_samples
        features, out = self._features(k, args, kwargs, whole=adversarial)
        clean = self._logits_of(out, "the cosine term") if adversarial else None
        return features, {"adversarial": adversarial, "k_clean": clean, "samples": int(samples)}

    def block_draws(self, n: int, g: torch.Generator, pinned: Mapping) -> dict:
        """Two samples: AutoMix's draws. Three or more: the ``N`` Beta draws (``lams``) and their
        normalisation (``co_lams``), ``N`` permutations for the Mix Block's mix and ``N`` for the model's."""
        samples = pinned["samples"]
        if samples == 2:
            return {**super().block_draws(n, g, pinned), "samples": 2}
        raw = pinned.get("lams")
        raw = tuple(float(sample_lam(self.alpha, g)) for _ in range(samples)) if raw is None else tuple(raw)
        total = sum(raw)
        co = tuple(lam / total for lam in raw)
        drawn = {}
        for key in ("block_indices", "mix_indices"):
            given = pinned.get(key)
            drawn[key] = (
                [self.draw_index(n, g) for _ in range(samples)]
                if given is None
                else [torch.as_tensor(p) for p in given]
            )
        if len(raw) != samples or any(len(drawn[key]) != samples for key in drawn):
            raise ValueError(
                f"{type(self).__name__}: pinned lams and indices must have one entry per sample ({samples})"
            )
        return {
            "samples": samples, "lams": raw, "co_lams": co, **drawn,
            "lam_mb": co[0], "index_mb": drawn["block_indices"][0],
        }  # fmt: skip

    def block_mix(self, h: torch.Tensor, features, drawn: Mapping, choices) -> tuple:
        if drawn["samples"] == 2:
            return super().block_mix(h, features, drawn, choices)
        shares = self._shares(features, drawn["block_indices"], drawn["co_lams"], h.shape[-2:], choices[0])
        return _weighed(
            h, drawn["block_indices"], [shares[:, i : i + 1] for i in range(shares.shape[1])]
        ), shares

    def _shares(self, features, indices, lams, size, mode) -> torch.Tensor:
        maps = [features[to_device(p, features.device)] for p in indices]
        return self.mix_block.shares(maps, lams, size, mode)

    # ------------------------------------------------------------------------------ the model's mix

    def mix(self, leaves, draw: Draw) -> Mixed:
        pinned = draw.pinned
        if pinned["samples"] == 2:
            mixed = super().mix(leaves, draw)
        else:
            h, co, indices = leaves[0].tensor, pinned["co_lams"], pinned["mix_indices"]
            with torch.no_grad():
                mode = self._choices(draw.generator)[0]
                shares = self._shares(pinned["features"], indices, co, h.shape[-2:], mode)
            plain = self.lam_margin >= co[0] or (
                self.lam_margin > 1 - co[0] if self.margin_rule == "authors" else self.lam_margin < 1 - co[0]
            )
            if plain:  # (the model's mix is plain mixup)
                shares = torch.stack([torch.full_like(shares[:, 0], lam) for lam in co], 1)
            parts = [shares[:, i : i + 1] for i in range(len(co))]
            path = leaves[0].path
            before = {path: _weighed(h, indices, co)} if self.clean else None
            logits, mask, _ = pinned["mb"]
            info = {"mask": shares, "co_lams": co, "block_indices": pinned["block_indices"]}
            info["mix_indices"] = indices
            block = {"block": (logits, mask, co[0], pinned["block_indices"][0])}  # (with gradients: not kept)
            mixture = (
                torch.stack([torch.as_tensor(p) for p in indices]),
                torch.tensor(co, dtype=torch.float64),
            )
            mixed = Mixed(
                {path: _weighed(h, indices, parts)}, lam=co[0], info=info, index=indices[0], before=before,
                loss_inputs=block, mixture=mixture,
            )  # fmt: skip
        mixed.info.update(
            adversarial=pinned["adversarial"], k_clean=pinned["k_clean"], samples=pinned["samples"]
        )
        return mixed

    # ------------------------------------------------------------------------------------ the loss

    def clean_loss(self, criterion: Callable, clean, mixed, target, last: MixState) -> torch.Tensor:
        """Three or more samples: ``clean_weight * ((1 - mixup_ratio) * l(clean) + mixup_ratio * l_mix(plain
        mixup))`` and the mixed loss (the rows after the clean ones: the plain mixup's, then the mask
        mix's); two: AutoMix's."""
        if last.groups != 2:
            return super().clean_loss(criterion, clean, mixed, target, last)
        n, r = clean.shape[0], self.mixup_ratio
        plain = weighed_labels(criterion, mixed[:n], target, *last.mixture)  # (the plain mixup's rows)
        one = (1 - r) * criterion(clean, target) + r * plain
        return self.clean_weight * one + self.mixed_loss(criterion, mixed[n:], target, last)

    def mixed_loss(self, criterion, logits, target, last: MixState, own_terms: bool = True) -> torch.Tensor:
        """AutoMix's: the criterion under the mix (three or more samples: ``sum_i lam_i * l(logits,
        y[p_i])`` over the model's permutations, :attr:`MixState.mixture`) and, with ``own_terms``, the
        Mix Block's term. (``weigh`` gives it the rows after the clean ones: on a forward with the plain
        mixup's rows, both groups' values.)"""
        n = target.shape[0]
        if not own_terms and last.groups == 2 and logits.shape[0] == 2 * n:  # (weigh: both groups)
            base = super().mixed_loss
            return torch.cat(
                [base(criterion, rows, target, last, False) for rows in (logits[:n], logits[n:])]
            )
        return super().mixed_loss(criterion, logits, target, last, own_terms)

    def block_loss(self, criterion: Callable, target: torch.Tensor, last: MixState) -> torch.Tensor | float:
        """The Mix Block's term: ``block_weight * (-beta * l_mix(k) + (1 - beta) * cos)`` on an adversarial
        forward (the cosine term per sample where the criterion gives one loss per sample), ``block_weight
        * l_mix(k)`` on the others."""
        if self.block_weight == 0:
            return 0.0
        block_logits, _, lam_mb, index_mb = last.loss_inputs["block"]
        if last.info["samples"] == 2:
            indices, lams = [torch.arange(target.shape[0]), index_mb], [lam_mb, 1 - lam_mb]
            loss = self.copy_mixed_loss(criterion, block_logits, target, lam_mb, index_mb)
        else:
            indices, lams = last.info["block_indices"], last.info["co_lams"]
            loss = weighed_labels(criterion, block_logits, target, indices, lams)
        if last.info["adversarial"]:
            clean = last.info["k_clean"]
            cos = None
            for p, lam in zip(indices, lams, strict=True):
                term = F.cosine_similarity(block_logits, clean[to_device(p, clean.device)], dim=-1) * lam
                cos = term if cos is None else cos + term
            loss = -self.beta * loss + (1 - self.beta) * (cos if loss.ndim else cos.mean())
        return self.block_weight * loss

    def targets(self, *args, **kwargs):
        """Refused: AdAutoMix's loss is no criterion of mixed targets (its Mix Block's term; its mixes of
        several samples alone would be, :attr:`MixState.mixture`); train with :meth:`loss`."""
        raise ValueError(f"targets(): {type(self).__name__} {self.targets_refused()}; train with its loss()")

    def targets_refused(self) -> str:
        return (
            "trains its Mix Block by a loss of its own beside the model's, which mixed targets cannot carry"
        )

    # ---------------------------------------------------------------------------------- the state

    def state_dict(self) -> dict:
        """AutoMix's, and the training forwards counted (the adversarial turn)."""
        return {**super().state_dict(), "iteration": self.iteration}

    def load_state_dict(self, state: Mapping) -> None:
        self.iteration = int(state.get("iteration", 0))
        super().load_state_dict(state)


def _weighed(h: torch.Tensor, indices: Sequence[torch.Tensor], weights: Sequence) -> torch.Tensor:
    """``sum_i h[indices[i]] * weights[i]`` in the authors' order, in ``h``'s dtype."""
    out = None
    for p, w in zip(indices, weights, strict=True):
        term = h[to_device(p, h.device)] * w
        out = term if out is None else out + term
    return out.to(h.dtype)

"""timm's ``Mixup`` at any layer of the model: a drop-in for the ``mixup_fn`` of timm's ``train.py``.

timm's training script mixes the input batch before the forward (``input, target = mixup_fn(input,
target)``) and trains on the soft targets it returns (``SoftTargetCrossEntropy``). :class:`LayerMixup`
takes timm's ``Mixup`` arguments plus the model and the layers, and is called the same way: it draws the
batch's mix **before** the forward, as timm's does (whether to mix, mixup or CutMix, lam, the partners,
the box), pins it on mixhook's :class:`~mixhook.ManifoldMixup` / :class:`~mixhook.CutMix` attached to the
model, and returns the input unchanged with the soft targets of that mix. The model's next training
forward mixes exactly so at the chosen layer. One line of ``train.py`` changes::

    mixup_fn = Mixup(**mixup_args)                                        # timm: the input
    mixup_fn = LayerMixup(model, layer="stages.2", **mixup_args)          # mixhook: stages.2

Everything else of timm's loop stays: the soft-target loss, ``mixup_fn.mixup_enabled = False`` at
``mixup_off_epoch``, label smoothing, ``switch_prob``. With ``layer="input"`` and the default
``pairing="flip"`` the batch is mixed as timm's ``Mixup`` mixes it (tested on the same lam and box).

:class:`MixupFn` takes any mixhook method instead (SnapMix, PuzzleMix, RegMixup, the policies, ...): its
``mixup_fn`` hands the method the labels before the forward and its :meth:`MixupFn.loss` wraps timm's
criterion, two lines of ``train.py``.

Nothing here imports timm: the classes only speak its ``mixup_fn`` protocol.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.traced import Shape
from ..functional import smooth_one_hot
from ..layers import trace_outputs
from ..mixers.cutmix import CutMix
from ..mixers.manifold import ManifoldMixup
from ..mixers.oneof import OneOf
from ..sites import Leaf

PAIRINGS = ("flip", "random")


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose layers are named as the user names them: under DDP (``.module``) and
    ``torch.compile`` (``._orig_mod``) wrappers, which timm's script applies before it makes
    ``mixup_fn``."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


class LayerMixup:
    """timm's ``Mixup`` at named layers; it smooths labels by ``label_smoothing=0.1`` unless told, as timm's.

    Called as ``x, soft = mixup_fn(x, target)`` before each training forward. With probability ``prob``
    the batch is mixed: CutMix with probability ``switch_prob`` when both ``mixup_alpha`` and
    ``cutmix_alpha`` are > 0 (else the one that is), at a layer drawn uniformly from its layers,
    ``lam ~ Beta(alpha, alpha)``, the partners ``index`` (``pairing="flip"``: the reversed batch, as timm;
    ``"random"``: a permutation, as the papers), and for CutMix a box drawn on the layer's map as timm
    draws it on the image (``rounding="timm"``), lam corrected to the area kept. ``soft`` is timm's
    ``mixup_target`` of that mix: ``lam * y + (1 - lam) * y[index]`` of the smoothed one-hot labels (or of
    multi-label targets). ``x`` is returned unchanged: the mix is pinned on mixhook's mixers and happens
    in the model's next training forward, at the layer.

    Args:
        model: the model (a DDP or ``torch.compile`` wrapper is looked through); the mixers are attached
            to it here (``remove()`` takes them off).
        layer: the mixup layers: a name (``"input"``, ``"stages.2"``) or a list (one drawn per batch).
        cutmix_layer: CutMix's layers (each must output a ``(B, C, H, W)`` map, or pass ``tokens``);
            ``None``: ``layer``.
        mixup_alpha, cutmix_alpha, prob, switch_prob, label_smoothing, num_classes, multi_label: as timm's
            ``Mixup``.
        cutmix_minmax, mode, correct_lam: timm's; only their defaults (``None``, ``"batch"``, ``True``)
            are supported: other values are refused in one line.
        pairing: ``"flip"`` (timm's) or ``"random"``.
        generator: the draws' ``torch.Generator``; ``None``: a CPU generator seeded from
            ``torch.initial_seed()``, which timm's ``random_seed(seed, rank)`` makes different per rank.
        tokens: CutMix on a ViT's tokens: the patch grid or ``"auto"`` (see :mod:`mixhook.engine.tokens`).

    ``mixup_enabled`` switches it off and on, as timm's. ``state_dict()`` / ``load_state_dict()`` hold the
    generator, so a resumed run draws what the uninterrupted one would have. Calling it twice without a
    training forward in between is refused (the first call's targets would belong to no forward).
    """

    def __init__(
        self,
        model: nn.Module,
        layer: str | Sequence[str] = "input",
        mixup_alpha: float = 1.0,
        cutmix_alpha: float = 0.0,
        cutmix_minmax=None,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        mode: str = "batch",
        correct_lam: bool = True,
        label_smoothing: float = 0.1,
        num_classes: int = 1000,
        multi_label: bool = False,
        cutmix_layer: str | Sequence[str] | None = None,
        pairing: str = "flip",
        generator: torch.Generator | None = None,
        tokens: Sequence[int] | str | None = None,
    ):
        if cutmix_minmax is not None:
            raise ValueError(
                f"cutmix_minmax={cutmix_minmax!r}: LayerMixup draws CutMix's box from lam, as timm without "
                "cutmix_minmax; leave it None"
            )
        if mode != "batch":
            raise ValueError(f"mode={mode!r}: LayerMixup mixes whole batches, as timm's mode='batch'")
        if correct_lam is not True:
            raise ValueError(
                "correct_lam=False: LayerMixup's CutMix always weighs the targets by the area kept"
            )
        for name, value in (("mixup_alpha", mixup_alpha), ("cutmix_alpha", cutmix_alpha)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if not mixup_alpha > 0 and not cutmix_alpha > 0:
            raise ValueError("one of mixup_alpha and cutmix_alpha must be > 0 (timm's Mixup asks the same)")
        for name, value in (("prob", prob), ("switch_prob", switch_prob)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be an int >= 1, got {num_classes!r}")
        if pairing not in PAIRINGS:
            raise ValueError(f"pairing must be one of {', '.join(PAIRINGS)}, got {pairing!r}")
        self.mix_prob, self.switch_prob = float(prob), float(switch_prob)
        self.label_smoothing, self.num_classes = float(label_smoothing), num_classes
        self.multi_label, self.pairing = multi_label, pairing
        self.mixup_enabled = True
        self.generator = generator or torch.Generator().manual_seed(torch.initial_seed() % 2**63)
        # prob=0: the mixers mix only what is pinned here, never a forward this object did not prepare
        self.mixup = ManifoldMixup(layer, alpha=mixup_alpha, prob=0.0) if mixup_alpha > 0 else None
        cut = layer if cutmix_layer is None else cutmix_layer
        self.cutmix = (
            CutMix(cut, alpha=cutmix_alpha, prob=0.0, rounding="timm", tokens=tokens)
            if cutmix_alpha > 0
            else None
        )
        self._mixers = [m for m in (self.mixup, self.cutmix) if m is not None]
        self.hook = OneOf(self._mixers) if len(self._mixers) > 1 else self._mixers[0]
        self.model = _unwrap(model)
        self._handle = self.hook.attach(self.model)
        self._maps: dict = {}  # (layer, input shape) -> the map CutMix cuts there (its shape)
        self._pending = None  # the mixer pinned by the last call, until a training forward uses it

    def __repr__(self) -> str:
        return (
            f"LayerMixup({self.hook!r}, prob={self.mix_prob}, switch_prob={self.switch_prob}, "
            f"label_smoothing={self.label_smoothing})"
        )

    def remove(self) -> None:
        """Take the mixers off the model."""
        self._handle.remove()

    @property
    def last(self):
        """The :class:`~mixhook.MixState` of the latest training forward, or ``None`` where it did not mix."""
        return self.hook.last

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "mixup_enabled": self.mixup_enabled}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.mixup_enabled = bool(state["mixup_enabled"])

    def __call__(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_used()
        n, g = x.shape[0], self.generator
        mixer = None
        if (
            self.mixup_enabled
            and float(torch.rand((), dtype=torch.float64, generator=g, device=g.device)) < self.mix_prob
        ):
            mixer = self._mixers[0]
            if (
                len(self._mixers) > 1
                and float(torch.rand((), dtype=torch.float64, generator=g, device=g.device))
                < self.switch_prob
            ):
                mixer = self.cutmix
        if mixer is None:
            return x, self._soft(target, 1.0, None)
        layers = mixer.layers
        spec = (
            layers[int(torch.randint(len(layers), (), generator=g, device=g.device))]
            if len(layers) > 1
            else layers[0]
        )
        flip = torch.arange(n - 1, -1, -1) if self.pairing == "flip" else None
        leaves = self._map(mixer, spec, x) if mixer is self.cutmix else None
        draw, (_, mixed) = mixer.draw_for(spec, n, g, index=flip, leaves=leaves)
        if mixer is self.cutmix:
            values = {"box": mixed.info["box"]}
        else:
            values = {"lam": draw.lam}
        index = draw.index
        if isinstance(self.hook, OneOf):
            self.hook.pin(choice=self._mixers.index(mixer), layer=spec, index=index, **values)
        else:
            mixer.pin(layer=spec, index=index, **values)
        self._pending = mixer
        lam = draw.lam if mixed.lam is None else mixed.lam  # (as the mixer's record resolves it)
        return x, self._soft(target, float(lam), index)

    def _soft(self, target: torch.Tensor, lam: float, index: torch.Tensor | None) -> torch.Tensor:
        """timm's ``mixup_target``: ``y * lam + y[index] * (1 - lam)`` of the smoothed labels."""
        s = self.label_smoothing
        if self.multi_label:
            if target.ndim != 2 or target.shape[1] != self.num_classes:
                raise ValueError(
                    f"multi_label=True needs dense targets of shape (batch, {self.num_classes}), got "
                    f"{tuple(target.shape)}"
                )
            y = target.float() * (1.0 - s) + 0.5 * s
        else:
            y = smooth_one_hot(target.long().view(-1), self.num_classes, s)
        if index is None:
            return y
        return y * lam + y[index.to(y.device)] * (1.0 - lam)

    def _map(self, mixer: CutMix, spec: str, x: torch.Tensor) -> list:
        """The leaves CutMix would cut at ``spec`` for a batch like ``x``, as their shapes (the box is
        drawn on them; no tensor is kept), found once per input shape by one forward in eval mode without
        gradients."""
        key = (spec, tuple(x.shape[1:]), x.dtype)
        found = self._maps.get(key)
        if found is None:
            outputs = trace_outputs(self.model, [spec], x[:1])
            if spec not in outputs:
                raise RuntimeError(f"LayerMixup: CutMix's layer {spec!r} does not run in the model's forward")
            found = [
                Leaf(leaf.path, Shape(tuple(leaf.tensor.shape), leaf.tensor.dtype), leaf.dim)
                for leaf in mixer.leaves_at(spec, outputs[spec])
            ]
            self._maps[key] = found
        return found

    def _check_used(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and pending.pinned:
            self.hook.unpin()
            raise RuntimeError(
                "LayerMixup was called again before a training forward used its last mix: the soft targets "
                "it returned belong to no forward (call it once per batch, right before model(x) in training)"
            )


def _per_sample(criterion: Callable) -> Callable:
    """``criterion`` returning one loss per sample, where it is one of the criteria timm's script builds
    (their means over the batch): ``nn.CrossEntropyLoss`` (a copy with ``reduction="none"``), timm's
    ``LabelSmoothingCrossEntropy`` (torch's cross-entropy with the same ``label_smoothing``: the same
    formula) and ``SoftTargetCrossEntropy`` (its sum over classes, unmeaned); anything else as it is."""
    if isinstance(criterion, nn.CrossEntropyLoss):
        per_sample = copy.copy(criterion)
        per_sample.reduction = "none"
        return per_sample
    name = type(criterion).__name__
    if name == "LabelSmoothingCrossEntropy":
        return nn.CrossEntropyLoss(reduction="none", label_smoothing=float(criterion.smoothing))
    if name == "SoftTargetCrossEntropy":
        return lambda x, target: torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1)
    return criterion


class MixupFn:
    """Any mixhook method in timm's training script: its ``mixup_fn`` gives the method the batch's labels
    before the forward (gradient saliency, SnapMix's maps, C-Mixup's partners), and :meth:`loss` wraps its
    criterion so the loss is taken under the forward's mix. Two lines of ``train.py`` change::

        mixup_fn = MixupFn(model, SnapMix("input", features="layer4", classifier="fc"))
        train_loss_fn = mixup_fn.loss(train_loss_fn)          # the criterion timm built, under the mix

    ``input, target = mixup_fn(input, target)`` in ``train_one_epoch`` stays: the input and the labels come
    back unchanged (the method mixes inside the model's forward, at its layers). The criterion timm's
    script builds (cross-entropy, its label-smoothing one, the soft-target one) is taken per sample, so a
    method with a lam per sample (PuzzleMix, SnapMix, TransMix) weighs it, and the mean over the batch
    (over a clean+mixed method's ``2B`` rows: RegMixup) is returned, as your own loop would take it.
    ``mixup_enabled = False`` (timm's ``mixup_off_epoch``) leaves the next forwards unmixed. Evaluation
    (``validate_loss_fn``, a model in eval mode) is untouched. A method with parameters of its own
    (AutoMix's Mix Block) needs the optimizer: ``MixupFn(model, mixer, optimizer)`` adds them to it as one
    more group (timm's ``train.py`` builds the optimizer before the mixup and the scheduler after, which then
    schedules the group too).

    The mixer draws from its own generator (by default seeded from ``torch.initial_seed()``, which timm's
    ``random_seed(seed, rank)`` makes different per rank). Refused in one line: a method that mixes with a
    second batch (``PartnerBatch``, Balanced-MixUp: timm's loop gives one batch a step); a call without a
    training forward in between (the labels would belong to no forward).
    """

    def __init__(self, model: nn.Module, mixer, optimizer: torch.optim.Optimizer | None = None):
        from ..engine.contract import MixingHook
        from .draws import join_optimizer, needs_partner_batch

        if not isinstance(mixer, MixingHook):
            raise TypeError(f"MixupFn needs a mixhook mixer (ManifoldMixup, SnapMix, ...), got {mixer!r:.80}")
        if needs_partner_batch(mixer):
            raise ValueError(
                f"MixupFn: {type(mixer).__name__} mixes with a second batch (PartnerBatch, BalancedMixup: "
                "use_partners), which timm's training loop does not give (one batch a step); train it in "
                "your own loop, Lightning or the app"
            )
        self.mixer, self.model = mixer, _unwrap(model)
        self.mixup_enabled = True
        self._handle = mixer.attach(self.model)
        self._called = False  # a call not yet followed by a training forward
        if optimizer is not None:  # (timm's train.py makes it before the mixup, its scheduler after)
            join_optimizer(mixer, optimizer)

    def __repr__(self) -> str:
        return f"MixupFn({self.mixer!r})"

    def remove(self) -> None:
        """Take the mixer off the model."""
        self._handle.remove()

    @property
    def last(self):
        """The :class:`~mixhook.MixState` of the latest training forward, or ``None`` where it did not mix."""
        return self.mixer.last

    def __call__(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._called:
            raise RuntimeError(
                "MixupFn was called again before a training forward's loss was taken through "
                "mixup_fn.loss(criterion): the labels it was given belong to no loss (call it once per "
                "batch, right before model(x) in training, and take the loss with the wrapped criterion)"
            )
        self.mixer.use_targets(target)
        if not self.mixup_enabled:
            self.mixer.skip_next()
        self._called = True
        return x, target

    def loss(self, criterion: Callable) -> Callable:
        """``criterion`` (timm's ``train_loss_fn``) under the mix of the forward whose output it is given."""

        per_sample = _per_sample(criterion)

        def mixed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            self._called = False
            if not self.model.training:
                return criterion(output, target)
            loss = self.mixer.loss(per_sample, output, target)
            return loss.mean() if loss.ndim else loss

        return mixed

"""The contract every mixing regularizer keeps, and the mechanism the single-method mixers share.

:class:`MixingHook` is what the training loop relies on (``last``, ``loss``, ``targets``, ``pin``,
``pin_last``, ``skip_next``, ``check_output``); ``isinstance(hook, MixingHook)`` is the one way to tell a
mixing regularizer from other hooks. :class:`Mixer` implements it for one method: which layer, whether
to mix, the hooks, pinning, activation-checkpoint replay, padding masks, ``loss`` and ``targets``. A
method subclasses it and implements :meth:`Mixer.mix` (and, where it needs to, :meth:`Mixer.sample_lam`
and :meth:`Mixer.check_leaves`); :class:`~mixhook.mixers.oneof.OneOf` keeps the same contract by
delegating to the mixers it chooses among. See "Adding a mixer" in the README.
"""

from __future__ import annotations

import abc
import collections
import functools
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils.hooks import RemovableHandle

from .. import padding as masks
from .. import recompute
from ..hooks import LayerHook
from ..layouts import NHWC, SiteLayout, check_layout, layout_facts, site_layout
from ..sites import (
    INPUT,
    Inputs,
    Leaf,
    batch_leaves,
    blendable,
    describe,
    embedding_layers,
    input_batch,
    replace_leaves,
)
from ..sites import leaves as tree_leaves
from ..transfer import to_device
from . import partners
from .functional import is_permutation, per_sample, sample_lam, smooth_one_hot, weight_of
from .tokens import TokenGrid


@dataclass(frozen=True)
class MixState:
    """What one training forward mixed (a mixer's ``.last``).

    Attributes:
        layer: the layer spec that was mixed (as given, selector included).
        lam: the weight of each sample's own target (float64): a 0-d tensor, or one per sample (1-D).
            ``loss`` and ``targets`` use it as is: for CutMix it is the area-corrected lam, for PatchUp
            the paper's target weight, for Manifold Mixup the drawn lam.
        index: 1-D int64 tensor: sample ``i`` was mixed with sample ``index[i]``.
        info: what the method records beyond these, by name (CutMix: ``"box"``; PatchUp: ``"mask"``);
            each mixer's docstring says what it puts here.
        elements: the elements of the layer's output (or of the model's inputs) that were mixed, as
            selector paths (``("[0]", "[1.0]")``; ``("[]",)`` for a plain tensor), with their batch
            dimensions in ``batch_dims``.
        weights: for a region method (CutMix, FMix, PatchUp, ...), the weight of each sample's own content
            at each position of the mixed map, ``(1 or B, H, W)`` (1 outside a pasted box, 0 inside; soft
            masks in between): what dense targets (segmentation maps) are mixed with, resized to the label
            map. ``None``: the same weight ``lam`` everywhere (Manifold Mixup, input mixup, NFM).
        shapes: the shapes of the mixed tensors, as ``elements`` lists them.
    """

    layer: str
    lam: torch.Tensor
    index: torch.Tensor
    info: Mapping[str, Any] = field(default_factory=dict)
    elements: tuple[str, ...] = ("[]",)
    batch_dims: tuple[int, ...] = (0,)
    weights: torch.Tensor | None = None
    shapes: tuple[tuple[int, ...], ...] = ()
    _weight: float | None = field(default=None, repr=False, compare=False)  # lam as a float, when one


@dataclass(frozen=True)
class Draw:
    """What :meth:`Mixer.mix` is given for one mix.

    Attributes:
        layer: the layer spec being mixed.
        lam: float64 on the CPU, from :meth:`Mixer.sample_lam` or pinned: a 0-d tensor, or one per sample.
        index: int64 on the CPU: sample ``i`` is mixed with sample ``index[i]`` (drawn or pinned).
        generator: where every further draw of this mix must come from (a box, a mask, noise), so that
            a recomputation under activation checkpointing and ``pin_last`` repeat it exactly.
        pinned: the values pinned for this forward, the method's own (its ``pin_keys``) among them.
        permutation: whether ``index`` is a permutation of the batch (drawn, or pinned and checked to be
            one): :func:`~mixhook.blend` may then take its backward as a gather (``permutation=``).
    """

    layer: str
    lam: torch.Tensor
    index: torch.Tensor
    generator: torch.Generator
    pinned: Mapping[str, Any]
    permutation: bool = False

    @functools.cached_property
    def inverse(self) -> torch.Tensor | None:
        """``index``'s inverse permutation (computed when first asked for), or ``None`` when ``index`` is
        not a permutation of the batch."""
        return torch.argsort(self.index) if self.permutation else None

    @functools.cached_property
    def weight(self) -> float | torch.Tensor:
        """``lam`` as the blends take it: a Python float for one lam on the CPU (no cast, no copy to the
        device), else the tensor."""
        return weight_of(self.lam)


@dataclass(frozen=True)
class Mixed:
    """What :meth:`Mixer.mix` returns.

    Attributes:
        tensors: the mixed tensor for every leaf it was given, by ``leaf.path``, each of the leaf's shape.
        lam: the target weight ``loss``/``targets`` use, where it differs from the drawn ``draw.lam``
            (CutMix's area-corrected lam); ``None``: ``draw.lam``.
        info: what to record in :attr:`MixState.info`.
        index: the partners actually used, where the method chose them itself (partners from the global
            batch: indices into it); ``None``: ``draw.index``.
        weights: a region method's own-content weight per position of the mixed map, ``(1 or B, H, W)``
            (see :attr:`MixState.weights`); ``None`` for a method that blends every position alike.
    """

    tensors: dict
    lam: torch.Tensor | None = None
    info: Mapping[str, Any] = field(default_factory=dict)
    index: torch.Tensor | None = None
    weights: torch.Tensor | None = None


@dataclass
class _Decision:
    """A mix decided at the start of a forward and applied when its layer runs."""

    layer: str
    pinned: dict = field(default_factory=dict)
    state: torch.Tensor | None = None  # pin_last: the generator state the repeated mix drew from
    done: bool = False
    batch: int | None = None  # the batch size of the model's input, where it can be told
    index: torch.Tensor | None = None  # once mixed: for the padding-mask policy downstream
    state: MixState | None = None  # once mixed: what it mixed (the padding-mask policy reads its shapes)


_SKIP = object()  # pinned for a forward that must not mix (skip_next)


class _Forward:
    """One forward of the model a mixer saw: what it mixed (``state``, ``None`` when it mixed nothing) and
    whether a ``loss``/``targets``/``state_for`` call has claimed its output yet."""

    __slots__ = ("state", "bound")

    def __init__(self, state: MixState | None = None):
        self.state = state
        self.bound = False


_UNMIXED = _Forward()  # every forward that mixed nothing (eval, skipped, not drawn): one shared record


_RECENT = 64  # the forwards a mixer keeps to tell whether an unclaimed one mixed


class ForeignLogitsError(RuntimeError):
    """``loss``/``targets``/``state_for`` were given logits that no forward of this mixer produced, or
    that combine several forwards' mixes: refused, never guessed."""


class MixingHook(abc.ABC):
    """The contract of a mixing regularizer: what a training loop may rely on.

    ``isinstance(hook, MixingHook)`` tells a mixing regularizer from other hooks (the app, ``attach()``
    and the one-mixer-per-model rule use it). Implemented by :class:`Mixer` (one method) and
    :class:`~mixhook.OneOf` (one of several per batch); a class of your own that mixes should subclass
    one of those, or this.
    """

    last: MixState | None

    @abc.abstractmethod
    def loss(self, criterion: Callable, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The criterion under the mix of the forward that produced ``logits`` (``criterion(logits,
        target)`` when it mixed nothing); see :meth:`state_for`."""

    @abc.abstractmethod
    def targets(
        self,
        target: torch.Tensor,
        num_classes: int | None = None,
        smoothing: float = 0.0,
        dtype: torch.dtype | None = None,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mixed targets of the forward that produced ``logits`` (without ``logits``: of the latest
        forward; see :meth:`Mixer.targets`), class indices with ``num_classes`` or floating and dense
        targets, in ``dtype`` (pass the logits' dtype)."""

    @abc.abstractmethod
    def state_for(self, logits: torch.Tensor | None = None) -> MixState | None:
        """The :class:`MixState` of the forward that produced ``logits`` (``None``: that forward mixed
        nothing, e.g. an eval forward), or a one-line :class:`ForeignLogitsError` when it cannot be
        known; without ``logits``, the latest forward's."""

    @abc.abstractmethod
    def pin(self, **values) -> None:
        """Make the next training forward mix with exactly these values."""

    @abc.abstractmethod
    def pin_last(self) -> None:
        """Make the next training forward repeat the last one's mix exactly (or not mix, if it did not)."""

    @abc.abstractmethod
    def skip_next(self) -> None:
        """Make the next training forward not mix (whatever ``prob``); sampling resumes after it."""

    @abc.abstractmethod
    def check_output(self, spec: str, value, batch: int | None = None) -> None:
        """Raise (one line) unless what layer ``spec`` returned can be mixed."""

    def owns(self, hook: MixingHook) -> bool:
        """Whether ``hook`` may be attached to a model that this one mixes (itself, or a part of it)."""
        return hook is self

    def use_targets(self, target: torch.Tensor) -> None:
        """The labels of the next training forward, for a method that needs them to mix (gradient
        saliency); the others ignore them. Call it before every forward, as the app's loop does: labels
        are used for one forward only, so a method that needs them never mixes with stale ones."""
        del target  # needed by none of the methods by default


_MIXING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its mixing regularizer


def claim(model: nn.Module, hook: MixingHook) -> None:
    """Make ``hook`` the mixing regularizer of ``model``; refuse a second one (two would each mix every
    batch), unless the one there owns ``hook`` (a :class:`~mixhook.OneOf` attaching its mixers)."""
    other = _MIXING.get(model)
    if other is None:
        _MIXING[model] = hook
    elif not other.owns(hook):
        raise RuntimeError(
            f"{type(model).__name__} already has a mixing regularizer attached ({other!r}); two would "
            "each mix every batch: remove it first, or combine both with mixhook.OneOf([...])"
        )


def unclaim(hook: MixingHook) -> None:
    """Forget ``hook`` as the mixing regularizer of any model (on removal)."""
    for model, owner in list(_MIXING.items()):
        if owner is hook:
            del _MIXING[model]


class Mixer(LayerHook, MixingHook):
    """Base class of the single-method mixers: mixes the output of one of ``layer`` per training batch.

    The shared mechanism: at the start of each training forward (a forward pre-hook on the model)
    decide, with probability ``prob``, to mix, and at which layer (uniformly); when that layer runs (a
    forward hook; for ``"input"`` the model's pre-hook) draw ``lam`` (:meth:`sample_lam`) and a
    permutation ``index``, and replace the tensors it returns that carry the batch (all of them, or the
    selected ones, each along its own batch dimension, see :mod:`mixhook.sites`) by what :meth:`mix`
    returns; after the forward (a forward hook on the model) check that the layer did run. A
    recomputation by activation checkpointing replays the same mix (:mod:`mixhook.recompute`).
    ``pin``, ``pin_last``, ``skip_next``, ``last``, ``loss`` and ``targets`` work the same for every
    method.

    A method implements:

    - :meth:`mix` (required): the mixed tensors, and what ``loss``/``targets`` use if not the drawn lam;
    - :meth:`sample_lam` (optional): the draw of lam; by default one ``Beta(alpha, alpha)`` per batch;
    - :meth:`check_leaves` (optional): refuse, in one line, what it cannot mix (CutMix: anything but one
      ``(B, C, H, W)`` map);
    - ``pin_keys`` (optional): the names of its own values that ``pin`` accepts (CutMix: ``("box",)``),
      which :meth:`mix` finds in ``draw.pinned``.

    A model has at most one mixing regularizer attached at a time (two would each mix every batch):
    combine several with :class:`~mixhook.OneOf`.
    """

    pin_keys: ClassVar[tuple[str, ...]] = ()
    # Whether mix() draws anything of its own from draw.generator (a box, a mask, noise): then a repeat
    # (pin_last, an activation-checkpoint recomputation) replays the generator from its state before the
    # mix. False for a method whose only draws are lam and the index (sample_lam, draw_index): those are
    # then drawn before mix() and repeated as pinned values (no generator state taken per mix). A method
    # that draws in mix() must leave it True: a repeat would otherwise draw anew.
    draws_in_mix: ClassVar[bool] = True
    # Whether draw_index() returns a permutation of the batch (every sample a partner once): the blends
    # then take their backward as a gather through its inverse. A method drawing partners with
    # repetition must set it False (a gather would give a repeated partner one gradient, not their sum).
    index_is_permutation: ClassVar[bool] = True
    # Whether mix() depends on which axes of a 4-D map are its channels and which its height and width
    # (every region method): then a (B, H, W, C) map is given as its (B, C, H, W) view and a map whose
    # layout cannot be told is refused (mixhook.layouts). False for a method that treats every element
    # alike (ManifoldMixup, NoisyFeatureMixup).
    layout_aware: ClassVar[bool] = True
    # None: dense targets (segmentation maps) are mixed like the map (a region method sets Mixed.weights);
    # else why not, refused in one line by loss() and targets()
    dense_targets: ClassVar[str | None] = None

    _hooks_model = True  # its own hooks on the model (see LayerHook)

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, batch_dim)
        self.layout = check_layout(layout, self.layers)
        self.alpha = check_positive("alpha", alpha)
        self.prob = check_fraction("prob", prob)
        self._draw_from(generator)
        if padding not in masks.PADDING:
            raise ValueError(f"padding must be one of {', '.join(masks.PADDING)}, got {padding!r}")
        self.padding = padding
        self.last: MixState | None = None
        self._pinned: dict | object | None = None
        self._last_draw: tuple | None = None  # (layer, generator state, pinned) of the last mix
        self.token_grid: TokenGrid | None = None  # set by the region mixers given tokens=(gh, gw)
        self._layer_weights: tuple[float, ...] | None = None

    _TRANSIENT = (
        "_draw", "_mask_stack", "_targets", "_capture", "_forwards", "_outputs", "_unmixed", "_key",
        "_layouts", "_regions", "_plans",
    )  # fmt: skip

    def _fresh(self) -> None:
        super()._fresh()
        self._layouts: dict[str, SiteLayout] = {}  # the layout of each site's 4-D maps (mixhook.layouts)
        self._regions: dict[str, str] = {}  # each hidden site's padding-mask region (mixhook.padding)
        self._plans: dict[str, tuple] = {}  # a site that returns a plain tensor: (ndim, dtype, batch dim)
        self._draw: _Decision | None = None
        self._mask_stack: list[bool] = []
        self._targets: torch.Tensor | None = None  # use_targets(): the next forward's labels
        self._capture: dict | None = None  # during gradient_at(): the map whose gradient is taken
        self._forwards: collections.deque[_Forward] = collections.deque(maxlen=_RECENT)
        self._outputs: dict[int, tuple] = {}  # id(mixed output without autograd) -> (weakref, _Forward)
        self._unmixed: collections.deque = collections.deque(maxlen=_RECENT)  # weakrefs: unmixed outputs
        self._key = f"mixhook.forward.{id(self)}"  # in grad_fn.metadata: the _Forward of that output

    @property
    def layer_weights(self) -> tuple[float, ...] | None:
        """Draw weights of :attr:`layers` (one >= 0 each, not all 0): layer ``k`` is mixed with
        probability ``w[k] / sum(w)``. ``None`` (default): uniform, as each paper draws."""
        return self._layer_weights

    @layer_weights.setter
    def layer_weights(self, weights) -> None:
        self._layer_weights = None if weights is None else check_layer_weights(self.layers, weights)

    def __repr__(self) -> str:
        tokens = (
            ""
            if self.token_grid is None
            else f", tokens={self.token_grid}, prefix={self.token_grid.prefix!r}"
        )
        layout = "" if self.layout is None else f", layout={self.layout!r}"
        return (
            f"{type(self).__name__}(layer={self._layer_spec!r}, alpha={self.alpha}, prob={self.prob}{tokens}"
            f"{layout})"
        )

    # ----------------------------------------------------------------------------------- user API

    def pin(
        self,
        layer: str | None = None,
        lam: float | torch.Tensor | None = None,
        index: Sequence[int] | torch.Tensor | None = None,
        **values,
    ) -> None:
        """Make the next training forward mix with exactly these values (and mix, whatever ``prob``).

        What is left out is drawn as usual. Sampling resumes after that forward. ``index`` is any 1-D
        integer index of the batch's length (a permutation, or e.g. a reversal to reproduce timm's
        ``flip`` pairing); its length is checked against the batch when it is used. ``lam`` is a number
        in [0, 1] (or, in ``mode="elem"``, one per sample). Subclasses take more values (CutMix ``box``,
        PatchUp ``mask``).
        """
        unknown = sorted(set(values) - set(self.pin_keys) - {"_range", "_permutation"})
        if unknown:
            valid = ", ".join(("layer", "lam", "index", *self.pin_keys))
            raise TypeError(f"{type(self).__name__}.pin() got unknown values {unknown}; valid: {valid}")
        if layer is not None and layer not in self.layers:
            raise ValueError(
                f"pin(layer={layer!r}): not one of this regularizer's layers {list(self.layers)}"
            )
        if lam is not None:
            lam = torch.as_tensor(lam, dtype=torch.float64).detach().cpu()
            if lam.ndim > 1 or not bool(((lam >= 0) & (lam <= 1)).all()):
                raise ValueError(f"pin(lam={lam.tolist()}): lam must be a number (or 1-D values) in [0, 1]")
        if index is not None:
            index = torch.as_tensor(index)
            if index.ndim != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
                raise ValueError(
                    f"pin(index=...): needs a 1-D integer index, got {index.dtype} {tuple(index.shape)}"
                )
            index = index.to(device="cpu", dtype=torch.int64)  # (read here, once, not in the forward)
            values["_range"] = (int(index.min()), int(index.max())) if index.numel() else (0, -1)
            values["_permutation"] = is_permutation(index)
        pinned = {"layer": layer, "lam": lam, "index": index, **values}
        self._pinned = {k: v for k, v in pinned.items() if v is not None}

    def pin_last(self) -> None:
        """Make the next training forward repeat the last training forward's mix exactly: the same
        layer and every draw (lam, index, and the method's own: box, mask, noise), or no mix if the last
        forward did not mix. The mixer's generator is not advanced by the repeat."""
        if self.last is None or self._last_draw is None:
            self.skip_next()
            return
        layer, state, pinned = self._last_draw
        self._pinned = {**pinned, "layer": layer, "_state": state}

    def skip_next(self) -> None:
        """Make the next training forward not mix, whatever ``prob`` (nothing is drawn for it)."""
        self._pinned = _SKIP

    def use_targets(self, target: torch.Tensor) -> None:
        self._targets = target

    # ------------------------------------------------------------ which forward produced these logits

    def state_for(self, logits: torch.Tensor | None = None) -> MixState | None:
        """The :class:`MixState` of the forward that produced ``logits``, or ``None`` when that forward
        mixed nothing (an eval forward, a forward that did not draw a mix, a skipped one). ``loss`` and
        ``targets`` use it, so an eval forward's logits get the plain criterion and each of several
        forwards (two views, micro-batches, a teacher on the same backbone) gets its own mix.

        The forward is found from the logits themselves: every output of a forward this mixer saw is
        marked (its autograd node, or the tensor when it has none), and ``logits`` may be that output
        or anything computed from it with gradients (``.float()``, a slice, a head on a hooked backbone).
        Refused in one line (:class:`ForeignLogitsError`): logits computed with gradients from no forward
        of this mixer (another model, a copy of the hooked model: copies have no hooks), logits combining
        several forwards that mixed, and logits without gradients that cannot be traced while a forward
        that mixed has not been claimed. Without ``logits``: the latest forward's, refused while an
        earlier forward that mixed is unclaimed (say which with ``logits``)."""
        return self._bound_state(logits, "state_for")

    def _bound_state(self, logits: torch.Tensor | None, what: str) -> MixState | None:
        """:meth:`state_for`, naming ``what`` in its errors; the forward found is marked claimed."""
        kind = type(self).__name__
        if logits is None:
            if not self._forwards:
                return None
            latest = self._forwards[-1]
            if any(not f.bound and f.state is not None for f in list(self._forwards)[:-1]):
                raise ForeignLogitsError(
                    f"{what}(): an earlier forward than the latest one mixed and has had no loss or targets "
                    f"taken yet, so the forward these targets are for cannot be told; pass logits= "
                    f"({kind}.{what}(..., logits=logits))"
                )
            latest.bound = True
            return latest.state
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"{what}(): logits must be a tensor, got {type(logits).__name__}")
        found = self._forwards_of(logits)
        if len(found) == 1:
            (record,) = found
            record.bound = True
            return record.state
        if found:
            mixed = [f for f in found if f.state is not None]
            if not mixed:
                for f in found:
                    f.bound = True
                return None
            raise ForeignLogitsError(
                f"{what}(): these logits combine the outputs of {len(found)} forwards of the model, "
                f"{len(mixed)} of them mixed by {kind}, so no one mix applies to them; take each forward's "
                f"{what} on its own logits"
            )
        if logits.grad_fn is not None:
            attached = "" if self._model is not None else f" ({kind} is not attached to a model)"
            raise ForeignLogitsError(
                f"{what}(): these logits were not computed by a forward of the model {kind} is attached "
                f"to{attached}; a copy of a hooked model (copy.deepcopy, an EMA or AveragedModel, a "
                "pickled or spawned model) has no mixhook hooks: compute the loss on the hooked model's "
                "logits, or attach a regularizer to the copy"
            )
        unclaimed = [f for f in self._forwards if not f.bound and f.state is not None]
        if unclaimed:
            raise ForeignLogitsError(
                f"{what}(): these logits carry no autograd graph and are not an output of a forward of the "
                f"model (a copy?), while a forward that {kind} mixed has had no loss taken, so whether they "
                "are that forward's cannot be told; pass the model's output itself (or a tensor computed "
                "from it with gradients)"
            )
        return None  # every forward since the last claimed one mixed nothing: the plain criterion

    def _forwards_of(self, logits: torch.Tensor) -> list[_Forward]:
        """The forwards of this mixer whose outputs ``logits`` is, or was computed from: marked outputs
        found through views (``_base``) and the autograd graph, which is walked no further than them."""
        key, found = self._key, []
        t = logits
        while t is not None:  # the output itself, or a view of it
            node = t.grad_fn
            record = node.metadata.get(key) if node is not None else None
            if record is None and node is None:
                entry = self._outputs.get(id(t))
                record = entry[1] if entry is not None and entry[0]() is t else None
                if record is None and any(ref() is t for ref in self._unmixed):
                    record = _UNMIXED
            if record is not None:
                return [record]
            if node is not None:
                break
            t = t._base
        node = logits.grad_fn
        if node is None:
            return found
        seen, stack = {node}, [node]
        while stack:
            node = stack.pop()
            record = node.metadata.get(key)
            if record is not None:
                if all(record is not f for f in found):
                    found.append(record)
                continue
            for child, _ in node.next_functions:
                if child is not None and child not in seen:
                    seen.add(child)
                    stack.append(child)
        return found

    def loss(
        self,
        criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        logits: torch.Tensor,
        target: torch.Tensor,
    ) -> torch.Tensor:
        """``lam * criterion(logits, target) + (1 - lam) * criterion(logits, target[index])`` under the
        mix of the forward that produced ``logits``, or ``criterion(logits, target)`` when that forward
        mixed nothing (an eval forward, a skipped one); see :meth:`state_for` for how the forward is found
        and what is refused.

        ``target`` is whatever the criterion takes: class indices, soft or multi-hot targets
        (``BCEWithLogitsLoss``), regression values, or dense targets (see :func:`dense_weights`). With
        one lam per sample (``mode="elem"``) the criterion must return one loss per sample
        (``reduction="none"``); the weighted per-sample losses are returned for you to reduce. With a
        dense target under a region mix, lam is each position's own weight (the mask resized to the label
        map), so the criterion must return one loss per position (``reduction="none"``, e.g. ``(B, H, W)``
        for ``(B, H, W)`` class indices), weighted and returned for you to reduce.

        For a criterion that is linear in its target (cross-entropy, BCE) this equals the criterion of
        the mixed targets (:meth:`targets`); for one that is not (MSE on regression targets), the two
        differ: mix the targets with :meth:`targets` when the criterion of the mixed target is meant."""
        last = self._bound_state(logits, "loss")
        if last is None:
            return criterion(logits, target)
        loss_a = criterion(logits, target)
        loss_b = criterion(logits, self._partners_of(last, target, "loss"))
        if last._weight is not None and last.weights is None and _positions(target) <= 0:
            return torch.lerp(loss_b, loss_a, last._weight)  # one lam as a float: the common case
        lam = self._target_weights(last, target, "loss")
        if lam is None:
            lam = to_device(last.lam, loss_a.device, loss_a.dtype)
            if lam.ndim == 1 and (loss_a.ndim == 0 or loss_a.shape[0] != lam.shape[0]):
                raise ValueError(
                    f"loss(): lam has one value per sample ({lam.shape[0]}), so the criterion must return "
                    f"one loss per sample (reduction='none'), but it returned shape {tuple(loss_a.shape)}"
                )
            if lam.ndim == 1 and loss_a.ndim > 1:  # per-sample lam over per-position losses (dense)
                if any(dim != 0 for dim in last.batch_dims):
                    raise ValueError(
                        f"loss(): per-position losses {tuple(loss_a.shape)} with one lam per sample need the "
                        f"batch first, but this model's mixed tensors have it at {last.batch_dims}: reduce "
                        "the criterion to one loss per sample"
                    )
                lam = lam.view(-1, *[1] * (loss_a.ndim - 1))
        else:
            lam = to_device(lam, loss_a.device, loss_a.dtype)
            if loss_a.shape != lam.shape:
                raise ValueError(
                    f"loss(): a dense target under {type(self).__name__}'s region mix weighs each position "
                    f"by its own mask, so the criterion must return one loss per position {tuple(lam.shape)} "
                    f"(reduction='none'), but it returned shape {tuple(loss_a.shape)}"
                )
        return torch.lerp(loss_b, loss_a, lam)

    def targets(
        self,
        target: torch.Tensor,
        num_classes: int | None = None,
        smoothing: float = 0.0,
        dtype: torch.dtype | None = None,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mixed targets of the forward that produced ``logits``: ``lam * t + (1 - lam) * t[index]``
        (``t`` when it mixed nothing), in ``dtype`` (a floating dtype, e.g. the logits'; ``None``: torch's
        default), computed from the float64 lam. Without ``logits``: the latest forward's, refused in one
        line when an earlier forward that mixed has not had its targets or loss taken (pass ``logits``
        to say which; see :meth:`state_for`).

        ``t`` is, by ``target``:

        - integer class indices ``(B,)``: one-hot over ``num_classes`` with label smoothing (``1 -
          smoothing + smoothing/num_classes`` on the true class, ``smoothing/num_classes`` elsewhere):
          ``(B, num_classes)``, for ``nn.CrossEntropyLoss``, which accepts class probabilities;
        - integer dense labels ``(B, *S)`` (a segmentation map ``(B, H, W)``, token labels ``(B, T)``):
          one-hot per position, ``(B, num_classes, *S)``;
        - floating targets, taken as they are: soft class probabilities or multi-hot labels ``(B, K)``
          (for ``BCEWithLogitsLoss``), regression values ``(B,)`` or ``(B, d)``, dense probabilities
          ``(B, K, H, W)``; ``num_classes``, when given, is checked against ``K``; ``smoothing`` is
          refused (smooth them yourself first, as the smoothing of multi-hot labels is a choice).

        Under a region mix (CutMix, FMix, PatchUp, ...) a dense target's lam is per position: the
        method's own-content mask resized to the label map (:func:`dense_weights`), so a pasted box
        pastes its labels too."""
        if num_classes is not None and (
            isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1
        ):
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if not dtype.is_floating_point:
            raise ValueError(f"targets(dtype=...) must be a floating dtype, got {dtype}")
        if not isinstance(target, torch.Tensor) or target.ndim == 0 or target.dtype == torch.bool:
            what = (
                f"{target.dtype} {tuple(target.shape)}" if isinstance(target, torch.Tensor) else type(target)
            )
            raise ValueError(
                f"targets() needs a batch of integer class indices or floating targets, got {what}"
            )
        if target.dtype.is_floating_point:
            if smoothing:
                raise ValueError(
                    "targets(smoothing=...) applies to class indices; smooth floating (soft, multi-hot) "
                    "targets yourself before mixing them"
                )
            if num_classes is not None and (target.ndim < 2 or target.shape[1] != num_classes):
                raise ValueError(
                    f"targets(): floating targets of shape {tuple(target.shape)} do not have "
                    f"num_classes={num_classes} classes along dimension 1"
                )
            last = self._bound_state(logits, "targets")
            own = target.to(dtype)
            partner = None if last is None else self._partners_of(last, target, "targets").to(dtype)
        else:
            if num_classes is None:
                raise ValueError("targets(): class indices need num_classes")
            _check_classes(target, num_classes)

            def one_hot(t):
                soft = smooth_one_hot(t.reshape(-1), num_classes, smoothing, dtype)
                return soft.view(*t.shape, num_classes).movedim(-1, 1) if t.ndim > 1 else soft

            last = self._bound_state(logits, "targets")
            own = one_hot(target)
            partner = None if last is None else one_hot(self._partners_of(last, target, "targets"))
        if last is None:
            return own
        weights = self._target_weights(last, target, "targets")
        if weights is None:
            lam = last._weight if last._weight is not None else per_sample(last.lam, own)
            return torch.lerp(partner, own, lam)
        return torch.lerp(partner, own, to_device(weights, own.device, own.dtype).unsqueeze(1))

    def _target_weights(self, last: MixState, target: torch.Tensor, what: str) -> torch.Tensor | None:
        """Per-position own weights ``(B, H, W)`` for a dense ``target`` under a region mix, else ``None``
        (lam as it is)."""
        if _positions(target) > 0 and self.dense_targets is not None:
            raise ValueError(f"{what}(): {type(self).__name__} {self.dense_targets}")
        if last.weights is None:
            return None
        return dense_weights(last, target, what, type(self).__name__)

    def check_output(self, spec: str, value, batch: int | None = None) -> None:
        """Raise ``TypeError``/``ValueError`` (one line) unless what layer ``spec`` returned (for
        ``"input"``: the model's :class:`~mixhook.sites.Inputs`) can be mixed by this class, for a model
        input of ``batch`` samples.

        The app calls it on a sample batch before training; the hooks check every mix the same way.
        Needs the regularizer to be attached (the batch dimensions depend on the model)."""
        self._leaves(spec, self._site_value(spec, value), batch)

    # ---------------------------------------------------------------------------------- the hooks

    def _check_attach(self, model: nn.Module) -> None:
        claim(model, self)

    def _register(
        self, model: nn.Module, modules: dict[str, nn.Module], handles: list[RemovableHandle]
    ) -> None:
        """Register the model hooks that start and end each forward, the layer hooks and the
        padding-mask hooks."""
        if self.layout_aware:
            facts = layout_facts(model)
            self._layouts = {
                spec: site_layout(model, site, self._declared_layout(spec), facts)
                for spec, site in self.sites.items()
            }
        handles.append(model.register_forward_pre_hook(self._on_model_input, with_kwargs=True))
        for spec, module in modules.items():
            if self.sites[spec].layer != INPUT:
                handles.append(module.register_forward_hook(self._layer_hook(spec)))
        if self.padding == "union":
            self._regions = {
                spec: masks.region_of(model, site.layer)
                for spec, site in self.sites.items()
                if site.layer != INPUT
            }
            for name, module in model.named_modules():
                if module is not model and masks.takes_masks(module):
                    pre, post = self._mask_hooks(name)
                    handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                    handles.append(module.register_forward_hook(post, always_call=True))
        handles.append(model.register_forward_hook(self._on_model_output))

    def _reset(self) -> None:
        self._draw = None
        self._plans = {}
        unclaim(self)

    def _on_model_input(self, model: nn.Module, args: tuple, kwargs: dict):
        if self._capture is not None:  # gradient_at()'s own pass
            return self._capture_input(model, args, kwargs)
        if recompute.in_backward():  # the whole model is being recomputed: replay its input's mix
            return self._replay_input(model, args, kwargs)
        if not model.training:
            self._draw = None
            return None
        return self._begin(model, args, kwargs, self._agree(self._decide()))

    def _begin(self, model: nn.Module, args: tuple, kwargs: dict, draw: _Decision | None):
        """Start a training forward with ``draw`` (or no mix); mix the input now if it is the layer."""
        self.last = None
        targets, self._targets = self._targets, None
        if draw is not None:
            extra = self.before_forward(model, args, kwargs, draw.layer, draw.pinned, targets)
            if extra:
                draw.pinned = {**draw.pinned, **extra}
        self._draw = draw
        self._mask_stack = []
        if draw is None:
            return None
        draw.batch = self._reference_batch(model, args, kwargs)
        if self.sites[draw.layer].layer != INPUT:
            return None
        inputs = Inputs(model, args, kwargs)
        value, self.last = self._mix_now(draw.layer, inputs, draw)
        args, kwargs = _rebuild_inputs(inputs, self.sites[draw.layer], value)
        return self._input_masks(model, args, kwargs, draw.layer, self.last)

    def _replay_input(self, model: nn.Module, args: tuple, kwargs: dict):
        for spec, site in self.sites.items():
            if site.layer == INPUT:
                payload = self._replayed(spec)
                if payload is not None:
                    state, pinned = payload
                    inputs = Inputs(model, args, kwargs)
                    value, state = self._apply(spec, inputs, pinned, self._replaying(state))
                    args, kwargs = _rebuild_inputs(inputs, site, value)
                    return self._input_masks(model, args, kwargs, spec, state)
        return None

    def _input_masks(self, model: nn.Module, args: tuple, kwargs: dict, spec: str, state: MixState):
        """The model's ``(args, kwargs)`` after a mix at its input, with the masks that describe the mixed
        input unioned (:func:`mixhook.padding.at_input`); unless the model takes no mask argument, the
        modules inside keep what it hands them."""
        if self.padding != "union":
            return args, kwargs
        inputs = Inputs(model, args, kwargs)
        site = self.sites[spec]
        mixed = (inputs.first()[0],) if site.paths is None else tuple(inputs.key(p[0]) for p in site.paths)
        names = masks.at_input(inputs, mixed, state.index.shape[0])
        if names is None:
            return args, kwargs  # the model takes no mask: its modules decide, as for a hidden layer
        if not recompute.in_backward():
            self._mask_stack.append(True)  # the modules inside get the model's masks: none unions again
        if not names:
            return args, kwargs
        masks.check_lengths(f"{type(model).__name__} (the model)", inputs, names, _sizes(state))
        return masks.union(inputs, names, state.index, self._mask_source)

    def _layer_hook(self, spec: str):
        def hook(module: nn.Module, args: tuple, output):
            if self._capture is not None:  # gradient_at()'s own pass
                return self._capture_layer(spec, output)
            draw = self._draw
            if draw is not None and not draw.done and draw.layer == spec:  # this forward mixes here
                mixed, self.last = self._mix_now(spec, output, draw)
                return mixed
            if draw is None and recompute.in_backward():  # a recomputation, after its forward ended
                payload = self._replayed(spec)
                if payload is None:
                    return None
                state, pinned = payload
                return self._apply(spec, output, pinned, self._replaying(state))[0]
            self._note(spec)
            return None

        return hook

    def _mix_now(self, spec: str, value, draw: _Decision):
        """The forward's mix at ``spec``: drawn from the mixer's generator (or, for ``pin_last``, from a
        copy in the repeated mix's state); the state is noted for a recomputation and for ``pin_last``."""
        generator = self._replaying(draw.state)
        leaves = None
        if type(self).before_mix is not Mixer.before_mix or not self.draws_in_mix:
            leaves = self._leaves(spec, self._site_value(spec, value), draw.batch)
        if type(self).before_mix is not Mixer.before_mix:
            extra = self.before_mix(spec, leaves[1], draw.pinned)
            if extra:  # noted with the draw below: a recomputation and pin_last mix with the same values
                draw.pinned = {**draw.pinned, **extra}
        if self.draws_in_mix:  # a recomputation and pin_last draw again from the generator's state
            state = recompute.generator_state(generator)
        else:  # lam and index are all it draws: drawn now, they are what is repeated
            state = None
            lam, index, permutation = self._draws(spec, leaves[2], draw.pinned, generator)
            n = index.shape[0]
            drawn = {"lam": lam, "index": index, "_permutation": permutation}
            draw.pinned = {**draw.pinned, **drawn, "_range": draw.pinned.get("_range", (0, n - 1))}
        self._note(spec, (state, draw.pinned))
        mixed, last = self._apply(spec, value, draw.pinned, generator, draw.batch, leaves)
        self._last_draw = (spec, state, draw.pinned)
        draw.done, draw.index, draw.state = True, last.index, last
        return mixed, last

    # ------------------------------------------------------------------------- gradient of the loss

    def gradient_at(self, model: nn.Module, args: tuple, kwargs: dict, spec: str, target) -> torch.Tensor:
        """The gradient of the summed cross-entropy of ``model(*args, **kwargs)`` against ``target``
        with respect to what :meth:`mix` would be given at ``spec`` (the first leaf: a ``(B, C, H, W)``
        map, or the patch tokens' map): one more forward, in eval mode (no dropout, no batch-norm
        statistics updated; each module's own mode restored after), and a backward down to ``spec``
        only (``autograd.grad``, so no parameter's ``.grad`` changes). Other hooks active in training
        mode only do not act in it."""
        if target is None:
            raise RuntimeError(
                f"{type(self).__name__} needs the batch's labels for its gradient pass: call "
                "use_targets(y) before each training forward (the app's loop does)"
            )
        modes = [(m, m.training) for m in model.modules()]
        self._capture = {"spec": spec}
        try:
            model.eval()
            with torch.enable_grad():
                out = model(*args, **kwargs)
                logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
                if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
                    raise TypeError(
                        f"{type(self).__name__}'s gradient pass needs (B, classes) logits from the model, "
                        f"got {describe(out)}"
                    )
                leaf = self._capture.get("leaf")
                if leaf is None:
                    raise RuntimeError(f"mixup layer {spec!r} did not run in the gradient pass")
                target = to_device(target, logits.device)
                if target.shape != logits.shape[:1]:
                    raise ValueError(
                        f"use_targets(): {tuple(target.shape)} labels for a batch of {logits.shape[0]} logits"
                    )
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp16/bf16: in fp32
                loss = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
                (grad,) = torch.autograd.grad(loss, [leaf.tensor])
        finally:
            self._capture = None
            for module, mode in modes:
                module.training = mode
        grad_leaf = Leaf(leaf.path, grad, leaf.dim)
        if self.token_grid is not None:
            return self.token_grid.to_maps(spec, [grad_leaf], model)[0].tensor
        return grad.permute(0, 3, 1, 2) if self._channels_last(spec, grad_leaf) else grad

    def _capture_value(self, spec: str, site_value):
        """``site_value`` with its first leaf replaced by a detached copy that requires grad (noted in
        ``self._capture``): the gradient pass's backward stops there."""
        found = self._leaves(spec, site_value)[0]
        leaf = found[0]
        fresh = leaf.tensor.detach().requires_grad_()
        self._capture["leaf"] = Leaf(leaf.path, fresh, leaf.dim)
        return replace_leaves(site_value, {leaf.path: fresh})

    def _capture_input(self, model: nn.Module, args: tuple, kwargs: dict):
        spec = self._capture["spec"]
        if self.sites[spec].layer != INPUT:
            return None
        inputs = Inputs(model, args, kwargs)
        value = self._capture_value(spec, self._site_value(spec, inputs))
        return _rebuild_inputs(inputs, self.sites[spec], value)

    def _capture_layer(self, spec: str, output):
        if spec != self._capture["spec"] or "leaf" in self._capture:
            return None
        return self._capture_value(spec, output)

    def _on_model_output(self, model: nn.Module, args: tuple, output) -> None:
        if self._capture is not None:  # gradient_at()'s own pass
            return
        draw, self._draw = self._draw, None
        if draw is None:
            if recompute.in_backward():  # a recomputation, which runs after its forward ended
                return
            record = _UNMIXED
        elif draw.done:
            record = _Forward(self.last)
        else:
            raise RuntimeError(
                f"mixup layer {draw.layer!r} did not run during {type(model).__name__}.forward(), so nothing "
                "was mixed; choose a layer that forward() calls. (Under torch.compile: attach before "
                "compiling, and if hooks changed after compiling, or another instance of this class was "
                "compiled without them, set torch._dynamo.config.skip_nnmodule_hook_guards = False before "
                "compiling.)"
            )
        self._forwards.append(record)
        marked = _mark_traced if torch.compiler.is_compiling() else _mark_outputs
        marked(output, record, self._key, self._outputs, self._unmixed)

    def _agree(self, draw: _Decision | None) -> _Decision | None:
        """The decision this forward follows: its own (ranks that must agree override this)."""
        return draw

    def partner_pool(self, n: int) -> int:
        """How many samples a batch of ``n`` draws its partners from: ``n`` (partners from the global
        batch of a data-parallel job: ``world * n``); a pinned index is checked against it."""
        return n

    def _decide(self) -> _Decision | None:
        """Whether this forward mixes, and where (pinned values win; a pinned forward always mixes)."""
        self._seed_for_rank()
        pinned, self._pinned = self._pinned, None
        if pinned is _SKIP:
            return None
        g = self.generator
        state = None
        if pinned is not None and "_state" in pinned:
            pinned = dict(pinned)
            state = pinned.pop("_state")
        if pinned is None:
            if self.prob < 1.0 and float(torch.rand((), generator=g, device=g.device)) >= self.prob:
                return None
            pinned = {}
        layer = pinned.get("layer")
        if layer is None:
            k = 0
            if self.layer_weights is not None:
                weights = torch.tensor(self.layer_weights, dtype=torch.float64, device=g.device)
                k = int(torch.multinomial(weights, 1, generator=g))
            elif len(self.layers) > 1:
                k = int(torch.randint(len(self.layers), (), generator=g, device=g.device))
            layer = self.layers[k]
        return _Decision(layer=layer, pinned=pinned, state=state)

    # -------------------------------------------------------------------------- padding masks

    def _mask_hooks(self, name: str):
        """Downstream of a mix, the outermost module called with a padding mask gets the union of the
        partners' masks that describe the mixed sequence (:mod:`mixhook.padding`), and the calls inside
        it get what it hands them. A recomputation applies the same union again."""
        key = f"padding mask of {name}"

        def pre(module: nn.Module, args: tuple, kwargs: dict):
            if recompute.in_backward():
                payload = self._replayed(key)
                if payload is None:
                    return None
                index, names = payload
                return masks.union(Inputs(module, args, kwargs), names, index, self._mask_source)
            draw = self._draw
            if draw is None or draw.index is None or any(self._mask_stack):
                self._mask_stack.append(False)
                self._note(key)
                return None
            inputs = Inputs(module, args, kwargs)
            region = self._regions.get(draw.layer, "")
            names = masks.downstream(name, region, inputs, draw.index.shape[0])
            self._mask_stack.append(True)
            self._note(key, (draw.index, names) if names else None)
            if not names:
                return None
            masks.check_lengths(f"{type(module).__name__} {name!r}", inputs, names, _sizes(draw.state))
            return masks.union(inputs, names, draw.index, self._mask_source)

        def post(module: nn.Module, args: tuple, output) -> None:
            if self._mask_stack and not recompute.in_backward():
                self._mask_stack.pop()

        return pre, post

    def _mask_source(self, mask: torch.Tensor) -> torch.Tensor:
        """The rows a partner index indexes: the mask itself, or every rank's with partners from the
        global batch."""
        pool = self.partner_pool(mask.shape[0])
        return mask if pool == mask.shape[0] else partners.gather_labels(mask)

    # ------------------------------------------------------------------------------ the mix itself

    def _site_value(self, spec: str, value):
        """What a spec acts on in a layer's output or, for ``"input"``, the model's :class:`Inputs`:
        with a selector, the whole (the selector picks), else the output or the first argument."""
        site = self.sites[spec]
        if site.layer != INPUT:
            return value
        if not len(value):
            raise TypeError(f"mixup layer {spec!r}: the model was called without arguments; nothing to mix")
        return value if site.paths is not None else value[0]

    def _leaves(self, spec: str, value, expected: int | None = None) -> tuple[list[Leaf], list[Leaf], int]:
        """The leaves that carry the batch at ``spec``, what the method is given for them (the same, or
        with a token grid their ``(B, D, gh, gw)`` patch maps), and the batch size.

        A site that returned a plain tensor once is planned (its batch dimension, for its number of
        dimensions and dtype): the next tensor of the same kind skips the structure walk and the checks
        that depend on nothing else; the method's own :meth:`check_leaves` runs every time."""
        plan = self._plans.get(spec)
        if plan is not None and type(value) is torch.Tensor and (value.ndim, value.dtype) == plan[:2]:
            batch = value.shape[plan[2]]
            if expected is not None and batch != expected:
                self._plans.pop(spec)  # the full path says what is wrong
                return self._leaves(spec, value, expected)
            found = [Leaf((), value, plan[2])]
            self.check_leaves(spec, found)
            return found, found, batch
        site = self.sites[spec]
        if site.layer == INPUT:
            self._check_token_ids(spec, value)
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__}.check_output() needs the regularizer attached")
        kind = type(self).__name__
        found, batch = batch_leaves(value, site, self._dims[spec], kind, inputs=site.layer == INPUT)
        if expected is not None and batch != expected:
            raise TypeError(
                f"{kind} at {spec!r}: it returned {describe(value)}, whose batch dimension "
                f"{found[0].dim} has size {batch}, but the model's input has a batch of {expected}: the "
                "layer loses or reshapes the batch dimension (or, applied to a PackedSequence's .data, sees "
                "the time steps of every sample as rows); choose another layer, or pass batch_dim"
            )
        if self.token_grid is not None:
            given = self.token_grid.to_maps(spec, found, self._model)
        elif self.layout_aware and any(self._channels_last(spec, leaf) for leaf in found):
            given = [Leaf(f.path, f.tensor.permute(0, 3, 1, 2), 0) if self._channels_last(spec, f) else f
                     for f in found]  # fmt: skip
        else:
            given = found
            if type(value) is torch.Tensor and found[0].path == ():
                self._plans[spec] = (value.ndim, value.dtype, found[0].dim)
        self.check_leaves(spec, given)
        return found, given, batch

    def _declared_layout(self, spec: str) -> str | None:
        return self.layout.get(spec) if isinstance(self.layout, dict) else self.layout

    def _channels_last(self, spec: str, leaf: Leaf) -> bool:
        """Whether ``leaf`` is a ``(B, H, W, C)`` map, which a layout-aware method is given as its
        ``(B, C, H, W)`` view; a 4-D map whose layout cannot be told is refused here (one line)."""
        if not self.layout_aware or leaf.tensor.ndim != 4 or leaf.dim != 0:
            return False
        rule = self._layouts.get(spec)
        return rule is not None and rule.of(type(self).__name__, spec) == NHWC

    def _reference_batch(self, model: nn.Module, args: tuple, kwargs: dict) -> int | None:
        """The batch size of the model's input, to check each mixed layer against: the first tensor
        argument's batch dimension, where the model's layout tells it (``None`` where it does not)."""
        dims = next(iter(self._dims.values()), None)
        first = args[0] if args and type(args[0]) is torch.Tensor else None  # (the usual call)
        if first is None:
            first = next(
                (v for v in (*args, *kwargs.values()) if isinstance(v, (torch.Tensor, PackedSequence))), None
            )
        if isinstance(first, PackedSequence):  # its .data rows are time steps of every sample
            return int(first.batch_sizes[0])
        return input_batch(model, first, dims.seq_first) if dims is not None else None

    def _check_token_ids(self, spec: str, value) -> None:
        selected = value if isinstance(value, torch.Tensor) else None
        if selected is None and isinstance(value, Inputs):
            paths = self.sites[spec].paths or ()
            picked = [value.get(value.key(p[0])) if isinstance(p[0], str) or p[0] < len(value) else None
                      for p in paths]  # fmt: skip
            selected = next((t for t in picked if isinstance(t, torch.Tensor) and not blendable(t)), None)
        if isinstance(selected, torch.Tensor) and not blendable(selected):
            embeddings = embedding_layers(self._model) if self._model is not None else []
            where = (f"mix the embeddings instead: {', '.join(embeddings[:4])}, or a layer after them"
                     if embeddings else "mix a layer whose output is floating point")  # fmt: skip
            dtype = str(selected.dtype).removeprefix("torch.")
            raise TypeError(
                f"mixup layer {spec!r}: the model's input is a {dtype} tensor of shape "
                f"{tuple(selected.shape)} (token ids or labels), which cannot be blended; {where}"
            )

    def _apply(
        self,
        spec: str,
        value,
        pinned: dict,
        generator: torch.Generator,
        batch: int | None = None,
        leaves: tuple | None = None,
    ):
        """Mix what ``spec`` returned (or the model's inputs); draws come from ``generator``. Returns the
        mixed value (same structure; for ``"input"`` the changed arguments) and the :class:`MixState`.
        ``leaves``: what :meth:`_leaves` gave for this value, where the caller has it already."""
        site_value = self._site_value(spec, value)
        found, given, n = self._leaves(spec, site_value, batch) if leaves is None else leaves
        saved, self.generator = self.generator, generator  # a mixer drawing from self.generator replays too
        try:
            lam, index, permutation = self._draws(spec, n, pinned, generator)
            draw = Draw(spec, lam, index, generator, pinned, permutation)
            mixed = self.mix(given, draw)
        finally:
            self.generator = saved
        tensors = self._check_mixed(spec, given, mixed)
        target_lam = lam if mixed.lam is None else torch.as_tensor(mixed.lam, dtype=torch.float64)
        if self.token_grid is not None:
            tensors = {
                leaf.path: self.token_grid.from_map(leaf, tensors[leaf.path], target_lam, index, permutation)
                for leaf in found
            }
        elif self.layout_aware:  # (B, H, W, C) maps were given as their (B, C, H, W) views
            tensors = dict(tensors)
            for leaf in found:
                if self._channels_last(spec, leaf):
                    tensors[leaf.path] = tensors[leaf.path].permute(0, 2, 3, 1)
        state = MixState(
            layer=spec,
            lam=target_lam,
            index=index if mixed.index is None else mixed.index,
            info=dict(mixed.info),
            elements=tuple(leaf.name for leaf in found),
            batch_dims=tuple(leaf.dim for leaf in found),
            weights=mixed.weights,
            shapes=tuple(leaf.tensor.shape for leaf in found),
            _weight=draw.weight if mixed.lam is None and isinstance(draw.weight, float) else None,
        )
        return replace_leaves(site_value, tensors), state

    def _draws(
        self, spec: str, n: int, pinned: Mapping, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """lam and the partner index of a mix of ``n`` samples at ``spec`` (pinned, else drawn from
        ``generator``), and whether the index is a permutation of the batch."""
        pool = self.partner_pool(n)
        lam = pinned.get("lam")
        if lam is None:
            lam = torch.as_tensor(self.sample_lam(n, generator), dtype=torch.float64)
        elif lam.ndim == 1 and lam.shape[0] != n:
            raise ValueError(f"pinned lam has {lam.shape[0]} values but the batch at layer {spec!r} has {n}")
        index = pinned.get("index")
        if index is None:
            return lam, self.draw_index(n, generator), pool == n and self.index_is_permutation
        low, high = pinned["_range"]
        if index.shape[0] != n or (n and (low < -pool or high >= pool)):
            where = f"the batch of {n}" if pool == n else f"{pool} partners for a batch of {n}"
            raise ValueError(
                f"pinned index of length {index.shape[0]} (values {index.tolist()[:8]}...) "
                f"does not index {where} at layer {spec!r}"
            )
        if low < 0:  # counted from the end, as indexing counts them
            index = torch.where(index < 0, index + pool, index)
        return lam, index, pool == n and pinned["_permutation"]

    def _replaying(self, state: torch.Tensor | None) -> torch.Generator:
        """The generator a mix draws from: the mixer's own, or for a repeat (``pin_last``, a
        recomputation) a copy in the repeated mix's ``state`` (``None``: the mix drew nothing beyond lam
        and the index, which are repeated as pinned values)."""
        return self.generator if state is None else recompute.replay_generator(self.generator, state)

    def _check_mixed(self, spec: str, leaves: list[Leaf], mixed: Mixed) -> dict:
        """``mixed.tensors``, once it gives every leaf a tensor of the leaf's shape (a method that skipped
        one would leave it silently unmixed)."""
        kind = type(self).__name__
        if not isinstance(mixed, Mixed):
            raise TypeError(f"{kind}.mix() must return a mixhook.mixers.Mixed, got {type(mixed).__name__}")
        expected = {leaf.path: leaf for leaf in leaves}
        if set(mixed.tensors) != set(expected):
            raise RuntimeError(
                f"{kind}.mix() at {spec!r} returned tensors for {sorted(map(str, mixed.tensors))} but was "
                f"given {sorted(map(str, expected))}: every leaf must be mixed"
            )
        for path, t in mixed.tensors.items():
            if t.shape != expected[path].tensor.shape:
                raise RuntimeError(
                    f"{kind}.mix() at {spec!r} changed the shape of {expected[path].name} from "
                    f"{tuple(expected[path].tensor.shape)} to {tuple(t.shape)}"
                )
        return mixed.tensors

    # ------------------------------------------------------------------------- what a method implements

    def draw_index(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """Each sample's partner for a batch of ``n``: a uniformly random permutation (override for a
        fixed pairing, e.g. ``ManifoldMixup(mode="pair")``'s ``i <-> n - 1 - i``)."""
        return torch.randperm(n, generator=generator, device=generator.device)

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """The draw of lam for a batch of ``n``: a float64 0-d tensor (one lam for the batch) or ``n``
        values (one per sample), drawn from ``generator`` only. By default ``Beta(alpha, alpha)``."""
        return sample_lam(self.alpha, generator)

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        """Refuse, with a one-line ``TypeError``/``ValueError``, what this method cannot mix: ``leaves``
        are the tensors carrying the batch at ``spec`` (each with its ``path``, ``name`` and batch
        ``dim``). Runs before every mix and in :meth:`check_output`. Accepts anything by default."""

    def before_forward(
        self, model: nn.Module, args: tuple, kwargs: dict, spec: str, pinned: Mapping, targets
    ) -> Mapping:
        """Called at the start of a training forward that will mix at ``spec``, with the model's
        arguments, the values pinned so far and the labels given by :meth:`use_targets` (or ``None``);
        what it returns joins the pinned values :meth:`mix` finds in ``draw.pinned`` (and that a
        recomputation and ``pin_last`` reuse). Nothing by default; gradient saliency runs its pass here."""
        return {}

    def before_mix(self, spec: str, leaves: list[Leaf], pinned: Mapping) -> Mapping:
        """Called once per forward at the mixed layer, before the first :meth:`mix`, with the leaves
        :meth:`mix` will get; what it returns joins the pinned values (so that a recomputation under
        activation checkpointing reuses it rather than computing it again). Nothing by default."""
        return {}

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        """The mix itself: a mixed tensor for every leaf (``leaf.tensor`` carries the batch along
        ``leaf.dim``), partner ``draw.index[i]`` for sample ``i``, weights from ``draw.lam``; further
        draws from ``draw.generator`` only. Gradients must flow as in a hand-edited ``forward()``."""
        raise NotImplementedError(f"{type(self).__name__} must implement mix(leaves, draw)")

    def _partners_of(self, last: MixState, target: torch.Tensor, what: str) -> torch.Tensor:
        """The partners' rows of ``target`` under the mix ``last`` (from every rank's ``target`` when the
        partners came from the global batch)."""
        index = last.index
        if target.shape[0] != index.shape[0]:
            raise ValueError(
                f"{what}(): target has {target.shape[0]} rows but the forward that produced the logits "
                f"mixed a batch of {index.shape[0]}"
            )
        if last.info.get("partners") == "global":
            target = partners.gather_labels(target)
        return target.index_select(0, to_device(index, target.device))


def _mark_outputs(output, record: _Forward, key: str, untracked: dict, unmixed) -> None:
    """Mark every tensor of a forward's ``output`` as ``record``'s: its autograd node's metadata, or, for
    a tensor without one (no gradients), a weak reference in ``unmixed`` (the recent outputs of forwards
    that mixed nothing) or ``untracked[id(tensor)]`` for as long as the tensor lives."""
    for _, t in ((None, output),) if isinstance(output, torch.Tensor) else tree_leaves(output):
        if not isinstance(t, torch.Tensor):
            continue
        if t.grad_fn is not None:
            t.grad_fn.metadata[key] = record
        elif record is _UNMIXED:
            unmixed.append(weakref.ref(t))
        else:
            ident = id(t)
            untracked[ident] = (weakref.ref(t, lambda _, d=untracked, i=ident: d.pop(i, None)), record)


_MARK_TRACED: list = []


def _mark_traced(output, record: _Forward, key: str, untracked: dict, unmixed) -> None:
    """:func:`_mark_outputs` from code torch.compile traces: run after the graph (a graph break at the
    model's end), as it reads the real outputs' autograd nodes, which a traced graph does not have. (The
    wrapper is made at the first compiled forward, so importing mixhook does not import torch._dynamo.)"""
    if not _MARK_TRACED:
        _MARK_TRACED.append(torch.compiler.disable(_mark_outputs))
    _MARK_TRACED[0](output, record, key, untracked, unmixed)


def _rebuild_inputs(inputs: Inputs, site, value) -> tuple[tuple, dict]:
    """The model's ``(args, kwargs)`` with the mixed value put back: the first argument, or the selected
    arguments of the :class:`Inputs` copy."""
    if site.paths is None:
        return inputs.rebuild({inputs.first()[0]: value})
    return inputs.rebuild(value)


def _sizes(state: MixState) -> tuple[int, ...] | None:
    """The first mixed tensor's dimensions besides its batch dimension."""
    if not state.shapes:
        return None
    shape, dim = state.shapes[0], state.batch_dims[0]
    return tuple(size for d, size in enumerate(shape) if d != dim)


def _positions(target: torch.Tensor) -> int:
    """How many position dimensions a target has beyond its batch (and, floating, its class) dimension:
    0 for ``(B,)`` indices and ``(B, K)`` floating targets, 2 for a ``(B, H, W)`` or ``(B, K, H, W)`` map."""
    return target.ndim - (2 if target.dtype.is_floating_point else 1)


def _check_classes(target: torch.Tensor, num_classes: int) -> None:
    """Refuse class indices outside ``[0, num_classes)``: in one line for labels on the CPU; on a GPU as
    a device-side assertion (reading the labels on the host would stall every step until the GPU is
    idle), which fails the step loudly at the next synchronisation."""
    if not target.numel():
        return
    if target.device.type != "cpu":
        inside = ((target >= 0) & (target < num_classes)).all()
        torch._assert_async(inside, f"targets(): class indices must lie in [0, {num_classes})")
        return
    low, high = (int(v) for v in torch.aminmax(target))
    if low < 0 or high >= num_classes:
        ignore = (
            " (a dense map's ignore label, e.g. 255, has no probability: use loss() with a criterion "
            "that ignores it)"
            if target.ndim > 1
            else ""
        )
        raise ValueError(
            f"targets(): class indices must lie in [0, {num_classes}), got values from {low} to "
            f"{high}{ignore}"
        )


def dense_weights(last: MixState, target: torch.Tensor, what: str, kind: str) -> torch.Tensor | None:
    """The own-content weight of each position of a dense ``target`` under the region mix ``last``:
    ``last.weights`` resized to the target's ``(H, W)`` by area (each label pixel gets the fraction of
    its area that kept the sample's own content: exact for a mask cut at the input's resolution, and a
    feature map's cells cover whole blocks of label pixels), as ``(B, H, W)`` float64. Dense targets are
    integer maps ``(B, H, W)`` or floating ``(B, K, H, W)``; the usual ``(B,)`` indices and ``(B, K)``
    floating targets are not dense (``None``: the sample's lam). Any other shape under a region mix is
    refused: the mask would be mapped onto it along dimensions it does not describe."""
    spatial = _positions(target)
    if spatial <= 0:
        return None
    if spatial != 2:
        raise ValueError(
            f"{what}(): {kind} mixes regions of a 2-D map, so its dense targets must be (B, H, W) class "
            f"indices or (B, K, H, W) floating targets; got {target.dtype} {tuple(target.shape)}"
        )
    weights = last.weights.to(torch.float64)
    size = tuple(target.shape[-2:])
    if tuple(weights.shape[-2:]) != size:
        weights = F.interpolate(weights.unsqueeze(1), size=size, mode="area").squeeze(1)
    return weights.expand(target.shape[0], *size)


def check_spatial(kind: str, spec: str, leaves: list[Leaf]) -> torch.Tensor:
    """The one ``(B, C, H, W)`` map (batch at dim 0) that the mixers cutting regions act on, or a one-line
    ``TypeError`` naming the elements to choose from."""
    if len(leaves) != 1:
        names = ", ".join(f"{leaf.name} {tuple(leaf.tensor.shape)}" for leaf in leaves)
        raise TypeError(
            f"{kind} at {spec!r}: the layer returns {len(leaves)} tensors that carry the batch ({names}); "
            f"{kind} cuts one map: select it, e.g. '{spec.split('[')[0]}{leaves[0].name}'"
        )
    h = leaves[0].tensor
    if h.ndim != 4 or leaves[0].dim != 0:
        element = f" element {leaves[0].name}" if leaves[0].path else ""
        hint = "; for (B, T, D) tokens declare their patch grid: tokens=(rows, columns) or 'auto'"
        raise TypeError(
            f"{kind} at {spec!r} needs a (B, C, H, W) map with the batch first, but{element} has shape "
            f"{tuple(h.shape)} with the batch at dim {leaves[0].dim}{hint if h.ndim == 3 else ''}"
        )
    return h


def check_splittable(kind: str, spec: str, leaves: list[Leaf]) -> torch.Tensor:
    """:func:`check_spatial`, and a one-line ``ValueError`` for a single-pixel map, which no mask can
    split (the mask methods: FMix, SmoothMix)."""
    h = check_spatial(kind, spec, leaves)
    if h.shape[-2] * h.shape[-1] < 2:
        raise ValueError(
            f"{kind} at {spec!r}: its {h.shape[-2]}x{h.shape[-1]} map has a single pixel, which a mask "
            "cannot split; choose an earlier layer"
        )
    return h


def check_pinned_mask(mask, height: int, width: int) -> torch.Tensor:
    """A pinned ``(height, width)`` mask of weights in [0, 1], as a float64 CPU tensor, or a one-line
    ``ValueError``."""
    mask = torch.as_tensor(mask, dtype=torch.float64).cpu()
    if tuple(mask.shape) != (height, width):
        raise ValueError(f"pinned mask of shape {tuple(mask.shape)} does not fit the {height}x{width} map")
    if not bool(((mask >= 0) & (mask <= 1)).all()):
        raise ValueError("pinned mask must hold weights in [0, 1]")
    return mask


def _number(name: str, value) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None


def check_positive(name: str, value) -> float:
    """``value`` as a finite float > 0, or a ``ValueError`` naming ``name``."""
    number = _number(name, value)
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number


def check_non_negative(name: str, value) -> float:
    """``value`` as a finite float >= 0, or a ``ValueError`` naming ``name``."""
    number = _number(name, value)
    if not (number >= 0 and math.isfinite(number)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


def check_layer_weights(layers: Sequence[str], weights) -> tuple[float, ...]:
    """``weights`` as floats, once they give each of ``layers`` a weight >= 0, not all 0 (else one line)."""
    try:
        values = [float(w) for w in weights]
    except (TypeError, ValueError):
        values = None
    if (
        values is None
        or len(values) != len(layers)
        or any(not math.isfinite(v) or v < 0 for v in values)
        or not sum(values) > 0
    ):
        shown = list(weights) if isinstance(weights, Sequence) and not isinstance(weights, str) else weights
        raise ValueError(f"layer_weights={shown!r}: one weight >= 0 per layer of {list(layers)}, not all 0")
    return tuple(values)


def check_fraction(name: str, value) -> float:
    """``value`` as a float in [0, 1], or a ``ValueError`` naming ``name``."""
    number = _number(name, value)
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return number

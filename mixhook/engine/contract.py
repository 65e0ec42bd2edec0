"""The contract a training loop relies on: what a mixing regularizer is, and what one mix records.

:class:`MixingHook` is the contract (``last``, ``loss``, ``targets``, ``state_for``, ``pin``, ``pin_last``,
``skip_next``, ``unpin``, ``check_output``); ``isinstance(hook, MixingHook)`` is the one way to tell a mixing
regularizer from other hooks, and a model has at most one (:func:`claim`). :class:`MixState` is what one
training forward mixed; :class:`Draw` and :class:`Mixed` are what a method's ``mix()`` is given and
returns (:class:`~mixhook.engine.mixer.Mixer`).
"""

from __future__ import annotations

import abc
import weakref
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn

from ..functional import weight_of
from .card import Card, register


def record(cls: type) -> type:
    """``dataclass(frozen=True)`` for the records every mix makes (:class:`MixState`, :class:`Draw`,
    :class:`Mixed`), with an ``__init__`` that writes the fields into the instance's ``__dict__``: a frozen
    dataclass's own ``__init__`` sets each field through ``object.__setattr__``, three times the cost, which
    a mix paid three times per forward (about 3 us of its host time). The instances stay frozen (assigning
    a field raises ``FrozenInstanceError``), with the same fields, defaults, equality and ``replace()``.
    The ``__init__`` is generated from the fields, as dataclasses generate theirs."""
    cls = dataclass(frozen=True)(cls)
    params, body, scope = [], [], {"_MISSING": MISSING}
    for f in fields(cls):
        if f.default is not MISSING:
            scope[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not MISSING:
            scope[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            body.append(f" if {f.name} is _MISSING: {f.name} = _factory_{f.name}()")
        else:
            params.append(f.name)
        body.append(f" d[{f.name!r}] = {f.name}")
    source = f"def __init__(self, {', '.join(params)}):\n d = self.__dict__\n" + "\n".join(body)
    exec(source, scope)
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init
    return cls


class cached:
    """``functools.cached_property`` without its lock (Python 3.11 takes an ``RLock`` at every first
    read, a cost a mix pays on every forward): computed at the first read and kept in the instance's
    ``__dict__``, which later reads find before this descriptor. The values are pure functions of
    frozen fields, so computing one twice in a race would give the same value."""

    def __init__(self, fn):
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.fn(instance)
        return value


@record
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
            map. ``None``: the same weight ``lam`` everywhere (Manifold Mixup, input mixup, NFM). Made when
            first read where the method deferred it (:class:`Deferred`: CutMix's box).
        shapes: the shapes of the mixed tensors, as ``elements`` lists them.
        clean: whether the mixed layer emitted the clean batch followed by its mixed copy (a mixer's
            ``clean=True``: RegMixup, RankMixup, MixupE): downstream of it the batch is doubled, rows
            ``[0, B)`` of the logits are the clean samples and rows ``[B, 2B)`` their mixes, which ``lam``,
            ``index`` and ``weights`` describe. ``False``: the layer's output was replaced by the mix.
        partner_lam: the weight of each partner's target where it is not ``1 - lam`` (SnapMix's label
            weights, from class activation maps, need not sum to one): one per sample, float64; ``loss``
            is then ``lam * criterion(y) + partner_lam * criterion(y[index])`` and ``targets`` alike.
            ``None``: ``1 - lam``.
        groups: after a clean+mixed forward, the groups of ``B`` rows after the clean ones: 1, the mixed
            rows; more where the method's mix put rows of its own before them (:attr:`Mixed.before`:
            AdAutoMix's three-sample forwards, its plain mixup's rows then its mask mix's). The logits then
            have ``(1 + groups) * B`` rows; ``lam``, ``index`` and ``weights`` describe the last group.
        mixture: a mix of more than two samples per row, ``(indices, weights)``: ``indices`` ``(K, B)``
            int64, row ``i`` mixes samples ``indices[k, i]``, with label weights ``weights`` ``(K,)`` (one
            per term, for every row) or ``(K, B)`` (per row), float64, each row's summing to one; ``loss``
            is then ``sum_k weights[k] * criterion(logits, target[indices[k]])`` and ``targets`` alike
            (AdAutoMix's three-sample mixes). ``lam`` and ``index`` then describe its first two terms, for
            a reader that shows one pair. ``None``: the pair ``(index, lam)``.
        loss_inputs: what the method's own loss terms take with gradients, by name (AutoMix's Mix Block
            logits and mask: pieces of the autograd graph), as :attr:`Mixed.loss_inputs` gave them. Only the
            state the forward's output carries to ``loss()`` has them; what the mixer keeps (``.last``, the
            state ``targets()`` without logits reads) has ``None`` (:func:`kept`), so no piece of a graph
            outlives the output it belongs to. ``None``: the method's loss takes nothing beyond the mix.
    """

    layer: str
    lam: torch.Tensor
    index: torch.Tensor
    info: Mapping[str, Any] = field(default_factory=dict)
    elements: tuple[str, ...] = ("[]",)
    batch_dims: tuple[int, ...] = (0,)
    weights: torch.Tensor | None = None
    shapes: tuple[tuple[int, ...], ...] = ()
    clean: bool = False
    partner_lam: torch.Tensor | None = None
    groups: int = 1
    mixture: tuple[torch.Tensor, torch.Tensor] | None = None
    loss_inputs: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)

    @cached
    def weight(self) -> float | torch.Tensor:
        """``lam`` as ``loss()`` and ``targets()`` weigh by it (:func:`~mixhook.functional.weight_of`): a
        Python float for one lam on the CPU, else the tensor. Derived from this state's own ``lam`` (the
        forward's path makes it with lam, read once; a copy with another lam,
        ``dataclasses.replace(state, lam=...)``, derives its own), so lam is carried once."""
        return weight_of(self.lam)


class Deferred:
    """A record's value made when it is first read: ``Deferred(fn, *args)`` stands for ``fn(*args)``. A
    method may give :attr:`Mixed.weights` so where only a dense target ever reads them (CutMix's box
    weights: three tensor ops on every forward otherwise); :attr:`MixState.weights` makes it when read,
    once, so no reader sees a ``Deferred``. ``args`` must be what the value is made of, not tensors a step
    would otherwise free (a box's bounds, a map's shape)."""

    __slots__ = ("fn", "args")

    def __init__(self, fn: Callable, *args) -> None:
        self.fn, self.args = fn, args

    def __repr__(self) -> str:
        return f"Deferred({getattr(self.fn, '__name__', self.fn)}, {', '.join(map(repr, self.args))})"


class _MadeWhenRead:
    """The field of a :func:`record` that may hold a :class:`Deferred`: read, the ``Deferred`` is made and
    kept in its place (the instance stays frozen: assigning the field still raises)."""

    def __init__(self, name: str, default: Any) -> None:
        self.name, self.default = name, default

    def __get__(self, instance, owner=None):
        if instance is None:
            return self.default
        value = instance.__dict__[self.name]
        if type(value) is Deferred:
            value = instance.__dict__[self.name] = value.fn(*value.args)
        return value

    def __set__(self, instance, value) -> None:
        # (a data descriptor, read before the instance's __dict__; assigning the field still raises the
        # frozen record's FrozenInstanceError first: only object.__setattr__, as dataclasses and
        # torch.compile's tracing of the record's __init__ write fields, comes here)
        instance.__dict__[self.name] = value


MixState.weights = _MadeWhenRead("weights", None)


def kept(state: MixState) -> MixState:
    """``state`` as a mixer keeps it between forwards (its ``.last``): without its ``loss_inputs``."""
    return state if state.loss_inputs is None else replace(state, loss_inputs=None)


@record
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
        weight: ``lam`` as the blends take it (:func:`~mixhook.functional.weight_of`): a Python float for
            one lam on the CPU (no cast, no copy to the device), else the tensor; made with lam.
    """

    layer: str
    lam: torch.Tensor
    index: torch.Tensor
    generator: torch.Generator
    pinned: Mapping[str, Any]
    permutation: bool
    weight: float | torch.Tensor

    @cached
    def inverse(self) -> torch.Tensor | None:
        """``index``'s inverse permutation (computed when first asked for), or ``None`` when ``index`` is
        not a permutation of the batch."""
        return torch.argsort(self.index) if self.permutation else None


@record
class Mixed:
    """What :meth:`Mixer.mix` returns.

    Attributes:
        tensors: the mixed tensor for every leaf it was given, by ``leaf.path``, each of the leaf's shape.
        lam: the target weight ``loss``/``targets`` use, where it differs from the drawn ``draw.lam``
            (CutMix's area-corrected lam): float64 values, or one Python float (kept as the float the loss
            weighs by, with no read of a tensor); ``None``: ``draw.lam``.
        info: what to record in :attr:`MixState.info`.
        index: the partners actually used, where the method chose them itself (partners from the global
            batch: indices into it); ``None``: ``draw.index``.
        weights: a region method's own-content weight per position of the mixed map, ``(1 or B, H, W)``
            (see :attr:`MixState.weights`), or a :class:`Deferred` that makes it when it is first read;
            ``None`` for a method that blends every position alike.
        partner_lam: the partners' target weights where they are not ``1 - lam`` (see
            :attr:`MixState.partner_lam`); ``None``: ``1 - lam``.
        before: with the clean rows kept (:attr:`~mixhook.engine.mixer.Mixer.clean`), rows of the method's
            own between the clean rows and the mixed ones, a tensor of each leaf's shape by ``leaf.path``
            (AdAutoMix's plain three-way mixup, trained beside its mask mix as the authors' third forward);
            the forward then carries ``3B`` rows (:attr:`MixState.groups` 2); ``None``: none.
        loss_inputs: what the method's own loss terms take with gradients (AutoMix's Mix Block logits and
            mask), by name: carried to ``loss()`` by the forward's output and never kept by the mixer
            (:attr:`MixState.loss_inputs`). ``info`` is kept (``.last``): put nothing with a ``grad_fn``
            there.
        mixture: for a mix of more than two samples per row, ``(indices, weights)`` as
            :attr:`MixState.mixture` takes them (``lam`` and ``index`` then its first two terms'); ``None``:
            a pair.
    """

    tensors: dict
    lam: torch.Tensor | float | None = None
    info: Mapping[str, Any] = field(default_factory=dict)
    index: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    partner_lam: torch.Tensor | None = None
    before: dict | None = None
    loss_inputs: Mapping[str, Any] | None = None
    mixture: tuple[torch.Tensor, torch.Tensor] | None = None


def checked_mixture(spec: str, mixture, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A method's :attr:`Mixed.mixture` for ``n`` mixed rows as :attr:`MixState.mixture` holds it:
    ``indices`` an int64 ``(K, n)`` tensor, ``weights`` float64 ``(K,)`` or ``(K, n)``, ``K >= 2``, the
    weights summing to one for every row (checked where they are on the CPU: read on a GPU, they would
    stall the step); else a one-line ``ValueError``."""
    indices, weights = mixture
    indices = torch.as_tensor(indices)
    weights = torch.as_tensor(weights, dtype=torch.float64)
    k = indices.shape[0] if indices.ndim == 2 else 0
    if (
        indices.ndim != 2
        or indices.dtype.is_floating_point
        or k < 2
        or indices.shape[1] != n
        or weights.shape not in ((k,), (k, n))
    ):
        raise ValueError(
            f"mix() at {spec!r} returned a mixture of indices {tuple(indices.shape)} and weights "
            f"{tuple(weights.shape)}: it takes (K, {n}) integer indices, K >= 2, and (K,) or (K, {n}) weights"
        )
    if weights.device.type == "cpu" and not torch.allclose(
        weights.sum(0), torch.ones((), dtype=torch.float64)
    ):
        raise ValueError(f"mix() at {spec!r} returned mixture weights that do not sum to one for every row")
    return indices.to(torch.int64), weights


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
    card: Card | None = None
    """What the method states for the catalogue, the API page, the app's ``mixup=`` group and the matrix
    (:class:`~mixhook.Card`); a class that states one is listed in ``mixhook.mixers.METHODS``."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        register(cls)

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
    def unpin(self) -> None:
        """Forget what ``pin``, ``pin_last`` or ``skip_next`` set: the next training forward decides as
        any other."""

    @abc.abstractmethod
    def check_output(self, spec: str, value, batch: int | None = None, model_input=None) -> None:
        """Raise (one line) unless what layer ``spec`` returned can be mixed (``model_input``: the model's
        input, where the mixer checks a map's sides against it)."""

    def owns(self, hook: MixingHook) -> bool:
        """Whether ``hook`` may be attached to a model that this one mixes (itself, or a part of it)."""
        return hook is self

    def weigh(self, metric: Callable, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A per-sample ``metric`` weighted under the mix as :meth:`loss` weighs a criterion, without a
        method's own loss terms (see :meth:`mixhook.Mixer.weigh`). By default :meth:`loss` itself."""
        return self.loss(metric, logits, target)

    def check_targets(self, target: torch.Tensor) -> None:
        """Raise (one line) unless this regularizer can train with labels like ``target`` (a sample batch
        of them): C-Mixup refuses class indices. Accepts anything by default."""
        del target

    def parameters(self):
        """The regularizer's own trainable parameters (AutoMix's Mix Block), which the optimizer that steps
        the model must hold: ``SGD([*model.parameters(), *mix.parameters()], ...)``; none by default (the
        app and the trainer adapters add them for every mixer)."""
        return iter(())

    def parameter_options(self) -> dict:
        """The optimizer options :meth:`parameters` take beside the model's (AutoMix's ``block_lr``): one
        more parameter group, the model's options where these say nothing; none by default."""
        return {}

    def span(self, steps: int) -> None:
        """Told, before training, the optimizer steps the whole run will take, for a method whose schedule
        spans the run (AutoMix's momentum copy: its ``total_steps``, where not given); nothing by default.
        The app calls it on every member (its ``trainer.epochs`` times the steps of an epoch)."""
        return None

    def use_targets(self, target: torch.Tensor) -> None:
        """The labels of the next training forward, for a method that needs them to mix (gradient
        saliency); the others ignore them. Call it before every forward, as the app's loop does: labels
        are used for one forward only, so a method that needs them never mixes with stale ones."""
        del target  # needed by none of the methods by default


def members(hook: MixingHook) -> list:
    """``hook`` and, for a :class:`~mixhook.OneOf`, its mixers (recursively), breadth first."""
    tree = [hook]
    for h in tree:
        tree.extend(getattr(h, "mixers", ()))
    return tree


_MIXING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its mixing regularizer


def mixing_of(model: nn.Module) -> MixingHook | None:
    """The mixing regularizer attached to ``model`` (a :class:`~mixhook.OneOf` for its mixers), if any."""
    return _MIXING.get(model)


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

"""The one attach/remove mechanism that every regularizer and probe shares.

A :class:`LayerHook` is "a hook of some kind on some named layers". ``attach(model)`` resolves the layer
names (see :mod:`mixhook.layers`), lets the subclass register its PyTorch hooks once, and returns a
:class:`HookHandle`. The handle removes exactly what was registered, is idempotent, and is a context
manager, so no hook outlives its ``with`` block, exception or not. Hooks stay registered while attached
and are gated by state (``model.training``), never added and removed per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import recompute
from .copies import own
from .layers import ResolvedLayers, normalize_layers, resolve_layers
from .layers.specs import written_site
from .sites import BatchDims, Site, check_per_layer, parse_site


def own_generator(generator: torch.Generator | None) -> torch.Generator:
    """The generator a regularizer draws from: the one given, or a CPU generator seeded from
    ``torch.initial_seed()`` (so ``torch.manual_seed(s)`` makes runs reproducible without consuming the
    global random stream; under ``torch.distributed`` see :func:`seed_for_rank`)."""
    if generator is None:
        return torch.Generator().manual_seed(torch.initial_seed())
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return generator


_DISTRIBUTED = dist.is_available()


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s default generator, from the seed every rank started with: rank 0
    keeps ``seed`` (a one-process run draws what rank 0 of a job draws), rank ``r`` takes
    ``(seed + r * 0x9E3779B97F4A7C15) mod 2**64``."""
    return (seed + rank * 0x9E3779B97F4A7C15) % 2**64


def seed_for_rank(generator: torch.Generator) -> bool:
    """Under an initialised ``torch.distributed`` process group, reseed ``generator`` (a regularizer's
    default generator) for this rank (:func:`rank_seed`), so that ranks do not all draw the same mixes;
    returns whether it was done (``False``: not distributed yet; ask again at the next forward)."""
    if not _DISTRIBUTED or not dist.is_initialized():
        return False
    rank = dist.get_rank()
    if rank:
        generator.manual_seed(rank_seed(generator.initial_seed(), rank))
    return True


class Planned:
    """A hook's setting that what it works out when attached depends on (which hops a forward takes, the
    sites' layouts, the padding-mask hooks): read as a plain attribute (no function call per read), set
    freely while the hook is detached; set to another value while it is attached, refused in one line,
    since the plans made from the old value would otherwise go on silently."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __set__(self, hook, value) -> None:
        state = hook.__dict__
        if state.get("_model") is not None and self.name in state and _differs(state[self.name], value):
            raise RuntimeError(
                f"{type(hook).__name__}.{self.name} was planned on when it was attached: set it before "
                f"attach() (remove the handle, set {self.name}, attach again)"
            )
        state[self.name] = value


def _differs(old, new) -> bool:
    """Whether a setting's new value is another than its old one (values that cannot be compared differ)."""
    try:
        return bool(old != new)
    except Exception:  # noqa: BLE001  (a tensor of several values, say)
        return old is not new


class StateError(ValueError):
    """A state dict that does not belong to this hook (another class, other layers, other parts)."""


def check_state(hook, state, keys: tuple[str, ...] = ()) -> None:
    """Refuse, in one line, a ``state`` that :meth:`LayerHook.state_dict` of ``hook`` did not write: not
    a mapping, another class, another layer list, or missing ``keys``."""
    kind = type(hook).__name__
    if not isinstance(state, Mapping):
        raise StateError(
            f"{kind}.load_state_dict() needs the dict state_dict() returned, got {type(state).__name__}"
        )
    if state.get("type") != kind:
        raise StateError(f"{kind}.load_state_dict(): the state is a {state.get('type')!r}'s, not a {kind}'s")
    layers = list(getattr(hook, "specs", ()))
    if "layers" in state and list(state["layers"]) != layers:
        raise StateError(
            f"{kind}.load_state_dict(): the state is for layers {list(state['layers'])}, this {kind} has "
            f"{layers}"
        )
    missing = [k for k in keys if k not in state]
    if missing:
        raise StateError(f"{kind}.load_state_dict(): the state has no {', '.join(missing)}")
    rank = _rank()
    if "rank" in state and rank is not None and int(state["rank"]) != rank:
        raise StateError(
            f"{kind}.load_state_dict(): the state is rank {int(state['rank'])}'s and this process is rank "
            f"{rank}: each rank draws from its own stream, so save each rank's state under its own key "
            "(e.g. f'mixup.rank{rank}' in a torch.distributed.checkpoint) or in its own file"
        )


def _rank() -> int | None:
    """This process's rank under an initialised ``torch.distributed`` process group, else ``None``."""
    return dist.get_rank() if _DISTRIBUTED and dist.is_initialized() else None


def without_rank(state):
    """``state`` (a hook's :meth:`LayerHook.state_dict`, nested ones included) without the rank it was
    saved on, for a loader that draws each rank's stream anew anyway (an adapter that reseeds every step
    from the seed, the rank and the step): any rank may then load it."""
    if isinstance(state, Mapping):
        return {k: without_rank(v) for k, v in state.items() if k != "rank"}
    if isinstance(state, list):
        return [without_rank(v) for v in state]
    return state


class HookHandle:
    """What :meth:`LayerHook.attach` returns: ``.remove()`` it, or use it as a context manager."""

    def __init__(self, handles: list[RemovableHandle], on_remove: Callable[[], None] | None = None):
        self._handles = handles
        self._on_remove = on_remove

    @property
    def attached(self) -> bool:
        """True until :meth:`remove` has run."""
        return self._on_remove is not None or bool(self._handles)

    def remove(self) -> None:
        """Remove every hook this handle registered. Calling it again does nothing."""
        handles, self._handles = self._handles, []
        on_remove, self._on_remove = self._on_remove, None
        for handle in handles:
            handle.remove()
        if on_remove is not None:
            on_remove()

    def __getstate__(self) -> dict:
        """A copy of a handle (of an object holding one, pickled or deep-copied) removes nothing: the
        hooks it would remove are not copied with it (:mod:`mixhook.copies`)."""
        return {"_handles": [], "_on_remove": None}

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


class LayerHook:
    """Base class: hooks of some kind on the named layers of one model at a time.

    Subclasses implement :meth:`_register`, which registers PyTorch hooks on the resolved modules and
    appends their handles to the list it is given (so that a failure half-way removes what was
    registered), and may override :meth:`_reset` to drop per-model state on removal.

    Args:
        layer: a module name as ``model.named_modules()`` spells it, ``"input"`` for the model's input,
            a portable spec (``"stage:2"``, ``"block:-1"``, ``"depth:0.5"``) or a pattern (``"blocks[2:6]"``,
            ``"layers.*.mlp"``), or a list of these (see :mod:`mixhook.layers`); each may carry a selector
            (``"lstm[0]"``, see :mod:`mixhook.sites`). Resolved at each :meth:`attach`: :attr:`specs` keeps
            them as written, :attr:`layers` is the real site specs while attached (the specs otherwise).
        batch_dim: the batch dimension of the tensors acted on, where mixhook cannot find it itself
            (see :class:`~mixhook.sites.BatchDims`): an int for every layer, or a dict from layer spec to
            int. ``None`` (default): found from the modules' ``batch_first`` or PyTorch's convention.
    """

    # Attributes that belong to one attachment (or one forward), not to the hook's configuration or
    # random state: a copy (deepcopy, pickle) leaves them out and starts detached (:meth:`_fresh`).
    _TRANSIENT: ClassVar[tuple[str, ...]] = (
        "_model", "_handle", "_dims", "_tracker", "layers", "sites", "_written"
    )  # fmt: skip
    # Whether the hook registers a hook of its own on the model itself (activation-checkpoint replay then
    # needs no extra one: mixhook.recompute.Tracker).
    _hooks_model: ClassVar[bool] = False

    def __init__(self, layer: str | Sequence[str], batch_dim: int | dict | None = None):
        self.specs: tuple[str, ...] = normalize_layers(layer)
        self.batch_dim = _check_batch_dim(batch_dim, self.specs)
        self._fresh()

    def _fresh(self) -> None:
        """Set the per-attachment attributes (``_TRANSIENT``) of a hook that is not attached."""
        self._model: nn.Module | None = None
        self._handle: HookHandle | None = None
        self._dims: dict[str, BatchDims] = {}
        self._tracker: recompute.Tracker | None = None
        self._bind(None)

    def _bind(self, resolved: ResolvedLayers | None) -> None:
        """Act on the layers ``resolved`` on the model being attached to, or (``None``) on the specs as
        written: :attr:`layers` and :attr:`sites` follow, and ``_written`` maps a resolved site back to
        its spec (per-layer arguments are given by spec: :meth:`_per_layer`)."""
        if resolved is None:
            self.layers: tuple[str, ...] = self.specs
            self.sites: dict[str, Site] = {spec: written_site(spec) for spec in self.specs}
            self._written: dict[str, str] = {}
        else:
            self.layers = tuple(resolved)
            self.sites = {name: parse_site(name) for name in self.layers}
            self._written = dict(resolved.written)

    @property
    def resolved(self) -> dict[str, tuple[str, ...]]:
        """Each spec as written mapped to the real site specs it resolved to on the model this is attached
        to (``{"stage:2": ("layer2",), "blocks[0:2]": ("blocks.0", "blocks.1")}``); empty when detached."""
        if self._model is None:
            return {}
        out: dict[str, tuple[str, ...]] = {spec: () for spec in self.specs}
        for name in self.layers:
            spec = self._written.get(name, name)
            out[spec] = (*out[spec], name)
        return out

    def _per_layer(self, value, spec: str):
        """A per-layer argument's value (``batch_dim``, ``layout``: one for all, or a dict by written spec)
        at the resolved site ``spec``."""
        if isinstance(value, dict):
            return value.get(self._written.get(spec, spec))
        return value

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickle, a spawned worker) of a hook is detached: it keeps the
        configuration and the random state (the same draws follow), never the model or its hooks (a copy
        of the model drops them too: :mod:`mixhook.copies`). Attach it to a model to use it."""
        transient = {name for cls in type(self).__mro__ for name in vars(cls).get("_TRANSIENT", ())}
        return {k: v for k, v in self.__dict__.items() if k not in transient}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fresh()

    def _draw_from(self, generator: torch.Generator | None) -> None:
        """Set ``self.generator`` (:func:`own_generator`), for a hook that draws at random; one made by
        default is reseeded per rank at the first draw (:meth:`_seed_for_rank`)."""
        self.generator = own_generator(generator)
        self._per_rank = generator is None

    @property
    def seed_per_rank(self) -> bool:
        """Whether a generator the hook made itself (none was given) is reseeded for this process's rank
        at its first draw once ``torch.distributed`` is up, so that ranks draw differently. An adapter
        that seeds the generators itself with the rank in the seed (every step, as
        :func:`mixhook.integrations.draws.reseed` does) sets it ``False``."""
        return bool(getattr(self, "_per_rank", False))

    @seed_per_rank.setter
    def seed_per_rank(self, value: bool) -> None:
        self._per_rank = bool(value)

    def _seed_for_rank(self) -> None:
        """Before a draw: reseed a default generator for this rank once ``torch.distributed`` is up."""
        if self._per_rank and seed_for_rank(self.generator):
            self._per_rank = False

    def state_dict(self) -> dict:
        """What a checkpoint needs to continue this hook exactly where it is: its class and layers (checked
        on loading) and, for a hook that draws at random, its generator's state (subclasses add theirs):
        loaded into a hook of the same class and layers, the same draws follow, so a resumed run continues
        bit for bit. Tensors, strings and lists only, so ``torch.load(weights_only=True)`` reads it; save it
        with your own checkpoint (``torch.save({"model": ..., "mixup": mix.state_dict()})``). A ``pin()``
        not yet used by a forward is not part of it. Under ``torch.distributed`` it records the rank, and
        another rank's state is refused on loading (in one line; a checkpoint that keeps one copy of what
        every rank saves under one key would otherwise hand one rank's stream to all)."""
        state = {"type": type(self).__name__, "layers": list(self.specs)}
        if "generator" in self.__dict__:
            state.update(generator=self.generator.get_state(), per_rank=self._per_rank)
            rank = _rank()
            if rank is not None:  # each rank's stream is its own: loading it on another rank is refused
                state["rank"] = rank
        return state

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from :meth:`state_dict`; a state of another class or layer list is refused in one line
        (:class:`StateError`, a ``ValueError``)."""
        draws = "generator" in self.__dict__
        check_state(self, state, ("generator",) if draws else ())
        if draws:
            self.generator.set_state(state["generator"])
            self._per_rank = bool(state.get("per_rank", False))

    @property
    def _layer_spec(self) -> str | list[str]:
        """The layer spec as the user wrote it: one name, or a list (for ``__repr__``)."""
        return self.specs[0] if len(self.specs) == 1 else list(self.specs)

    @property
    def model(self) -> nn.Module | None:
        """The model this is attached to, or ``None``."""
        return self._model

    def attach(self, model: nn.Module) -> HookHandle:
        """Register the hooks on ``model`` and return the handle that removes them.

        Raises :class:`~mixhook.layers.UnknownLayerError` for a layer the model does not have, and
        ``RuntimeError`` if this object is already attached (to this model or another one).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"attach() needs an nn.Module, got {type(model).__name__}")
        if self._model is not None:
            raise RuntimeError(
                f"{type(self).__name__} is already attached to a {type(self._model).__name__}; "
                "remove that handle first, or create a second instance"
            )
        modules = resolve_layers(model, self.specs)
        self._check_attach(model)
        handles: list[RemovableHandle] = []
        tracker = recompute.acquire(model, self._hooks_model)
        self._bind(modules)  # (each attach resolves the specs again: they follow the model)
        try:
            self._dims = {
                spec: BatchDims(model, self.sites[spec], self._explicit(spec)) for spec in self.layers
            }
            self._register(model, modules, handles)
            for handle in handles:
                own(handle)  # a copy of the model drops them (mixhook.copies)
        except BaseException:
            for handle in handles:
                handle.remove()
            recompute.release(model, tracker)
            self._reset()  # nothing of a failed attach stays (a mixer's claim on the model included)
            self._bind(None)
            raise
        self._model, self._tracker = model, tracker
        self._handle = HookHandle(handles, on_remove=self._detach)
        return self._handle

    def remove(self) -> None:
        """Remove this object's hooks from the model it is attached to (no-op when not attached)."""
        if self._handle is not None:
            self._handle.remove()

    def _detach(self) -> None:
        if self._tracker is not None:
            recompute.release(self._model, self._tracker)
        self._model = None
        self._handle = None
        self._tracker = None
        self._dims = {}  # (each holds the model's modules)
        self._reset()
        self._bind(None)

    def _check_attach(self, model: nn.Module) -> None:
        """Refuse to attach to ``model`` (before anything is registered); nothing by default."""

    def _explicit(self, spec: str) -> int | None:
        return self._per_layer(self.batch_dim, spec)

    def _note(self, spec: str, payload: object = None) -> None:
        """Inside a recomputable region of a training forward, remember what a recomputation must redo:
        ``payload``, or what it returns when it is a function (computed only there). An eval forward
        notes nothing (no hook acts on it at random)."""
        if self._tracker is not None and self._training and recompute.may_be_recomputed():
            self._tracker.note(self, spec, payload() if callable(payload) else payload)

    def _replayed(self, spec: str) -> object:
        """During backward (a recomputation): what the forward noted at ``spec``."""
        return self._tracker.replay(self, spec, type(self).__name__, lenient=not self._training)

    def _register(
        self, model: nn.Module, modules: dict[str, nn.Module], handles: list[RemovableHandle]
    ) -> None:
        raise NotImplementedError

    def _reset(self) -> None:
        """Drop per-forward state when the hooks are removed."""

    @property
    def _training(self) -> bool:
        return self._model is not None and self._model.training


def guard_unwrapped(hook, model: nn.Module, handles: list[RemovableHandle], verb: str = "mixed") -> None:
    """Where ``model`` wraps another that it runs inside its forward (a PEFT ``PeftModel``: its
    ``get_base_model()``), refuse in one line a training forward of the inner model that does not go
    through ``model``: ``merge_and_unload()`` and ``unload()`` return the inner model, on which ``hook``'s
    model-level hooks (on ``model``) would never run, so nothing would be ``verb``. Whether a call of the
    inner model is inside ``model``'s forward is counted by hooks of the guard's own on ``model`` (the one
    that leaves runs even when the forward raises: a failed forward leaves no stale "inside")."""
    get = getattr(model, "get_base_model", None)
    if not callable(get) or not hasattr(model, "peft_config"):
        return
    inner = get()
    if not isinstance(inner, nn.Module) or inner is model:
        return
    kind, outer = type(hook).__name__, type(model).__name__
    inside = [0]  # the calls of model's forward under way (a forward may call the model again)

    def enter(module: nn.Module, args) -> None:
        inside[0] += 1

    def leave(module: nn.Module, args, output) -> None:
        inside[0] -= 1

    def check(module: nn.Module, args) -> None:
        if module.training and torch.is_grad_enabled() and not inside[0]:
            raise RuntimeError(
                f"{kind}: {type(module).__name__} was called on its own, not through the {outer} {kind} is "
                f"attached to (merge_and_unload() and unload() return it), so nothing would be {verb}; "
                f"attach {kind} to the model you train"
            )

    handles.append(model.register_forward_pre_hook(enter))
    handles.append(model.register_forward_hook(leave, always_call=True))
    handles.append(inner.register_forward_pre_hook(recompute.hook(check)))  # (not in a recomputation)


def _check_batch_dim(batch_dim, specs: tuple[str, ...]):
    def valid(d) -> bool:
        return isinstance(d, int) and not isinstance(d, bool) and d >= 0

    expected = "a non-negative int or a dict from layer spec to one"
    return check_per_layer("batch_dim", batch_dim, specs, valid, expected, mapping=dict)

"""The one attach/remove mechanism that every regularizer and probe shares.

A :class:`LayerHook` is "a hook of some kind on some named layers". ``attach(model)`` resolves the layer
names (see :mod:`mixhook.layers`), lets the subclass register its PyTorch hooks once, and returns a
:class:`HookHandle`. The handle removes exactly what was registered, is idempotent, and is a context
manager, so no hook outlives its ``with`` block, exception or not. Hooks stay registered while attached
and are gated by state (``model.training``), never added and removed per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import recompute
from .layers import normalize_layers, resolve_layers
from .sites import BatchDims, Site, parse_site


def own_generator(generator: torch.Generator | None) -> torch.Generator:
    """The generator a regularizer draws from: the one given, or a CPU generator seeded from
    ``torch.initial_seed()`` (so ``torch.manual_seed(s)`` makes runs reproducible without consuming the
    global random stream)."""
    if generator is None:
        return torch.Generator().manual_seed(torch.initial_seed())
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return generator


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
            or a list of such names; each may carry a selector (``"lstm[0]"``, see :mod:`mixhook.sites`).
        batch_dim: the batch dimension of the tensors acted on, where mixhook cannot find it itself
            (see :class:`~mixhook.sites.BatchDims`): an int for every layer, or a dict from layer spec to
            int. ``None`` (default): found from the modules' ``batch_first`` or PyTorch's convention.
    """

    def __init__(self, layer: str | Sequence[str], batch_dim: int | dict | None = None):
        self.layers: tuple[str, ...] = normalize_layers(layer)
        self.sites: dict[str, Site] = {spec: parse_site(spec) for spec in self.layers}
        self.batch_dim = _check_batch_dim(batch_dim, self.layers)
        self._model: nn.Module | None = None
        self._handle: HookHandle | None = None
        self._dims: dict[str, BatchDims] = {}
        self._tracker: recompute.Tracker | None = None

    @property
    def _layer_spec(self) -> str | list[str]:
        """The layer spec as the user wrote it: one name, or a list (for ``__repr__``)."""
        return self.layers[0] if len(self.layers) == 1 else list(self.layers)

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
        modules = resolve_layers(model, self.layers)
        self._check_attach(model)
        handles: list[RemovableHandle] = []
        tracker = recompute.acquire(model)
        try:
            self._dims = {
                spec: BatchDims(model, self.sites[spec], self._explicit(spec)) for spec in self.layers
            }
            self._register(model, modules, handles)
        except BaseException:
            for handle in handles:
                handle.remove()
            recompute.release(model, tracker)
            self._reset()  # nothing of a failed attach stays (a mixer's claim on the model included)
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
        self._reset()

    def _check_attach(self, model: nn.Module) -> None:
        """Refuse to attach to ``model`` (before anything is registered); nothing by default."""

    def _explicit(self, spec: str) -> int | None:
        if isinstance(self.batch_dim, dict):
            return self.batch_dim.get(spec)
        return self.batch_dim

    def _note(self, spec: str, payload: object = None) -> None:
        """Inside a recomputable region, remember what a recomputation must redo: ``payload``, or what
        it returns when it is a function (computed only there)."""
        if self._tracker is not None and recompute.may_be_recomputed():
            self._tracker.note(self, spec, payload() if callable(payload) else payload)

    def _replayed(self, spec: str) -> object:
        """During backward (a recomputation): what the forward noted at ``spec``."""
        return self._tracker.replay(self, spec, type(self).__name__)

    def _register(
        self, model: nn.Module, modules: dict[str, nn.Module], handles: list[RemovableHandle]
    ) -> None:
        raise NotImplementedError

    def _reset(self) -> None:
        """Drop per-forward state when the hooks are removed."""

    @property
    def _training(self) -> bool:
        return self._model is not None and self._model.training


def _check_batch_dim(batch_dim, specs: tuple[str, ...]):
    def valid(d) -> bool:
        return isinstance(d, int) and not isinstance(d, bool) and d >= 0

    if batch_dim is None or valid(batch_dim):
        return batch_dim
    if isinstance(batch_dim, dict):
        unknown = sorted(set(batch_dim) - set(specs))
        if unknown:
            raise ValueError(f"batch_dim names layers {unknown} that are not among {list(specs)}")
        bad = {k: v for k, v in batch_dim.items() if not valid(v)}
        if not bad:
            return dict(batch_dim)
    raise ValueError(
        f"batch_dim must be a non-negative int or a dict from layer spec to one, got {batch_dim!r}"
    )

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

from .layers import normalize_layers, resolve_layers


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
            or a list of such names.
    """

    def __init__(self, layer: str | Sequence[str]):
        self.layers: tuple[str, ...] = normalize_layers(layer)
        self._model: nn.Module | None = None
        self._handle: HookHandle | None = None

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
        handles: list[RemovableHandle] = []
        try:
            self._register(model, modules, handles)
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        self._model = model
        self._handle = HookHandle(handles, on_remove=self._detach)
        return self._handle

    def remove(self) -> None:
        """Remove this object's hooks from the model it is attached to (no-op when not attached)."""
        if self._handle is not None:
            self._handle.remove()

    def _detach(self) -> None:
        self._model = None
        self._handle = None
        self._reset()

    def _register(
        self, model: nn.Module, modules: dict[str, nn.Module], handles: list[RemovableHandle]
    ) -> None:
        raise NotImplementedError

    def _reset(self) -> None:
        """Drop per-forward state when the hooks are removed."""

    @property
    def _training(self) -> bool:
        return self._model is not None and self._model.training

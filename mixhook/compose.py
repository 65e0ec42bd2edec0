"""Attaching several hooks at once (:func:`attach`)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .engine.contract import MixingHook
from .hooks import HookHandle, LayerHook


def mixers_of(hooks: Sequence) -> list[MixingHook]:
    """The mixing regularizers among ``hooks`` (:class:`~mixhook.mixers.MixingHook`; a
    :class:`~mixhook.OneOf` counts as one)."""
    return [h for h in hooks if isinstance(h, MixingHook)]


def attach(model: nn.Module, *hooks: LayerHook) -> HookHandle:
    """Attach several regularizers and probes to ``model``; return one handle that removes them all.

    At most one mixing regularizer may be among them (two would both mix every batch): combine several
    with :class:`~mixhook.OneOf`. If any attach fails, those already attached are removed before the error
    propagates.
    """
    mixing = mixers_of(hooks)
    if len(mixing) > 1:
        names = ", ".join(type(m).__name__ for m in mixing)
        raise ValueError(
            f"attach() got {len(mixing)} mixing regularizers ({names}), which would each mix every batch "
            "and leave no single loss; combine them with OneOf([...]) to use one per batch"
        )
    handles: list[HookHandle] = []
    try:
        for hook in hooks:
            if not callable(getattr(hook, "attach", None)):
                raise TypeError(
                    f"attach() takes hooks with an attach(model) method, got {type(hook).__name__}"
                )
            handles.append(hook.attach(model))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return HookHandle([], on_remove=lambda: [h.remove() for h in reversed(handles)])

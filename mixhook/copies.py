"""What a copy of a hooked model gets: a clean model, without mixhook's hooks.

``copy.deepcopy(model)`` (timm's ``ModelEmaV2``/``V3``, ``torch.optim.swa_utils.AveragedModel``),
``pickle.dumps(model)``, ``torch.save(model)`` and sending a model to spawned workers copy its hook
dictionaries with it. A copied hook would still call the *original* regularizer (deepcopy keeps
functions as they are) or fail to pickle (a closure). So every PyTorch hook mixhook registers on a
module is an :class:`OwnedHook`, which a copy turns into :func:`detached_hook`: it does nothing and, at
its first call, removes itself from the copied module. The copy then computes exactly what the model
without hooks computes (an EMA's evaluation, ``update_bn``'s batch-norm statistics), and nothing it runs
touches the original's regularizers; to regularize a copy, attach a regularizer to it. A regularizer
that is itself copied (``copy.deepcopy``, pickle) comes detached too: see
:meth:`mixhook.hooks.LayerHook.__getstate__`.

A regularizer's ``torch.Generator`` travels to spawned workers (``torch.multiprocessing`` spawn,
Lightning's ``ddp_spawn``) by its state: torch's own reduction of a generator fails to unpickle there
("unable to resize file"), so importing mixhook registers one with ``multiprocessing``'s pickler
(:func:`_reduce_generator`; plain ``pickle`` and ``copy`` are unchanged).
"""

from __future__ import annotations

import copy
import functools
from multiprocessing.reduction import ForkingPickler

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .sharding import fsdp_modules

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def detached_hook(module, *args, **kwargs) -> None:
    """What a mixhook hook becomes in a copy of the model: nothing, and gone after its first call.

    PyTorch iterates a snapshot of the hooks, so removing entries during the call is safe. Traced by
    torch.compile it only does nothing (a traced removal from the module's hook dicts would break the
    graph, and ``fullgraph=True`` with it); the copy's first eager call removes it."""
    if isinstance(module, nn.Module) and not torch.compiler.is_compiling():
        gone = [key for key, hook in module._forward_pre_hooks.items() if hook is detached_hook]
        gone += [key for key, hook in module._forward_hooks.items() if hook is detached_hook]
        for name in _HOOK_DICTS:
            hooks = getattr(module, name, None)
            if hooks is not None:
                for key in gone:
                    hooks.pop(key, None)
    return None


class OwnedHook(functools.partial):
    """A hook registered by mixhook: calls the function it wraps (a ``functools.partial`` with no bound
    arguments, so the call costs nothing in Python); its copies are :func:`detached_hook`."""

    __slots__ = ()

    def __deepcopy__(self, memo):
        return detached_hook

    def __copy__(self):
        return self

    def __reduce__(self):
        return (_detached, ())


def _detached():
    return detached_hook


def own(handle) -> None:
    """Make the hook behind ``handle`` (a ``RemovableHandle`` from ``register_*hook``) an
    :class:`OwnedHook`, so that copies of the module it is registered on drop it."""
    if not isinstance(handle, RemovableHandle):
        return
    hooks = handle.hooks_dict_ref()
    if hooks is not None and handle.id in hooks and not isinstance(hooks[handle.id], OwnedHook):
        hooks[handle.id] = OwnedHook(hooks[handle.id])


def whole_copy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``; of a model sharded by FSDP2 (``fully_shard``, whose modules refuse a deep
    copy), a copy of plain modules: each sharded module of its own class without FSDP's, without FSDP's
    state and hooks (its other hooks copied as a deep copy copies them), each parameter whole and its own
    (gathered from the shards: every rank must call this at once). The copy's forwards need no other rank.
    """
    sharded = fsdp_modules(model)
    if not sharded:
        return copy.deepcopy(model)
    from torch.distributed.fsdp import FSDPModule

    memo: dict = {}
    for p in model.parameters():
        if hasattr(p, "full_tensor"):
            memo[id(p)] = nn.Parameter(p.full_tensor().detach().clone(), requires_grad=p.requires_grad)
    # each sharded module made anew, of its own class, from its state less FSDP's: children before their
    # parents, each in the memo before its state is copied, so the deep copy finds them all made
    for module in reversed(sharded):
        plain = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
        made = memo[id(module)] = plain.__new__(plain)
        made.__setstate__(copy.deepcopy(_without_fsdp(module.__getstate__()), memo))
    return copy.deepcopy(model, memo)


def _without_fsdp(state: dict) -> dict:
    """A sharded module's ``__dict__`` less FSDP's: its state (the composable API's keys, which hold the
    process group) and its hooks (its state's forward hooks, its parameters' load hooks)."""
    fsdp_ids = {
        key
        for name in ("_forward_pre_hooks", "_forward_hooks")
        for key, hook in state.get(name, {}).items()
        if _is_fsdps(hook)
    }
    out = {}
    for name, value in state.items():
        if name.startswith("__composable_api_state_key"):  # (torch.distributed._composable.contract)
            continue
        if name.endswith("hooks") or name in _HOOK_DICTS:
            value = type(value)((k, v) for k, v in value.items() if k not in fsdp_ids and not _is_fsdps(v))
        out[name] = value
    return out


def _is_fsdps(hook) -> bool:
    """Whether a hook is FSDP's own (its state's forward hooks, its parameters' load hooks)."""
    return "FSDP" in getattr(hook, "__qualname__", "") or type(
        getattr(hook, "__self__", None)
    ).__name__.startswith("FSDP")


def _rebuild_generator(device: torch.device, state: bytes) -> torch.Generator:
    generator = torch.Generator(device)
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


def _reduce_generator(generator: torch.Generator):
    """A generator sent to another process: its device and its state (its seed and its place in the
    stream) as bytes. Not as a tensor: multiprocessing would share the temporary state tensor's memory,
    which is freed before the worker opens it (what breaks torch's own reduction)."""
    return _rebuild_generator, (generator.device, bytes(generator.get_state().tolist()))


ForkingPickler.register(torch.Generator, _reduce_generator)

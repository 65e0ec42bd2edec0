"""What a hook keeps: every tensor reachable from it, by the attribute it hangs from.

:func:`kept` walks the objects a regularizer references (``gc.get_referents``: attributes, containers,
closures, dataclass records), as the garbage collector would see them kept alive, and stops at what is not
the hook's: classes, Python modules, a function's globals, generators (their state is read apart), and the
modules named in ``stop`` (the model a hook is attached to: referencing it while attached is the hook's
job). The hook's own ``nn.Module`` objects (AutoMix's Mix Block and momentum copy) are walked: their
parameters and buffers are its learned state, anything else they hold is not. The benchmark's memory case
reports the bytes per attribute and the tests (tests/engine/test_retention.py) hold the contract with it:
nothing with a ``grad_fn`` between steps, nothing of the model after ``remove()``, nothing that grows with
the steps or, beside ``.last`` and ``pin_last``'s record, with the batch.
"""

from __future__ import annotations

import collections
import gc
import types
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from mixhook.engine.path import Path

RECORDS = ("last", "last_forward")
"""The attributes whose size follows the batch by design: ``.last`` (what the last training forward mixed,
documented per method) and the record ``pin_last`` repeats (the last forward's draws and what its method
computed before the mix), both dropped when the next training forward begins."""


@dataclass
class Kept:
    """The tensors reachable from a hook: bytes per attribute (each storage counted once, under the first
    attribute it was reached from), the learned state's bytes (parameters and buffers of the hook's own
    modules), the tensors that carry a ``grad_fn`` and the model's modules reached (both by path), and each
    tensor's path and ``id`` (no reference: a record of what was kept keeps nothing alive itself)."""

    bytes: dict[str, int] = field(default_factory=dict)
    learned: int = 0
    graph: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    tensors: list[tuple[str, int]] = field(default_factory=list)
    records: set[int] = field(default_factory=set)  # the ids of the tensor objects under RECORDS

    def total(self, records: bool = True) -> int:
        """The bytes kept beside the learned state (``records=False``: beside :data:`RECORDS` too)."""
        return sum(n for name, n in self.bytes.items() if records or name not in RECORDS)


# not walked into: classes, Python modules, generators (their state is read apart), weak references
_NOT_WALKED = (
    type,
    types.ModuleType,
    torch.Generator,
    weakref.ref,
    weakref.ProxyType,
    weakref.CallableProxyType,
)


def _children(obj) -> Iterable:
    """What ``obj`` keeps alive, for the walk: a function's closure, defaults and attributes (not its
    globals); a bound method's object and function; anything else's referents."""
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        return [*cells, obj.__defaults__, obj.__kwdefaults__, obj.__dict__]
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    return gc.get_referents(obj)


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def _hook_attributes(obj) -> dict | None:
    """The ``__dict__`` of a hook-like object (anything with ``_fresh``: a LayerHook) or of a mixer's path
    (:class:`~mixhook.engine.path.Path`, which holds the attachment's state: ``last``, ``last_forward``),
    whose keys name what hangs from it; ``None`` for other objects."""
    hook_like = hasattr(type(obj), "_fresh") or isinstance(obj, Path)
    return vars(obj) if hook_like and hasattr(obj, "__dict__") else None


def kept(root, stop: Iterable[nn.Module] = ()) -> Kept:
    """What ``root`` (a hook) keeps reachable; ``stop``: modules not to walk into (the model's), reported
    in :attr:`Kept.modules` when reached."""
    stopped = {id(m) for m in stop}
    seen, found, own_modules, reached = {id(root)}, [], [], []
    # (object, attribute, path), breadth first: a storage two attributes share is counted under the first
    # the hook sets (``last`` before ``last_forward``), by its shortest path
    queue: collections.deque[tuple[object, str, str]] = collections.deque([(root, "", "")])
    while queue:
        obj, attribute, path = queue.popleft()
        if id(obj) in stopped:
            reached.append(path)
            continue
        if isinstance(obj, _NOT_WALKED):
            continue
        if isinstance(obj, torch.Tensor):
            found.append((attribute, path, obj))
            base = obj._base  # (a view keeps its base alive from C++, where the garbage collector sees none)
            if base is not None and id(base) not in seen:
                seen.add(id(base))
                queue.append((base, attribute, f"{path}._base"))
            continue
        if isinstance(obj, nn.Module):
            own_modules.append(obj)
        queue.extend(_next(obj, attribute, path, seen))
    learned = {id(t) for m in own_modules for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    out, storages = Kept(modules=reached), set()
    for attribute, path, t in found:
        if attribute in RECORDS:
            out.records.add(id(t))
        _count(out, t, attribute, path, id(t) in learned, storages)
    return out


def _next(obj, attribute: str, path: str, seen: set) -> list[tuple[object, str, str]]:
    """What the walk visits after ``obj`` (reached under ``attribute`` by ``path``), not seen before: a
    hook's attributes each under its own name, anything else under ``attribute``."""
    attributes, out = _hook_attributes(obj), []
    for child in _children(obj):
        if child is None or id(child) in seen or isinstance(child, str | int | float | bool):
            continue
        seen.add(id(child))
        if attributes is not None and child is attributes:
            for key, value in attributes.items():  # (named by the nearest hook's attribute)
                if value is not None and id(value) not in seen:
                    seen.add(id(value))
                    out.append((value, key, f"{path}.{key}"))
            continue
        out.append((child, attribute, f"{path}/{type(child).__name__}"))
    return out


def _count(out: Kept, t: torch.Tensor, attribute: str, path: str, learned: bool, storages: set) -> None:
    if t.grad_fn is not None:
        out.graph.append(f"{path} {tuple(t.shape)} ({type(t.grad_fn).__name__})")
    try:
        storage = t.untyped_storage()
        key, size = (storage.data_ptr(), t.device), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # (a tensor without a storage: a fake or sparse one)
        key, size = (id(t), t.device), t.numel() * t.element_size()
    if key in storages:
        return
    storages.add(key)
    if learned:
        out.learned += size
        return
    out.bytes[attribute] = out.bytes.get(attribute, 0) + size
    out.tensors.append((path, id(t)))

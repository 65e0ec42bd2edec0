"""Activation checkpointing: a recomputed forward re-applies exactly what the original forward applied.

``torch.utils.checkpoint`` (both ``use_reentrant`` modes), ``checkpoint_sequential``, timm's
``set_grad_checkpointing()`` and HuggingFace's ``gradient_checkpointing_enable()`` run a block's forward a
second time during backward, and every module hook fires again. A hook that draws at random (a mix's lam,
permutation, box, mask or noise; a per-sample scale) would draw anew, so the recomputed activations, and
with them the gradients, would differ from the forward's (reentrant mode), or the recomputation would
fail (non-reentrant mode). So:

- In a training forward, a hook that acts inside a region that may be recomputed (gradients disabled in a
  training forward: reentrant mode; saved-tensor hooks active: non-reentrant mode) notes what it needs to
  act again (its generator's state before the draw, its pinned values) in this forward's
  :class:`ForwardRecord`.
- When the model's forward returns, every autograd node that forward created is tagged with its record
  (``node.metadata``), so the record lives exactly as long as the graph.
- During backward (:func:`in_backward`), a hook that fires again finds the record of the forward being
  recomputed through the autograd node that backward is executing (``torch._C._current_autograd_node``)
  and replays from it, without touching its own generator. Anything it cannot find is refused in one
  line: never a silently different recomputation.
- A hook removed before the backward of such a forward could not replay anything: the model output's
  autograd node checks, before backward goes past it, that every hook that acted inside a recomputable
  region is still attached, and refuses otherwise.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable

import torch
from torch import nn

from .copies import own
from .sites import leaves


def in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread: a module forward now is a
    recomputation (activation checkpointing). Inside ``torch.compile``'s tracing: False (a compiled
    region recomputes without running Python hooks)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _unknown(ignore_disabled: bool) -> object:
    """An older torch that cannot say which saved-tensor hooks are on: assume some are (the region may be
    checkpointed)."""
    return True


saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", _unknown)
"""``saved_tensor_hooks(False)``: the innermost saved-tensor hooks in effect, ``None`` where none are."""


def may_be_recomputed() -> bool:
    """In a training forward: whether what runs now may be recomputed in backward (activation
    checkpointing): gradients are off (reentrant mode) or saved-tensor hooks are on (non-reentrant)."""
    if torch.compiler.is_compiling():
        return False
    return in_checkpointed_forward()


def in_checkpointed_forward() -> bool:
    """Whether the forward running now is an eager activation checkpoint's: gradients are off (reentrant
    mode) or saved-tensor hooks are on (non-reentrant). :func:`may_be_recomputed` outside a compiled
    region; what a traced frame asks of the eager frame around it (``mixhook.engine.traced``)."""
    return not torch.is_grad_enabled() or saved_tensor_hooks(False) is not None


def hook(act: Callable, again: Callable | None = None) -> Callable:
    """A PyTorch hook function that runs ``act`` in a forward and ``again`` in a recomputation of it by
    activation checkpointing (both with the hook's arguments; ``again=None``: nothing, for a hook that only
    decides, records or refuses, which a recomputation must not do twice). The one place a hook is told
    which of the two it is in: ``act`` notes what a recomputation must redo (:meth:`Tracker.note`, through
    :meth:`~mixhook.hooks.LayerHook._note`) and ``again`` finds it (:meth:`Tracker.replay`)."""

    def dispatch(*args):
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:  # in_backward()
            return None if again is None else again(*args)
        return act(*args)

    return own_code(dispatch, f"{getattr(act, '__name__', 'hook')}_dispatch")


def own_code(fn: Callable, name: str | None = None) -> Callable:
    """``fn`` (a function, or a method bound to its object) with a code object of its own, named ``name``
    (by default its own name): what a hook registered once per attachment needs. torch.compile caches
    compiled frames per code object and counts one object's recompiles against one limit, and a hook on the
    model itself runs as a frame of its own, so hooks sharing one code object (every mixer's bound
    ``_on_model_input``, every closure of one ``def``) would count every hook of every model against it."""
    func = getattr(fn, "__func__", fn)
    name = name or func.__name__
    code = func.__code__.replace(co_name=name, co_qualname=name)
    copy = types.FunctionType(code, func.__globals__, name, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    bound = getattr(fn, "__self__", None)
    return copy if bound is None else types.MethodType(copy, bound)


class RecomputeError(RuntimeError):
    """A recomputation that mixhook cannot make exact: refused instead of silently different."""


class ForwardRecord:
    """What the hooks did in one training forward that a recomputation must do again."""

    def __init__(self):
        self.needed = False
        self.entries: dict[tuple[int, str], object] = {}
        self.calls: dict[tuple[int, str], int] = {}
        self.hooks: dict[int, object] = {}  # the hooks a recomputation needs attached


class Tracker:
    """One per model: keeps a :class:`ForwardRecord` per forward and tags the autograd graph with it when
    the forward returns, through one model hook at the end of each forward. A model that is never
    checkpointed pays nothing: the hook is registered by the first note, and PyTorch still runs it at the
    end of that forward, provided the model had some hook when it was called (a mixer's or a probe's
    own). A hook with none of its own on the model (InputScale, GradScale, GradClip) has it registered at
    once instead (:meth:`ensure`): PyTorch runs no hook of a module that had none when it was called."""

    def __init__(self, model: nn.Module):
        self.key = f"mixhook.record.{id(self)}"
        self.users = 0
        self.record: ForwardRecord | None = None
        self._model = model
        self._handles: list = []

    def ensure(self) -> None:
        """Register the end-of-forward hook (once)."""
        if not self._handles:
            handle = self._model.register_forward_hook(self._end, with_kwargs=True, always_call=True)
            own(handle)  # a copy of the model drops it (mixhook.copies)
            self._handles = [handle]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _end(self, model: nn.Module, args: tuple, kwargs: dict, output) -> None:
        record = self.record
        if record is None or in_backward():  # (a recomputation keeps the record it is replaying)
            return
        self.record = None
        if record.needed:  # the walk stops at the graph that produced the model's inputs
            stop = {t.grad_fn for _, t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            self._tag(output, record, stop)

    def note(self, hook: object, spec: str, payload: object = None) -> None:
        """Inside a recomputable region of a training forward: remember ``payload`` for ``hook`` at
        ``spec`` (``None``: the site ran and did nothing a recomputation must repeat)."""
        self.ensure()
        if self.record is None:
            self.record = ForwardRecord()
        record = self.record
        record.needed = True
        key = (id(hook), spec)
        record.calls[key] = record.calls.get(key, 0) + 1
        if payload is not None and key not in record.entries:
            record.entries[key] = payload
            record.hooks[id(hook)] = hook

    def replay(self, hook: object, spec: str, what: str, lenient: bool = False) -> object:
        """During backward: the payload ``hook`` noted at ``spec`` in the forward being recomputed, or
        ``None`` if it acted on nothing there. Raises :class:`RecomputeError` where it cannot be known;
        ``lenient`` (the model is in eval mode, where no hook acts at random): a forward that noted
        nothing acted on nothing."""
        node = torch._C._current_autograd_node()
        record = node.metadata.get(self.key) if node is not None else None
        if record is None and lenient:
            return None
        if record is None:
            raise RecomputeError(
                f"{what} at {spec!r} ran again during backward (activation checkpointing), but mixhook "
                "cannot find the forward it recomputes (a checkpoint around the whole hooked model in "
                "reentrant mode, or a recomputation outside torch.utils.checkpoint); checkpoint inner "
                "blocks, or use use_reentrant=False"
            )
        key = (id(hook), spec)
        payload = record.entries.get(key)
        if payload is not None and record.calls.get(key, 0) > 1:
            raise RecomputeError(
                f"{what} at {spec!r}: the layer runs {record.calls[key]} times per forward and is "
                "recomputed by activation checkpointing, so mixhook cannot tell which call is being "
                "recomputed; choose a layer that runs once"
            )
        return payload

    def _tag(self, output, record: ForwardRecord, stop: set) -> None:
        stack = [t.grad_fn for _, t in leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn]
        if record.hooks:
            for node in set(stack):
                node.register_prehook(_guard(record))
        seen = set(stop)
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            metadata = node.metadata
            if self.key in metadata:  # an earlier forward's graph: not ours to relabel
                continue
            metadata[self.key] = record
            for child, _ in node.next_functions:
                if child is not None and child not in seen and type(child).__name__ != "AccumulateGrad":
                    stack.append(child)


def _guard(record: ForwardRecord):
    def check(grad_outputs):
        removed = [hook for hook in record.hooks.values() if getattr(hook, "model", None) is None]
        if removed:
            names = ", ".join(sorted({type(h).__name__ for h in removed}))
            raise RecomputeError(
                f"{names} acted inside an activation-checkpointed region of this forward but was removed "
                "before its backward, so the recomputation could not repeat it; call backward() before "
                "removing the hooks (inside the `with` block)"
            )

    return check


_TRACKERS: weakref.WeakKeyDictionary[nn.Module, Tracker] = weakref.WeakKeyDictionary()


def acquire(model: nn.Module, hooks_model: bool = True) -> Tracker:
    """The model's tracker (registered with the first hook that needs it); ``hooks_model``: whether the
    hook has a hook of its own on the model (else the tracker's is registered now, see :class:`Tracker`)."""
    tracker = _TRACKERS.get(model)
    if tracker is None:
        tracker = _TRACKERS[model] = Tracker(model)
    tracker.users += 1
    if not hooks_model:
        tracker.ensure()
    return tracker


def release(model: nn.Module, tracker: Tracker) -> None:
    """Drop one user of the tracker; the last one removes its hooks."""
    tracker.users -= 1
    if tracker.users <= 0:
        tracker.remove()
        if _TRACKERS.get(model) is tracker:
            del _TRACKERS[model]


def generator_state(generator: torch.Generator) -> torch.Tensor:
    return generator.get_state()


def replay_generator(generator: torch.Generator, state: torch.Tensor) -> torch.Generator:
    """A new generator on ``generator``'s device in ``state``: replays the draws without advancing the
    hook's own generator."""
    return torch.Generator(device=generator.device).set_state(state)

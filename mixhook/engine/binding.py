"""Which forward produced these logits: the loss bound to its own forward's mix.

Every output of a forward a mixer saw is marked with that forward's record (its autograd node's
metadata, or, for a tensor without one, a weak reference), so ``loss``/``targets``/``state_for`` find the
mix of the forward that produced their logits, through views and the autograd graph, and refuse in one
line what no one mix applies to (:class:`~mixhook.engine.contract.ForeignLogitsError`).
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass

import torch

from ..sites import leaves as tree_leaves
from .contract import ForeignLogitsError, MixState, kept


@dataclass(slots=True)
class _Mark:
    """What a mixer keeps of one recent forward, of a fixed size whatever the batch and the method: the
    layer it mixed (``None``: nothing) and whether a ``loss``/``targets``/``state_for`` call has claimed
    its output yet."""

    layer: str | None = None
    bound: bool = False


@dataclass(slots=True)
class _Forward:
    """One forward of the model a mixer saw, as its outputs carry it: what it mixed (``state``, ``None``
    when it mixed nothing: the whole :class:`MixState`, its ``loss_inputs`` included) and its
    :class:`_Mark`; for a compiled forward, the layer it was to mix (checked when it is settled). It lives
    as long as the output that carries it (its autograd node's metadata), not in the mixer."""

    state: MixState | None = None
    layer: str | None = None
    mark: _Mark | None = None


_UNMIXED = _Forward(mark=_Mark())  # every forward that mixed nothing (eval, skipped, not drawn): one record


_RECENT = 64  # the forwards a mixer keeps a mark of, to tell whether an unclaimed one mixed
_RECORD_TRACED: list = []  # Forwards.record wrapped by torch.compiler.disable, made when first needed


class Forwards:
    """The recent forwards of the model one mixer is attached to, and what each mixed.

    What it keeps between steps is of a fixed size: a :class:`_Mark` of each of the last 64 forwards (the
    layer mixed, whether claimed) and the latest forward's :class:`MixState` without its ``loss_inputs``
    (what ``targets()`` without logits reads, the mixer's ``.last``). The whole state of a forward, the
    pieces of the autograd graph its method's loss takes included, is carried by that forward's output
    (its autograd node's metadata, or a weak reference to a tensor without one) and freed with it."""

    def __init__(self, owner: object):
        self.recent: collections.deque[_Mark] = collections.deque(maxlen=_RECENT)
        self.latest: MixState | None = None  # what the latest forward mixed, as the mixer keeps it
        self.outputs: dict[int, tuple] = {}  # id(mixed output without autograd) -> (weakref, _Forward)
        self.unmixed: collections.deque = collections.deque(maxlen=_RECENT)  # weakrefs: unmixed outputs
        self.key = f"mixhook.forward.{id(owner)}"  # in grad_fn.metadata: the _Forward of that output
        # the one-graph path (mixhook.engine.traced): the forwards a compiled graph began whose outputs
        # are not marked yet, and the output of the last (stored by dynamo after the graph)
        self.begun: list[_Forward] = []
        self.pending = None

    def record(self, output, state: MixState | None) -> MixState | None:
        """A forward ended with ``output`` having mixed ``state`` (``None``: nothing): mark its outputs, and
        return what the mixer keeps of ``state`` (:func:`~.contract.kept`: without its ``loss_inputs``).

        From code torch.compile traces, this runs after the graph (a graph break at the model's end): it
        reads the real outputs' autograd nodes, which a traced graph does not have, and the list of recent
        forwards, whose length a traced append would guard on (a recompile per forward, up to dynamo's
        limit). The wrapper is made at the first compiled forward, so importing mixhook does not import
        torch._dynamo."""
        if torch.compiler.is_compiling():
            if not _RECORD_TRACED:
                _RECORD_TRACED.append(torch.compiler.disable(Forwards.record))
            return _RECORD_TRACED[0](self, output, state)
        if self.begun or self.pending is not None:
            self.settle()
        if state is None:
            record = _UNMIXED
            self.latest = None
        else:
            record = _Forward(state, None, _Mark(state.layer))
            state = self.latest = state if state.loss_inputs is None else kept(state)
        self.recent.append(record.mark)
        node = output.grad_fn if type(output) is torch.Tensor else None
        if node is not None:  # (the usual output: one tensor with gradients)
            node.metadata[self.key] = record
        else:
            _mark_outputs(output, record, self.key, self.outputs, self.unmixed)
        return state

    def open(self, layer: str | None) -> None:
        """A compiled graph began a forward (``mixhook::begin``) that is to mix ``layer`` (``None``:
        nothing): the one before it is settled, this one recorded (what it mixed is filled in by
        :meth:`mixed`)."""
        self.settle()
        record = _Forward(layer=layer, mark=_Mark())
        self.recent.append(record.mark)
        self.begun.append(record)
        self.latest = None

    def mixed(self, state: MixState) -> MixState:
        """The compiled forward begun last mixed ``state``; what the mixer keeps of it (:func:`kept`)."""
        if self.begun:
            record = self.begun[-1]
            record.state, record.mark.layer = state, state.layer
            state = self.latest = state if state.loss_inputs is None else kept(state)
        return state

    def settle(self) -> None:
        """Mark the output a compiled forward left in :attr:`pending` as the last begun forward's. Where
        one graph called the model several times, only the last call's output leaves the graph as
        ``pending``: the others stay unmarked (a loss on them is refused, never bound to a wrong mix)."""
        if not self.begun and self.pending is None:  # (every eager forward)
            return
        output, self.pending = self.pending, None
        begun, self.begun = self.begun, []
        for record in begun:
            if record.layer is not None and record.state is None:
                raise RuntimeError(
                    f"mixup layer {record.layer!r} did not run during a compiled forward of the model, so "
                    "nothing was mixed; choose a layer that forward() calls. (Attach before compiling, and "
                    "if hooks changed after compiling, or another instance of this class was compiled "
                    "without them, set torch._dynamo.config.skip_nnmodule_hook_guards = False before "
                    "compiling.)"
                )
        if output is not None and begun:
            _mark_outputs(output, begun[-1], self.key, self.outputs, self.unmixed)

    def state_for(self, logits: torch.Tensor | None, what: str, kind: str, attached: bool) -> MixState | None:
        """The state of the forward that produced ``logits`` (see :meth:`Mixer.state_for`), naming
        ``what`` and the mixer ``kind`` in its errors; the forward found is marked claimed."""
        if self.begun or self.pending is not None:
            self.settle()
        node = logits.grad_fn if type(logits) is torch.Tensor else None
        record = node.metadata.get(self.key) if node is not None else None
        if record is not None:  # (the usual logits: the output a forward marked)
            record.mark.bound = True
            return record.state
        if logits is None:
            return self._latest(what, kind)
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"{what}(): logits must be a tensor, got {type(logits).__name__}")
        found = self._of(logits)
        if len(found) == 1:
            (record,) = found
            record.mark.bound = True
            return record.state
        if found:
            mixed = [f for f in found if f.state is not None]
            if not mixed:
                for f in found:
                    f.mark.bound = True
                return None
            raise ForeignLogitsError(
                f"{what}(): these logits combine the outputs of {len(found)} forwards of the model, "
                f"{len(mixed)} of them mixed by {kind}, so no one mix applies to them; take each forward's "
                f"{what} on its own logits"
            )
        if logits.grad_fn is not None:
            detached = "" if attached else f" ({kind} is not attached to a model)"
            raise ForeignLogitsError(
                f"{what}(): these logits were not computed by a forward of the model {kind} is attached "
                f"to{detached}; a copy of a hooked model (copy.deepcopy, an EMA or AveragedModel, a "
                "pickled or spawned model) has no mixhook hooks: compute the loss on the hooked model's "
                "logits, or attach a regularizer to the copy"
            )
        if _unclaimed(self.recent) is not None:
            raise ForeignLogitsError(
                f"{what}(): these logits carry no autograd graph and are not an output of a forward of the "
                f"model (a copy?), while a forward that {kind} mixed has had no loss taken, so whether they "
                "are that forward's cannot be told; pass the model's output itself (or a tensor computed "
                "from it with gradients)"
            )
        return None  # every forward since the last claimed one mixed nothing: the plain criterion

    def _latest(self, what: str, kind: str) -> MixState | None:
        """The latest forward's state (as the mixer keeps it: without its ``loss_inputs``), for a call
        without logits: refused while an earlier forward that mixed is unclaimed (it could be the one
        meant)."""
        if not self.recent:
            return None
        if _unclaimed(list(self.recent)[:-1]) is not None:
            raise ForeignLogitsError(
                f"{what}(): an earlier forward than the latest one mixed and has had no loss or targets "
                f"taken yet, so the forward these targets are for cannot be told; pass logits= "
                f"({kind}.{what}(..., logits=logits))"
            )
        self.recent[-1].bound = True
        return self.latest

    def unclaimed(self) -> str | None:
        """The layer a recent forward mixed whose output no ``loss``/``targets``/``state_for`` has claimed
        (the trainer adapters refuse a step that leaves one: :mod:`mixhook.integrations.draws`), or
        ``None``."""
        self.settle()
        return _unclaimed(self.recent)

    def claim_all(self) -> None:
        """Mark every recent forward claimed (an adapter's new step: what earlier ones left is theirs)."""
        self.settle()
        for mark in self.recent:
            mark.bound = True

    def _of(self, logits: torch.Tensor) -> list[_Forward]:
        """The forwards of this mixer whose outputs ``logits`` is, or was computed from: marked outputs
        found through views (``_base``) and the autograd graph, which is walked no further than them."""
        record = self._marked(logits)
        if record is not None:
            return [record]
        key, found, node = self.key, [], logits.grad_fn
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

    def _marked(self, logits: torch.Tensor) -> _Forward | None:
        """The record ``logits`` was marked with, itself or the first of its views' bases to carry one: in
        its autograd node's metadata, or (no gradients) among the outputs marked by weak reference; ``None``
        at the first tensor with a node that carries none (the graph is then walked: :meth:`_of`)."""
        t = logits
        while t is not None:  # the output itself, or a view of it
            node = t.grad_fn
            if node is not None:
                return node.metadata.get(self.key)
            entry = self.outputs.get(id(t))
            if entry is not None and entry[0]() is t:
                return entry[1]
            if any(ref() is t for ref in self.unmixed):
                return _UNMIXED
            t = t._base
        return None


def _unclaimed(marks) -> str | None:
    """The layer of the first of ``marks`` that mixed and is not claimed, or ``None``."""
    return next((m.layer for m in marks if m.layer is not None and not m.bound), None)


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

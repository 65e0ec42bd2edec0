"""The mix under torch.compile: one graph (``fullgraph=True``), draws from the mixer's own generator.

Traced code can neither call a ``torch.Generator`` nor read a tensor's value on the host, and every
Python value it reads becomes a guard (a recompile per new value). So when torch.compile traces the
hooks of a mixer that supports it (:attr:`~.mixer.Mixer.traceable`), each forward's mix is split in two:

- **the host part** (whether this forward mixes and where, lam, the partners, a box or a mask: the
  same Python code, the same generator and the same order of draws as an eager forward) runs when the
  compiled graph runs, inside two custom operators: ``mixhook::begin`` where the model's forward
  starts (the decision, and the forward's record for ``loss``) and ``mixhook::draw`` at each layer that
  may be mixed (the draws, for the layer that was chosen). Both are ordered side effects: the compiler
  keeps each call, in its place, once (never dropped as unused, reordered or recomputed).
- **the device part** (the blend, the paste) is traced from the one ``uint8`` tensor each ``draw``
  returns, which packs a flag and the method's values (lam, the partner index, a box, a mask): shapes
  fixed by the layer, values new at every call, one host-to-device copy per mix. Every layer that may
  be mixed computes ``where(flag, mixed, h)``: the flag is set at the chosen layer only (the layers not
  chosen get zeros, which index and weigh validly and leave ``h`` and its gradient exactly as they are);
  inductor fuses the ``where`` into the blend's kernel.

The decision and draws live where an eager forward keeps them (``Mixer.current``), so a model whose
input hook runs eagerly and whose layers are compiled (or the reverse) mixes the same way. A forward's
output is bound to its record after the graph: the traced output hook leaves the output on
:class:`~.binding.Forwards` (an attribute store dynamo replays after the graph) and the next host event
(the next forward's ``begin``, or ``loss``/``targets``/``state_for``) marks it.

A method joins by implementing :meth:`~.mixer.Mixer.traced_params`, :meth:`~.mixer.Mixer.draw_traced` and
:meth:`~.mixer.Mixer.mix_traced` (see "Adding a mixer" in the README); the others run under
torch.compile as before, with graph breaks around their hooks.
"""

from __future__ import annotations

import ast
import itertools
import weakref

import torch
from torch._library.effects import EffectType

from .. import recompute
from ..layouts import channels_last
from ..sites import INPUT, Inputs, Leaf, rebuild_inputs, replace_leaves
from .tokens import traced_weight

_MIXERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # token -> mixer
_TOKENS = itertools.count(1)
_METAS: dict[str, tuple] = {}  # a draw's description of its leaves, parsed once
_LEAVES: dict[tuple, tuple] = {}  # (description, sizes) -> the leaves the host part is given
_ALIGN = 8  # every packed value starts at a multiple of 8 bytes, so that each can be viewed in its dtype

# (shape, dtype) of each packed value: the flag first, then the method's
Spec = tuple[tuple[int, ...], torch.dtype]
FLAG: Spec = ((), torch.bool)


def register(mixer) -> str:
    """A token naming ``mixer`` in the operators' calls (a constant of the graph: a string, which dynamo
    never makes symbolic as it may an int that differs between two mixers; a copy gets its own)."""
    token = f"mixer{next(_TOKENS)}"
    _MIXERS[token] = mixer
    return token


def _mixer(token: str):
    mixer = _MIXERS.get(token)
    if mixer is None:
        raise RuntimeError("a compiled graph called a mixhook mixer that no longer exists; compile again")
    return mixer


class Shape:
    """What the host part knows of a leaf's tensor: its shape (ints when the graph runs; symbolic sizes
    while it is traced with dynamic shapes), ``ndim`` and ``dtype``."""

    __slots__ = ("shape", "ndim", "dtype")

    def __init__(self, shape: tuple, dtype: torch.dtype):
        self.shape, self.ndim, self.dtype = torch.Size(shape) if _ints(shape) else shape, len(shape), dtype


def _ints(shape) -> bool:
    return all(type(d) is int for d in shape)


def describe(leaves) -> str:
    """The constant part of a ``draw`` call: each leaf's path, number of dimensions, batch dimension and
    dtype (its sizes travel as the call's ``sizes``, which may be symbolic)."""
    return repr(tuple((leaf.path, leaf.tensor.ndim, leaf.dim, str(leaf.tensor.dtype)) for leaf in leaves))


def parse_leaves(meta: str, sizes) -> tuple[list, list]:
    """``(found, given)``: the leaves found at the site and those the method is given, from a ``draw``
    call's ``meta`` (:func:`describe` of each, joined by ``|``) and ``sizes`` (theirs, in that order),
    each a ``Leaf`` whose tensor is a :class:`Shape`."""
    key = (meta, tuple(sizes)) if _ints(sizes) else None
    found = _LEAVES.get(key) if key is not None else None
    if found is not None:
        return found
    described = _METAS.get(meta)
    if described is None:
        described = _METAS[meta] = tuple(ast.literal_eval(part) for part in meta.split("|"))
    out, at = [], 0
    for part in described:
        leaves = []
        for path, ndim, dim, dtype in part:
            shape = tuple(sizes[at : at + ndim])
            at += ndim
            leaves.append(Leaf(path, Shape(shape, getattr(torch, dtype.removeprefix("torch."))), dim))
        out.append(leaves)
    found = (out[0], out[1])
    if key is not None:
        if len(_LEAVES) >= 256:
            _LEAVES.clear()
        _LEAVES[key] = found
    return found


def _offsets(specs: list[Spec]) -> tuple[list[int], int]:
    """Where each value starts in the packed buffer, and its size in bytes (sizes may be symbolic)."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        size = dtype.itemsize
        for d in shape:
            size = size * d
        total = total + (size + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, total


def pack(values: list[torch.Tensor], specs: list[Spec], device: torch.device) -> torch.Tensor:
    """``values`` (CPU tensors of ``specs``' shapes, cast to their dtypes) in one ``uint8`` tensor on
    ``device``: one copy (from pinned memory to a CUDA device, queued)."""
    offsets, total = _offsets(specs)
    buffer = torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for value, (_, dtype), start in zip(values, specs, offsets, strict=True):
        flat = value.detach().to(dtype).reshape(-1)
        buffer[start : start + flat.numel() * dtype.itemsize].view(dtype).copy_(flat)
    return buffer if device.type == "cpu" else buffer.to(device, non_blocking=True)


def unpack(buffer: torch.Tensor, specs: list[Spec]) -> list[torch.Tensor]:
    """The values :func:`pack` put in ``buffer``, as views of it (traced: no copy, no host read)."""
    offsets, _ = _offsets(specs)
    out = []
    for (shape, dtype), start in zip(specs, offsets, strict=True):
        numel = 1
        for d in shape:
            numel *= d
        out.append(buffer[start : start + numel * dtype.itemsize].view(dtype).view(shape))
    return out


def zeros(specs: list[Spec], device: torch.device) -> torch.Tensor:
    """The packed values of a layer that does not mix: a false flag, and zeros (valid as an index, as a
    weight, as a box) for the method's values."""
    return torch.zeros(_offsets(specs)[1], dtype=torch.uint8, device=device)


# Both run Python on the host at every call: a CUDA graph must not capture them (their draws would be
# frozen into it). Tagged cudagraph_unsafe, torch.compile(mode="reduce-overhead") captures the parts of
# the graph between them (inductor's graph partition) and runs them, fresh, at every replay.
_UNSAFE = (torch.Tag.cudagraph_unsafe,)


@torch.library.custom_op("mixhook::begin", mutates_args=(), tags=_UNSAFE)
def begin(token: str, training: bool, batch: int) -> torch.Tensor:
    """At the start of a compiled forward: the forward's decision (whether and where it mixes) and its
    record, made on the host; ``batch`` is the model input's batch size (-1: not known). Returns a 0-d
    int64 CPU tensor (what the graph orders the layers' draws after)."""
    return torch.tensor(_mixer(token)._host_begin(training, None if batch < 0 else batch))


@begin.register_fake
def _(token: str, training: bool, batch: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


@torch.library.custom_op("mixhook::draw", mutates_args=(), tags=_UNSAFE)
def draw(token: str, spec: str, meta: str, n: int, sizes: list[int], device: torch.device) -> torch.Tensor:
    """At a layer that may be mixed (``spec``, a batch of ``n``, whose leaves ``meta`` and ``sizes``
    describe): the packed flag and values of its mix (drawn on the host when this forward mixes there;
    zeros otherwise)."""
    return _mixer(token)._host_draw(spec, meta, n, sizes, device)


@draw.register_fake
def _(token: str, spec: str, meta: str, n: int, sizes: list[int], device: torch.device) -> torch.Tensor:
    _, given = parse_leaves(meta, sizes)
    specs = _mixer(token)._traced_specs(n, given)
    return torch.empty(_offsets(specs)[1], dtype=torch.uint8, device=device)


begin.register_effect(EffectType.ORDERED)
draw.register_effect(EffectType.ORDERED)


class TracedPath:
    """The :class:`~.mixer.Mixer` side of the one-graph path: what its hooks trace (:meth:`_traced_begin`,
    :meth:`_traced_mix`) and what the operators run on the host (:meth:`_host_begin`, :meth:`_host_draw`).

    A method supports the path by implementing the three methods below; each mirrors a part of its
    eager :meth:`~.mixer.Mixer.mix`, so that both give the same mix from the same draws."""

    def traced_params(self, n: int, leaves: list) -> list[Spec]:
        """The ``(shape, dtype)`` of each value :meth:`draw_traced` returns for a mix of ``n`` samples of
        ``leaves``; on the host their tensors are :class:`Shape` objects (shape, ``ndim``, dtype), whose sizes
        are symbolic while a graph with dynamic shapes is traced."""
        raise NotImplementedError

    def draw_traced(self, leaves: list, draw) -> tuple[list[torch.Tensor], object]:
        """On the host, when the graph runs: the values the traced mix needs (CPU tensors, as
        :meth:`traced_params` describes them) and the :class:`~.contract.Mixed` (no tensors) that
        records the mix, drawn from ``draw`` exactly as :meth:`~.mixer.Mixer.mix` would."""
        raise NotImplementedError

    def mix_traced(self, leaves: list, values: list[torch.Tensor]) -> dict:
        """Traced: the mixed tensor of every leaf, by path, from the values :meth:`draw_traced` drew (on
        the leaves' device): the same ops as :meth:`~.mixer.Mixer.mix`, with no host read and shapes that
        do not depend on the values."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------ traced (graph)

    def _traced_begin(self, model, args: tuple, kwargs: dict):
        batch = self._reference_batch(model, args, kwargs) if model.training else None
        if model.training:  # (the map checks of _leaves read it while tracing)
            self._input_sides = self._input_grid(args, kwargs)
        begin(self._token, model.training, -1 if batch is None else batch)
        if not model.training:
            return None
        changed = False
        for spec, site in self.sites.items():
            if site.layer == INPUT:
                inputs = Inputs(model, args, kwargs)
                args, kwargs = rebuild_inputs(inputs, site, self._traced_mix(spec, inputs))
                changed = True
        return (args, kwargs) if changed else None

    def _traced_mix(self, spec: str, value):
        """Traced: ``value`` (a layer's output, or the model's :class:`Inputs`) as the chosen layer mixes
        it (the flag of this forward's draw at ``spec`` set) or as it is."""
        if recomputable():  # mixed between graphs (see recomputable)
            torch._dynamo.graph_break(
                f"mixhook: {type(self).__name__} at {spec!r} is inside an activation-checkpointed region, "
                "which a compiled graph would recompute without its mix: it is mixed between graphs there "
                "(exact; fullgraph=True cannot hold it)"
            )

        site_value = self._site_value(spec, value)
        found, given, n = self._leaves(spec, site_value, None, plan=False)
        specs = self._traced_specs(n, given)
        meta = f"{describe(found)}|{describe(given)}"
        sizes = [d for leaf in (*found, *given) for d in leaf.tensor.shape]
        flag, *values = unpack(draw(self._token, spec, meta, n, sizes, given[0].tensor.device), specs)
        grid = self.token_grid
        weight = index = None
        if self._blends_prefix:  # the leading tokens' weights and partners come last
            *values, weight, index = values
        mixed = self.mix_traced(given, values)
        tensors = {}
        for out, leaf in zip(found, given, strict=True):
            t = mixed[leaf.path]
            if grid is not None:  # the (B, D, gh, gw) map back into the tokens
                t = grid.from_map_traced(out, t, weight, index)
            elif self._channels_last(spec, out):  # a channels-last map was given as its channels-first view
                t = channels_last(t)
            tensors[leaf.path] = torch.where(flag, t, out.tensor)
        return replace_leaves(site_value, tensors)

    @property
    def _blends_prefix(self) -> bool:
        return self.token_grid is not None and self.token_grid.prefix == "blend"

    # ------------------------------------------------------------------------ on the host (runtime)

    def _host_begin(self, training: bool, batch: int | None) -> int:
        """``mixhook::begin``: the previous compiled forward's output bound to its record, this forward's
        record opened, and (training) its decision made as an eager forward makes it."""
        draw = self._begin_forward(self._agree(self._decide()) if training else None)
        self._seen.open(None if draw is None else draw.layer)
        if draw is None:
            return -1
        draw.batch = batch
        return self.layers.index(draw.layer)

    def _traced_specs(self, n: int, given: list) -> list[Spec]:
        prefix = [((n,), torch.float64), ((n,), torch.int64)] if self._blends_prefix else []
        return [FLAG, *self.traced_params(n, given), *prefix]

    def _host_draw(
        self, spec: str, meta: str, n: int, sizes: list[int], device: torch.device
    ) -> torch.Tensor:
        """``mixhook::draw`` at ``spec``: zeros, unless this forward mixes there: then its draws, made as
        an eager forward makes them (pinned values, ``pin_last``'s replay, the method's own draws)."""
        found, given = parse_leaves(meta, sizes)
        specs = self._traced_specs(n, given)
        forward = self._current
        if forward is None or forward.done or forward.layer != spec:
            return zeros(specs, device)
        refuse_capture(type(self).__name__, spec, device)
        if forward.batch is not None and n != forward.batch:
            raise TypeError(
                f"{type(self).__name__} at {spec!r}: its batch dimension has size {n}, but the model's input "
                f"has a batch of {forward.batch}: the layer loses or reshapes the batch dimension; choose "
                "another layer, or pass batch_dim"
            )
        values, last = self._drawn(spec, n, forward, given, found)
        if self._blends_prefix:
            values = [*values, traced_weight(last.lam, n, found[0].tensor.dtype), last.index]
        return pack([torch.ones((), dtype=torch.bool), *values], specs, device)

    def _drawn(self, spec: str, n: int, forward, given: list, found: list):
        """The values and the state of the mix ``forward`` makes at ``spec``, drawn and kept as
        :meth:`~.mixer.Mixer._mix_now` draws and keeps an eager mix."""
        generator = self._replaying(forward.pins.state)
        drawn = self._repeatable(spec, n, forward, generator)
        d, (values, mixed) = self._drawing(spec, n, forward.pins, generator, self.draw_traced, given, drawn)
        last = self._state(spec, found, d, mixed)
        self._done(forward, last)
        return values, last


def recomputable() -> bool:
    """At trace time: whether the layer being traced may be recomputed in backward (activation
    checkpointing): dynamo traces the body of a higher-order op (``torch.utils.checkpoint`` inside the
    compiled frame), or the frame runs inside an eager checkpoint's forward (its saved-tensor hooks on, or
    gradients off). A compiled recomputation would call ``draw`` again (refused by AOT, or mixed anew), so
    such a layer is mixed between graphs instead, where the recomputation replays the forward's mix
    (:mod:`mixhook.recompute`). Dynamo runs this function while tracing (it is marked constant)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    if tx is not None and tx.output.current_tracer.parent is not None:
        return True
    return not torch.is_grad_enabled() or recompute.saved_tensor_hooks_active()


recomputable._dynamo_marked_constant = True  # what torch._dynamo.assume_constant_result sets


def refuse_capture(kind: str, spec: str, device: torch.device) -> None:
    """A one-line ``RuntimeError`` when a CUDA graph is being captured on ``device``'s current stream: the
    capture would record this mix's draws once and every replay would repeat them."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{kind} at {spec!r}: a CUDA graph is being captured, which would record this mix's draws once "
            "and repeat them at every replay; capture with torch.compile(model, mode='reduce-overhead') "
            "instead (mixhook's draws then run between the captured parts, fresh at every replay)"
        )

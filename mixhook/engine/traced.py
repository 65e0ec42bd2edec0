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
import math
import sys
import weakref
from collections.abc import Callable

import torch
from torch._library.effects import EffectType

from .. import recompute
from ..sites import INPUT, Inputs, Leaf, rebuild_inputs, replace_leaves
from .tokens import traced_weight

_HOSTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # token -> Host
_TOKENS = itertools.count(1)
_METAS: dict[str, tuple] = {}  # a draw's description of its leaves, parsed once
_LEAVES: dict[tuple, tuple] = {}  # (description, sizes) -> the leaves the host part is given
_ALIGN = 8  # every packed value starts at a multiple of 8 bytes, so that each can be viewed in its dtype

# (shape, dtype) of each packed value: the flag first, then the method's
Spec = tuple[tuple[int, ...], torch.dtype]
FLAG: Spec = ((), torch.bool)


class Host:
    """What the operators run on the host for one mixer (or :class:`~mixhook.OneOf`), found by its
    :attr:`token` (a constant of the graph: a string, which dynamo never makes symbolic as it may an int
    that differs between two mixers; a copy of a mixer gets its own).

    Args:
        begin: ``begin(training, batch) -> int``: the forward's decision (the chosen layer's position, -1:
            none), made as an eager forward makes it.
        draw: ``draw(spec, meta, n, sizes, device) -> uint8 tensor``: the packed values of a layer's mix.
        specs: ``specs(n, given) -> list[Spec]``: what ``draw`` packs, for a batch of ``n``.
    """

    def __init__(self, begin: Callable, draw: Callable | None = None, specs: Callable | None = None):
        self.begin, self.draw, self.specs = begin, draw, specs
        self.token = f"mixer{next(_TOKENS)}"
        _HOSTS[self.token] = self  # (weakly: held by its owner, it goes with it)


def _host(token: str) -> Host:
    host = _HOSTS.get(token)
    if host is None:
        raise RuntimeError("a compiled graph called a mixhook mixer that no longer exists; compile again")
    return host


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


def pack(values: list, specs: list[Spec], device: torch.device) -> torch.Tensor:
    """``values`` in one ``uint8`` tensor on ``device``: each a CPU tensor of its spec's shape (cast to its
    dtype), packed on the host and copied in one copy (from pinned memory to a CUDA device, queued), or a
    function that fills its place on ``device`` in place, called in order after the copy (noise drawn
    there, :class:`~mixhook.functional.DeviceNoise`: the host packs and copies the bytes before the last
    tensor's end only)."""
    offsets, total = _offsets(specs)
    fills, end = [], 0
    for value, (shape, dtype), start in zip(values, specs, offsets, strict=True):
        if callable(value):
            fills.append((value, shape, dtype, start))
        else:
            end = start + math.prod(value.shape) * dtype.itemsize
    host = torch.zeros(total if not fills else end, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for value, (_, dtype), start in zip(values, specs, offsets, strict=True):
        if not callable(value):
            flat = value.detach().to(dtype).reshape(-1)
            host[start : start + flat.numel() * dtype.itemsize].view(dtype).copy_(flat)
    if not fills:
        return host if device.type == "cpu" else host.to(device, non_blocking=True)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    buffer[:end].copy_(host, non_blocking=True)
    for fill, shape, dtype, start in fills:
        fill(buffer[start : start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
    return buffer


def unpack(buffer: torch.Tensor, specs: list[Spec]) -> list[torch.Tensor]:
    """The values :func:`pack` put in ``buffer``, as views of it (a bool as a comparison of its byte;
    traced: no copy, no host read)."""
    offsets, _ = _offsets(specs)
    out = []
    for (shape, dtype), start in zip(specs, offsets, strict=True):
        numel = 1
        for d in shape:
            numel *= d
        chunk = buffer[start : start + numel * dtype.itemsize]
        # a bool is one byte: compared, not bit-cast (inductor of torch 2.11 cannot lower a bit cast to
        # bool on CUDA: "torch.bool is not supported by torch.iinfo")
        out.append((chunk != 0 if dtype == torch.bool else chunk.view(dtype)).view(shape))
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
    return torch.tensor(_host(token).begin(training, None if batch < 0 else batch))


@begin.register_fake
def _(token: str, training: bool, batch: int) -> torch.Tensor:
    _partition_on_ops()
    return torch.empty((), dtype=torch.int64)


@torch.library.custom_op("mixhook::draw", mutates_args=(), tags=_UNSAFE)
def draw(token: str, spec: str, meta: str, n: int, sizes: list[int], device: torch.device) -> torch.Tensor:
    """At a layer that may be mixed (``spec``, a batch of ``n``, whose leaves ``meta`` and ``sizes``
    describe): the packed flag and values of its mix (drawn on the host when this forward mixes there;
    zeros otherwise)."""
    return _host(token).draw(spec, meta, n, sizes, device)


@draw.register_fake
def _(token: str, spec: str, meta: str, n: int, sizes: list[int], device: torch.device) -> torch.Tensor:
    _partition_on_ops()
    _, given = parse_leaves(meta, sizes)
    specs = _host(token).specs(n, given)
    return torch.empty(_offsets(specs)[1], dtype=torch.uint8, device=device)


begin.register_effect(EffectType.ORDERED)
draw.register_effect(EffectType.ORDERED)


def _partition_on_ops() -> None:
    """Where a compile captures CUDA graphs, name both ops in inductor's ``custom_should_partition_ops``.

    An ordered op reaches inductor wrapped in ``with_effects``, whose node its graph partition does not
    read the ``cudagraph_unsafe`` tag through (torch 2.11 on CUDA captured ``mixhook::draw`` into a graph:
    the capture refusal fired); named there, the ops are partitioned on by name. Called from the ops'
    fake implementations, which run on the host while the graph is traced, before inductor lowers it;
    compiles without CUDA graphs are left as they are.
    """
    config = sys.modules.get("torch._inductor.config")
    if config is None or not config.triton.cudagraphs:
        return
    for name in ("mixhook::begin", "mixhook::draw"):
        if name not in config.custom_should_partition_ops:
            config.custom_should_partition_ops.append(name)


class TracedPath:
    """The one-graph path of one mixer, a collaborator of its hooks: what they trace under torch.compile
    (:meth:`begin` at the model's pre-hook, :meth:`mix` at a layer) and what the operators run on the host
    (:class:`Host`: the mixer's decision and draws, made by the mixer as an eager forward makes them).

    Args:
        mixer: the mixer (its public ``sites``, ``token_grid`` and :meth:`~.mixer.Mixer.mix_traced` are read).
        start: ``start(model, args, kwargs) -> int | None``: a training forward's input read (its batch
            size, where the model tells it; the map checks read its sides).
        leaves: ``leaves(spec, value) -> (site_value, found, given, n)``: what the mixer acts on in a
            layer's output (or the model's :class:`~mixhook.sites.Inputs`), unplanned.
        restore: ``restore(spec, leaf, t, weight, index) -> tensor``: a mixed tensor the method was given
            as a view of ``leaf`` (a token grid's map, a channels-last map's channels-first view), put back.
        begin, draw: the mixer's host part: ``begin(training, batch) -> int`` (:meth:`Host.begin`) and
            ``draw(spec, n, found, given, device) -> (values, MixState) | None`` (``None``: the forward
            does not mix at ``spec``).
    """

    def __init__(
        self, mixer, start: Callable, leaves: Callable, restore: Callable, begin: Callable, draw: Callable
    ):
        self._mixer, self._start, self._leaves, self._restore = mixer, start, leaves, restore
        self._draw = draw
        self.host = Host(begin, self._host_draw, self.specs)

    # ------------------------------------------------------------------------------ traced (graph)

    def begin(self, model, args: tuple, kwargs: dict):
        """Traced at the model's pre-hook: the forward's decision (``mixhook::begin``) and, where the
        model's input is a site, its mix."""
        batch = self._start(model, args, kwargs) if model.training else None
        begin(self.host.token, model.training, -1 if batch is None else batch)
        if not model.training:
            return None
        changed = False
        for spec, site in self._mixer.sites.items():
            if site.layer == INPUT:
                inputs = Inputs(model, args, kwargs)
                args, kwargs = rebuild_inputs(inputs, site, self.mix(spec, inputs))
                changed = True
        return (args, kwargs) if changed else None

    def mix(self, spec: str, value):
        """Traced: ``value`` (a layer's output, or the model's :class:`Inputs`) as the chosen layer mixes
        it (the flag of this forward's draw at ``spec`` set) or as it is."""
        kind = type(self._mixer).__name__
        if recomputable():  # mixed between graphs (see recomputable)
            torch._dynamo.graph_break(
                f"mixhook: {kind} at {spec!r} is inside an activation-checkpointed region, which a compiled "
                "graph would recompute without its mix: it is mixed between graphs there (exact; "
                "fullgraph=True cannot hold it)"
            )

        site_value, found, given, n = self._leaves(spec, value)
        specs = self.specs(n, given)
        meta = f"{describe(found)}|{describe(given)}"
        sizes = [d for leaf in (*found, *given) for d in leaf.tensor.shape]
        flag, *values = unpack(draw(self.host.token, spec, meta, n, sizes, given[0].tensor.device), specs)
        weight = index = None
        if self._blends_prefix:  # the leading tokens' weights and partners come last
            *values, weight, index = values
        mixed = self._mixer.mix_traced(given, values)
        tensors = {}
        for out, leaf in zip(found, given, strict=True):
            t = self._restore(spec, out, mixed[leaf.path], weight, index)
            tensors[leaf.path] = torch.where(flag, t, out.tensor)
        return replace_leaves(site_value, tensors)

    @property
    def _blends_prefix(self) -> bool:
        grid = self._mixer.token_grid
        return grid is not None and grid.prefix == "blend"

    def specs(self, n: int, given: list) -> list[Spec]:
        """What ``mixhook::draw`` packs for a batch of ``n`` of the leaves ``given``: the flag, the
        method's values (:meth:`~.mixer.Mixer.traced_params`), the leading tokens' weights and partners."""
        prefix = [((n,), torch.float64), ((n,), torch.int64)] if self._blends_prefix else []
        return [FLAG, *self._mixer.traced_params(n, given), *prefix]

    # ------------------------------------------------------------------------ on the host (runtime)

    def _host_draw(self, spec: str, meta: str, n: int, sizes: list[int], device: torch.device):
        """``mixhook::draw`` at ``spec``: zeros, unless this forward mixes there: then its draws."""
        found, given = parse_leaves(meta, sizes)
        specs = self.specs(n, given)
        drawn = self._draw(spec, n, found, given, device)
        if drawn is None:
            return zeros(specs, device)
        values, last = drawn
        if self._blends_prefix:
            values = [*values, traced_weight(last.lam, n, found[0].tensor.dtype), last.index]
        return pack([torch.ones((), dtype=torch.bool), *values], specs, device)


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
    return recompute.in_checkpointed_forward()


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

"""Sites: where in a model a hook acts, which tensors it touches there, and along which dimension the batch
runs in each of them.

A **site spec** is a layer name (``"layer2"``, ``"bert.encoder.layer.3"``, ``"input"``) optionally followed by
a **selector** in brackets: ``"lstm[0]"`` (element 0 of what the LSTM returns), ``"lstm[1.0]"`` (element 0 of
element 1: ``h_n``), ``"bert.encoder[last_hidden_state]"`` (a key or attribute), ``"input[x,meta]"``
(several elements, mixed with one draw). Without a selector a layer's output is taken **as a whole**:
every tensor in it (tuple, list, dict, HuggingFace ``ModelOutput``, dataclass, nested) that carries the
batch. ``"input"`` without a selector is the model's first argument; with one, the model's arguments by
name (``input[pixel_values]``) or position (``input[0]``), however they were passed.

Hooks that act *before* a layer runs (:class:`~mixhook.InputScale`, :class:`~mixhook.GradScale`) read the
selector against the layer's **inputs** (its arguments, positional or keyword), the others against its
output.

**The batch dimension is found, never guessed** (:class:`BatchDims`): an explicit ``batch_dim`` wins; else
modules that declare ``batch_first`` (``nn.RNN``/``LSTM``/``GRU``, ``nn.MultiheadAttention``,
``nn.Transformer*``) give it for each element of their inputs and outputs (``h_n``/``c_n`` always at dim
1, attention weights at dim 0), and so do they for every module inside them; everything else follows
PyTorch's batch-first convention (dim 0), *unless* the model holds a sequence-first module, in which case
an undeclared layer's layout cannot be known and is refused. Of several tensors in one output, the first
sets the batch size ``B``; another one is mixed only if its batch dimension is certain: a tensor that has
no dimension of size ``B`` passes through unchanged, and one whose dimensions of size ``B`` leave doubt
is refused in one line.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

INPUT = "input"
"""The special layer name for the model's input (classic input mixup)."""

Path = tuple  # of int | str: the keys from a layer's output (or inputs) down to one element

_SPEC = re.compile(r"^(?P<layer>[^\[\]]+?)(?:\[(?P<select>[^\[\]]*)\])?$")
_KEY = re.compile(r"^(-?\d+|[A-Za-z_][A-Za-z0-9_]*)$")


@dataclass(frozen=True)
class Site:
    """A parsed site spec: the layer name and the selected element paths (``None``: no selector)."""

    spec: str
    layer: str
    paths: tuple[Path, ...] | None = None


def parse_site(spec: str) -> Site:
    """``"lstm[0,1.0]"`` -> ``Site("lstm[0,1.0]", "lstm", ((0,), (1, 0)))``; raises ``ValueError`` for a
    malformed selector, naming the spec and the valid forms."""
    match = _SPEC.match(spec)
    if not match:
        raise ValueError(
            f"layer spec {spec!r} is malformed; write a layer name, optionally with a selector such as "
            "'lstm[0]', 'lstm[1.0]', 'encoder[last_hidden_state]' or 'input[x,meta]'"
        )
    layer, select = match["layer"].strip(), match["select"]
    if select is None:
        return Site(spec, layer)
    paths = []
    for item in select.split(","):
        keys = item.strip().split(".")
        if not item.strip() or not all(_KEY.match(k) for k in keys):
            raise ValueError(
                f"layer spec {spec!r}: selector [{select}] must list element paths separated by commas, each "
                "a dot-separated chain of indices and names, e.g. [0], [1.0], [last_hidden_state], [x,meta]"
            )
        paths.append(tuple(int(k) if k.lstrip("-").isdigit() else k for k in keys))
    if len(set(paths)) != len(paths):
        raise ValueError(f"layer spec {spec!r} selects the same element twice")
    return Site(spec, layer, tuple(paths))


def check_per_layer(name: str, value, specs: tuple[str, ...], valid, expected: str, mapping=Mapping):
    """A per-layer argument (``batch_dim``, ``layout``), checked: ``None``, one ``valid`` value for every
    layer, or a ``mapping`` from some of ``specs`` to one (returned as a dict); anything else is a one-line
    ``ValueError`` saying it must be ``expected``."""
    if value is None or valid(value):
        return value
    if isinstance(value, mapping):
        unknown = sorted(set(value) - set(specs))
        if unknown:
            raise ValueError(f"{name} names layers {unknown} that are not among {list(specs)}")
        if all(valid(v) for v in value.values()):
            return dict(value)
    raise ValueError(f"{name} must be {expected}, got {value!r}")


def format_path(path: Path) -> str:
    return "[" + ".".join(str(k) for k in path) + "]"


# ----------------------------------------------------------------------------- structures


def leaves(value, path: Path = ()) -> Iterator[tuple[Path, object]]:
    """Every leaf of a (nested) tuple, list, dict, ``ModelOutput`` or dataclass, with its path. Leaves are
    tensors and anything that is not a container (``None``, numbers, objects)."""
    if isinstance(value, PackedSequence):
        yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple: by field name
        for key, item in zip(value._fields, value, strict=True):
            yield from leaves(item, (*path, key))
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from leaves(item, (*path, i))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from leaves(getattr(value, f.name), (*path, f.name))
    else:
        yield path, value


def _child(value, key):
    if isinstance(value, Mapping):
        return value[key]
    if isinstance(value, (tuple, list)) and isinstance(key, int):
        return value[key]
    if isinstance(key, str) and (hasattr(value, "_fields") or dataclasses.is_dataclass(value)):
        return getattr(value, key)
    raise KeyError(key)


def _normalize(value, path: Path) -> Path | None:
    """``path`` with negative indices made positive, or ``None`` if it does not exist in ``value``."""
    out = []
    for key in path:
        if isinstance(value, Inputs) and isinstance(key, int):
            try:
                key = value.key(key)
            except IndexError:
                return None
        elif hasattr(value, "_fields") and isinstance(key, int) and -len(value) <= key < len(value):
            key = value._fields[key]
        try:
            child = _child(value, key)
        except (KeyError, IndexError, AttributeError, TypeError):
            return None
        if isinstance(key, int) and key < 0:
            key += len(value)
        out.append(key)
        value = child
    return tuple(out)


def replace_leaves(value, new: dict[Path, object]):
    """A copy of ``value`` with the leaves at the paths in ``new`` replaced; containers keep their type
    (tuple, namedtuple, list, dict, ``ModelOutput``, dataclass) and only those on a changed path are
    copied. The caller's structure is never modified."""
    if () in new:
        return new[()]
    heads: dict = {}
    for path, item in new.items():
        heads.setdefault(path[0], {})[path[1:]] = item
    if isinstance(value, Inputs):  # a call's arguments: the changed ones, for Inputs.rebuild
        return {k: replace_leaves(value[k], sub) for k, sub in heads.items()}
    if isinstance(value, Mapping):
        changed = {k: replace_leaves(value[k], sub) for k, sub in heads.items()}
        if dataclasses.is_dataclass(value):  # a HuggingFace ModelOutput: an ordered dict and a dataclass
            return dataclasses.replace(value, **changed)
        out = copy.copy(value)
        out.update(changed)
        return out
    if hasattr(value, "_fields"):
        return value._replace(**{k: replace_leaves(getattr(value, k), sub) for k, sub in heads.items()})
    if isinstance(value, (tuple, list)):
        items = list(value)
        for k, sub in heads.items():
            items[k] = replace_leaves(items[k], sub)
        return type(value)(items)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(
            value, **{k: replace_leaves(getattr(value, k), s) for k, s in heads.items()}
        )
    raise TypeError(f"cannot replace an element of a {type(value).__name__}")


def describe(value) -> str:
    """A short description of what a layer returned, for messages."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, PackedSequence):
        return "a PackedSequence"
    if isinstance(value, (tuple, list)) and not isinstance(value, PackedSequence):
        inner = ", ".join(_short(v) for v in value[:4])
        return f"a {type(value).__name__} of {len(value)} ({inner}{', ...' if len(value) > 4 else ''})"
    if isinstance(value, Mapping):
        keys = list(value)
        inner = ", ".join(f"{k}: {_short(value[k])}" for k in keys[:4])
        return f"a {type(value).__name__} ({inner}{', ...' if len(keys) > 4 else ''})"
    return f"a {type(value).__name__}"


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)}"
    if isinstance(value, (tuple, list, Mapping)):
        return describe(value).removeprefix("a ")
    return type(value).__name__


def blendable(t) -> bool:
    """Whether ``t`` is a tensor that can be blended or scaled: floating point or complex."""
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


# ----------------------------------------------------------------------------- a layer's inputs


class Inputs(Mapping):
    """A call's arguments by name, in the order of ``forward``'s signature (positional ones bound to their
    parameter names; without a usable signature, positional arguments are named ``0``, ``1``, ...). An
    integer key ``k`` means the ``k``-th argument given. :meth:`rebuild` turns changed values back into
    ``(args, kwargs)`` as they were passed."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, kwargs
        positional, order = _signature(getattr(module.forward, "__func__", module.forward))
        # for each positional arg, its parameter name (or its index)
        self._names: list = [positional[i] if i < len(positional) else i for i in range(len(args))]
        self._keyword = sorted(kwargs, key=lambda k: order.get(k, len(order)))
        self._items = {**dict(zip(self._names, args, strict=True)), **{k: kwargs[k] for k in self._keyword}}

    def __getitem__(self, key):
        if isinstance(key, int):
            return list(self._items.values())[key]
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def key(self, key):
        """The name of argument ``key`` (an int position among those given, or a name)."""
        return list(self._items)[key] if isinstance(key, int) else key

    def first(self) -> tuple[str, object]:
        """The first argument's name and value; ``TypeError`` when there is none."""
        if not self._items:
            raise TypeError("called without arguments")
        return next(iter(self._items.items()))

    def rebuild(self, new: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with the arguments named in ``new`` replaced."""
        args = tuple(new.get(name, a) for name, a in zip(self._names, self.args, strict=True))
        kwargs = {k: new.get(k, v) for k, v in self.kwargs.items()}
        return args, kwargs


def first_parameter(module: nn.Module) -> str | None:
    """The name of ``module.forward``'s first positional parameter (``None`` where it takes ``*args``
    only, or has no usable signature): what a keyword call's batch is read from (the model's input, by
    signature, wherever and in whatever order it is passed)."""
    positional, _ = _signature(getattr(module.forward, "__func__", module.forward))
    return positional[0] if positional else None


_SIGNATURES: dict = {}  # a plain dict, not functools.lru_cache, which torch.compile warns of and bypasses


def _signature(forward) -> tuple[list[str], dict[str, int]]:
    """A ``forward``'s positional parameter names and every parameter's position (cached: hooks bind a
    call's arguments on every forward). ``forward`` is the function behind the bound method. Traced by
    torch.compile, the cache is left alone (its reads and writes would be guards on its size: a recompile
    per new entry); the graph holds the result."""
    compiling = torch.compiler.is_compiling()
    found = None if compiling else _SIGNATURES.get(forward)
    if found is not None:
        return found
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    if params and params[0].name == "self":
        params = params[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    found = (positional, {p.name: i for i, p in enumerate(params)})
    if not compiling:
        if len(_SIGNATURES) >= 1024:
            _SIGNATURES.clear()
        _SIGNATURES[forward] = found
    return found


# ----------------------------------------------------------------------------- batch dimensions

_DECLARING = (nn.RNNBase, nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
              nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder)  # fmt: skip


def batch_first(module: nn.Module) -> bool | None:
    """What ``module`` declares about its layout: ``True`` (batch first), ``False`` (sequence first), or
    ``None`` (it declares nothing). ``nn.TransformerEncoder``/``Decoder`` declare through their layers."""
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)):
        first = module.layers[0] if len(module.layers) else None
        return batch_first(first) if first is not None else None
    if isinstance(module, nn.TransformerEncoderLayer | nn.TransformerDecoderLayer):
        return bool(module.self_attn.batch_first)
    if isinstance(module, _DECLARING):
        return bool(module.batch_first)
    return None


class AmbiguousBatchError(ValueError):
    """The batch dimension of something a hook would act on cannot be told: refused, never guessed."""


class BatchDims:
    """Where the batch runs in the tensors at one site of one model.

    Args:
        model: the model the hook is attached to.
        site: the parsed site.
        explicit: the hook's ``batch_dim`` for this site (``None``: find it).
    """

    def __init__(self, model: nn.Module, site: Site, explicit: int | None = None):
        self.site, self.explicit = site, explicit
        self.module = model if site.layer == INPUT else model.get_submodule(site.layer)
        self.declarer: nn.Module | None = None  # the module whose batch_first applies, itself or enclosing
        chain = [self.module] if site.layer == INPUT else _enclosing(model, site.layer)
        for m in chain:
            if batch_first(m) is not None:
                self.declarer = m
                break
        self.seq_first = [n or "(the model)" for n, m in model.named_modules() if batch_first(m) is False]

    def dim(self, path: Path, tensor: torch.Tensor, inputs: bool) -> tuple[int, str]:
        """The batch dimension of ``tensor`` at ``path`` (in the inputs when ``inputs``), and how it was
        known: ``"explicit"``, ``"declared"`` or ``"convention"``. Raises :class:`AmbiguousBatchError`
        where it cannot be known."""
        if self.explicit is not None:
            return self.explicit, "explicit"
        m = self.declarer
        if m is not None:
            seq = 0 if batch_first(m) else 1
            if m is not self.module:  # a module inside a declaring one: the declarer's layout
                return seq, "declared"
            key = path[0] if path else None
            if isinstance(m, nn.RNNBase):  # output (out, h_n | (h_n, c_n)); inputs (input, hx)
                return (seq if key in (0, "input") else 1), "declared"
            if isinstance(m, nn.MultiheadAttention):
                if inputs:
                    return (0 if key == "key_padding_mask" else seq), "declared"
                return (seq if key == 0 else 0), "declared"  # (attn_output, attn_output_weights)
            if inputs and isinstance(key, str) and key.endswith("key_padding_mask"):
                return 0, "declared"
            return seq, "declared"
        if self.seq_first:
            raise AmbiguousBatchError(
                f"cannot tell the batch dimension at {self.site.spec!r}: "
                f"{type(self.module).__name__} declares no batch_first, and the model holds sequence-first "
                f"modules ({', '.join(self.seq_first[:3])}), so its tensors may be (T, B, ...) or "
                f"(B, T, ...); pass batch_dim=0 or batch_dim=1"
            )
        return 0, "convention"

    def unbatched(self, tensor: torch.Tensor, inputs: bool) -> bool:
        """Whether a declaring module itself was called without a batch (an unbatched 2-D sequence)."""
        m = self.declarer
        return (
            m is self.module
            and m is not None
            and self.explicit is None
            and tensor.ndim == 2
            and (isinstance(m, (nn.RNNBase, nn.MultiheadAttention)) or not inputs)
        )


def input_dim(model: nn.Module, seq_first: list[str]) -> int | None:
    """The batch dimension of a model call's first tensor argument, where the model's layout tells it: the
    model's own ``batch_first`` if it declares one, else dim 0 unless the model holds sequence-first
    modules (``seq_first``), where it cannot be told (``None``)."""
    layout = batch_first(model)
    if layout is None and seq_first:
        return None
    return 0 if layout in (None, True) else 1


def input_batch(model: nn.Module, first: torch.Tensor | None, seq_first: list[str]) -> int | None:
    """The batch size of a model call whose first tensor argument is ``first`` (:func:`input_dim`), or
    ``None`` where it cannot be told."""
    return size_along(first, input_dim(model, seq_first))


def size_along(first: torch.Tensor | None, dim: int | None) -> int | None:
    """``first``'s size along the batch dimension ``dim`` (:func:`input_dim`), or ``None`` where there is no
    tensor, no known dimension, or the tensor has no such dimension."""
    return first.shape[dim] if dim is not None and first is not None and first.ndim > dim else None


def _enclosing(model: nn.Module, name: str) -> list[nn.Module]:
    """The module called ``name`` and each module enclosing it, innermost first, the model last."""
    parts = name.split(".")
    return [model.get_submodule(".".join(parts[:i])) for i in range(len(parts), -1, -1)]


@dataclass
class Leaf:
    """One tensor a hook acts on: where it is, and its batch dimension."""

    path: Path
    tensor: torch.Tensor
    dim: int

    @property
    def name(self) -> str:
        return format_path(self.path)


def select(value, site: Site, what: str) -> list[tuple[Path, object]]:
    """The leaves of ``value`` that ``site``'s selector picks (all of them without one), with their paths;
    a selected path that does not exist is refused in one line listing the elements there are."""
    return _select(value, site, what)


def _select(value, site: Site, what: str) -> list[tuple[Path, object]]:
    found = list(leaves(value))
    if site.paths is None:
        return found
    picked: list[tuple[Path, object]] = []
    for path in site.paths:
        path = _normalize(value, path) or path
        under = [(p, v) for p, v in found if p[: len(path)] == path]
        if not under and found and found[0][0] == ():
            raise ValueError(
                f"{site.spec!r}: {what} is a single {_short(found[0][1])}, which has no element "
                f"{format_path(path)}: leave out the selector ({site.layer!r})"
            )
        if not under:
            available = ", ".join(f"{format_path(p)} {_short(v)}" for p, v in found[:8]) or "none"
            raise ValueError(
                f"{site.spec!r}: {what} has no element {format_path(path)}; its elements: {available}"
            )
        picked.extend(item for item in under if item not in picked)
    return picked


def batch_leaves(
    value,
    site: Site,
    dims: BatchDims,
    kind: str,
    inputs: bool = False,
    floating: bool = True,
) -> tuple[list[Leaf], int]:
    """The tensors in ``value`` (what site ``site`` returned, or its :class:`Inputs`) that carry the batch,
    each with its batch dimension, and the batch size ``B``. The first selected tensor sets ``B``.

    Raises ``TypeError``/``ValueError`` (one line, naming the site, the element and what to do) where
    there is nothing to act on, where a tensor's batch dimension cannot be told, and, with ``floating``,
    where a batch-carrying tensor is not floating point (integer ids, boolean masks cannot be blended).
    """
    what = "its input" if inputs else "its output"
    where = f"{kind} at {site.spec!r}"
    selected = _select(value, site, what)
    packed = [p for p, v in selected if isinstance(v, PackedSequence)]
    if packed:
        raise TypeError(
            f"{where}: element {format_path(packed[0])} is a PackedSequence, whose rows interleave the time "
            "steps of different samples; unpack it (pad_packed_sequence) and act there, or select another "
            "element"
        )
    tensors = [(p, v) for p, v in selected if isinstance(v, torch.Tensor)]
    if not tensors:
        raise TypeError(f"{where}: {what} is {describe(value)}, which holds no tensor to act on")
    out: list[Leaf] = []
    batch = None
    for path, t in tensors:
        dim, how = dims.dim(path, t, inputs)
        if dims.unbatched(t, inputs):
            raise TypeError(
                f"{where}: {type(dims.module).__name__} was called without a batch "
                f"(element {format_path(path)} has shape {tuple(t.shape)}); nothing to act on"
            )
        if batch is None:
            if t.ndim <= dim:
                raise TypeError(
                    f"{where}: {what}{_elem(path)} is {describe(t)}, which has no batch dimension {dim}; "
                    "mixing needs a tensor that carries the batch"
                )
            batch = t.shape[dim]
        elif not _carries(t, dim, how, batch, path, out[0].name, site, where):
            continue  # no dimension of the batch's size: it does not carry the batch
        if floating and not blendable(t):
            raise TypeError(
                f"{where}: element {format_path(path)} is a {str(t.dtype).removeprefix('torch.')} tensor "
                f"of shape {tuple(t.shape)}, which cannot be blended; select the floating-point elements"
            )
        out.append(Leaf(path, t, dim))
    return out, batch


def _carries(t: torch.Tensor, dim: int, how: str, batch: int, path: Path, first: str, site: Site, where: str):
    """Whether ``t``, a tensor after the first (``first``, which set the ``batch``) at ``site``, carries the
    batch along ``dim`` (known ``how``): ``False`` for one with no dimension of the batch's size, an
    :class:`AmbiguousBatchError` (one line) where it cannot be told."""
    if how == "convention":
        if batch not in t.shape:
            return False
        if t.shape[0] != batch:  # (where dim 0 has the batch's size, the convention says it is the batch)
            raise AmbiguousBatchError(
                f"{where}: cannot tell the batch dimension of element {format_path(path)} of shape "
                f"{tuple(t.shape)} (the batch is {batch}, set by {first}); select the elements "
                f"to act on, e.g. '{site.layer}{first}', or pass batch_dim"
            )
    elif t.ndim <= dim or t.shape[dim] != batch:
        if site.paths is None and batch not in t.shape:
            return False
        raise AmbiguousBatchError(
            f"{where}: element {format_path(path)} of shape {tuple(t.shape)} does not have the batch "
            f"size {batch} at its batch dimension {dim}; select the elements to act on, or pass batch_dim"
        )
    return True


def _elem(path: Path) -> str:
    return f" element {format_path(path)}" if path else ""


def embedding_layers(model: nn.Module) -> list[str]:
    """The names of the model's ``nn.Embedding`` modules (where integer token ids become vectors)."""
    return [name for name, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]


def rebuild_inputs(inputs: Inputs, site: Site, value) -> tuple[tuple, dict]:
    """The model's ``(args, kwargs)`` with the mixed value put back: the first argument, or the selected
    arguments of the :class:`Inputs` copy."""
    if site.paths is None:
        return inputs.rebuild({inputs.first()[0]: value})
    return inputs.rebuild(value)

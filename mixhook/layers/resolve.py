"""Layer specs to the real module names and modules of one model (:func:`resolve_layers`).

A real name resolves to itself; a pattern to the names it matches, in ``named_modules()`` order; a
portable spec to the stage or block the model states (:mod:`.described`). Each keeps its selector. Every
failure is one line (:class:`UnknownLayerError`) naming the spec and what would be valid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from ..sites import INPUT, parse_site
from .described import describe
from .names import UnknownLayerError, _closest, _unknown_layer_message, expand_names
from .specs import Spec, parse_spec


class ResolvedLayers(dict):
    """What :func:`resolve_layers` returns: each real site spec (a module name with its selector, or
    ``"input"``) mapped to its module, in the order the specs were given (a pattern's matches in
    ``named_modules()`` order); :attr:`written` maps each back to the spec that named it."""

    def __init__(self):
        super().__init__()
        self.written: dict[str, str] = {}


def resolve_layers(model: nn.Module, specs: Sequence[str]) -> ResolvedLayers:
    """Map each spec's real site specs to their modules (``"input"`` maps to ``model`` itself).

    Raises :class:`UnknownLayerError` for the first spec that names nothing, and for two specs that name
    the same layer (``"layer2"`` and ``"stage:2"`` on a ResNet).
    """
    modules = dict(model.named_modules())
    out = ResolvedLayers()
    described: dict = {}  # what the model (or a scope in it) states, read at its first portable spec
    for text in specs:
        for name in expand(model, text, modules, described):
            if name in out:
                first = out.written[name]
                also = "" if first == text else f" ({text!r} is {name!r}, as {first!r} is)"
                raise UnknownLayerError(f"layer {name!r} is named more than once{also}; name each layer once")
            site = parse_site(name)
            out[name] = model if site.layer == INPUT else modules[site.layer]
            out.written[name] = text
    return out


def resolve_layer(model: nn.Module, spec: str, what: str = "layer") -> tuple[str, nn.Module]:
    """The one module ``spec`` names (its real name and the module); a spec that names several (a glob)
    is refused in one line, ``what`` naming the argument."""
    found = resolve_layers(model, [spec])
    if len(found) != 1:
        names = list(found)
        more = ", ..." if len(names) > 3 else ""
        raise UnknownLayerError(
            f"{what}={spec!r} names {len(names)} layers ({', '.join(names[:3])}{more}); name one"
        )
    return next(iter(found.items()))


def expand(model: nn.Module, text: str | Spec, modules: dict | None = None, described: dict | None = None):
    """The real site specs ``text`` names on ``model`` (one, or a pattern's several); ``described`` keeps
    what :func:`describe` read, by scope, for the specs that follow."""
    if not text:  # (the root's own empty name is not a layer)
        raise UnknownLayerError(_unknown_layer_message(model, ""))
    spec = text if isinstance(text, Spec) else parse_spec(text)
    modules = dict(model.named_modules()) if modules is None else modules
    if spec.kind in ("name", "pattern"):
        return expand_names(model, spec, modules)
    return (_portable(model, spec, modules, {} if described is None else described),)


def _portable(model: nn.Module, spec: Spec, modules: dict, described: dict) -> str:
    kind = type(model).__name__
    target, prefix = model, ""
    if spec.scope:
        if spec.scope not in modules:
            raise UnknownLayerError(
                f"layer {spec.text!r}: {kind} has no module {spec.scope!r} to look in"
                + _closest(spec.scope, list(modules))
            )
        target, prefix = modules[spec.scope], f"{spec.scope}."
    if spec.scope not in described:
        described[spec.scope] = describe(target)
    found = described[spec.scope]
    where = f"{kind}'s {spec.scope!r}" if spec.scope else kind
    if found is None:
        cls = type(target).__name__
        raise UnknownLayerError(
            f"layer {spec.text!r}: {where} ({cls}) states no stages or blocks (no registration; not a "
            f"timm, HuggingFace or torchvision model mixhook reads); state them with "
            f"mixhook.register_layers({cls}, stages=[...], blocks=[...]) or name a real layer"
        )
    if spec.kind == "stage":
        if not found.stages:
            raise UnknownLayerError(f"layer {spec.text!r}: {found.no_stages or f'{where} states no stages'}")
        names = [s.name for s in found.stages]
        return prefix + _pick(spec, names, "stage", where) + spec.select
    if not found.blocks:
        raise UnknownLayerError(f"layer {spec.text!r}: {found.no_blocks or f'{where} states no blocks'}")
    blocks = list(found.blocks)
    if spec.kind == "depth":
        return prefix + blocks[depth_index(spec.fraction, len(blocks))] + spec.select
    return prefix + _pick(spec, blocks, "block", where) + spec.select


def depth_index(fraction: float, count: int) -> int:
    """The block at ``fraction`` of ``count`` blocks: 0 the first, 1 the last, halves rounded up."""
    return int(math.floor(fraction * (count - 1) + 0.5))


def _pick(spec: Spec, names: list[str], kind: str, where: str) -> str:
    n = len(names)
    if not -n <= spec.index < n:
        shown = ", ".join(names) if n <= 6 else f"{', '.join(names[:3])}, ..., {names[-1]}"
        raise UnknownLayerError(
            f"layer {spec.text!r}: {where} has {n} {kind}s, {kind}:0..{n - 1} (or {kind}:-{n}..-1): {shown}"
        )
    return names[spec.index]


def portable_names(model: nn.Module) -> dict[str, list[str]]:
    """Each real layer name that a portable spec reaches on ``model``, with those specs
    (``{"layer2": ["stage:2"], "layer2.0": ["block:2"], ...}``); empty for a model that states nothing."""
    found = describe(model)
    out: dict[str, list[str]] = {}
    if found is None:
        return out
    for k, stage in enumerate(found.stages):
        out.setdefault(stage.name, []).append(f"stage:{k}")
    for k, block in enumerate(found.blocks):
        out.setdefault(block, []).append(f"block:{k}")
    return out

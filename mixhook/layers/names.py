"""Real layer names and patterns to the site specs they name on one model (:func:`expand_names`): a real
name to itself (``"blocks[-1]"``: a module list's member, as in Python), a glob or a slice to the names it
matches in ``named_modules()`` order. Every failure is one line (:class:`UnknownLayerError`) naming the spec
and what would be valid. The portable specs, which read what the model states, are :mod:`.resolve`'s."""

from __future__ import annotations

import difflib

from torch import nn

from ..sites import INPUT
from .specs import Spec, glob_regex

_LISTED_DEPTH = 2  # names with at most this many dotted parts are listed in full in errors
_LISTS = (nn.Sequential, nn.ModuleList)


class UnknownLayerError(KeyError, ValueError):
    """A layer spec that names nothing in the model (or nothing it can be sure of).

    A ``KeyError`` (a failed look-up) and a ``ValueError`` (a bad argument), so either ``except`` works.
    """

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0])


def expand_names(model: nn.Module, spec: Spec, modules: dict) -> tuple[str, ...]:
    """The real site specs a real name or a pattern (``spec.kind`` ``"name"`` or ``"pattern"``) names on
    ``model``, whose ``named_modules()`` are ``modules``."""
    if spec.kind == "name":
        return (_literal(model, spec, modules),)
    return _pattern(model, spec, modules)


def _literal(model: nn.Module, spec: Spec, modules: dict) -> str:
    site = spec.site
    if site.layer == INPUT:
        return spec.text
    if site.layer not in modules:
        raise UnknownLayerError(_unknown_layer_message(model, site.layer))
    module = modules[site.layer]
    paths = site.paths or ()
    if isinstance(module, _LISTS) and len(paths) == 1 and len(paths[0]) == 1 and isinstance(paths[0][0], int):
        return _members(spec, site.layer, module, paths[0][0])[0]  # "blocks[-1]": a member, as in Python
    return spec.text


def _members(spec: Spec, name: str, module: nn.Module, members) -> list[str]:
    if not isinstance(module, _LISTS):
        raise UnknownLayerError(
            f"layer {spec.text!r}: {name!r} is a {type(module).__name__}, not a module list; an index or a "
            "slice takes members of an nn.Sequential or nn.ModuleList"
        )
    children = [n for n, _ in module.named_children()]
    if isinstance(members, int):
        if not -len(children) <= members < len(children):
            raise UnknownLayerError(
                f"layer {spec.text!r}: {name!r} has {len(children)} members; index 0..{len(children) - 1} "
                f"(or -{len(children)}..-1)"
            )
        return [f"{name}.{children[members]}"]
    chosen = children[members]
    if not chosen:
        raise UnknownLayerError(
            f"layer {spec.text!r}: the slice takes none of {name!r}'s {len(children)} members"
        )
    return [f"{name}.{c}" for c in chosen]


def _pattern(model: nn.Module, spec: Spec, modules: dict) -> tuple[str, ...]:
    if "*" in spec.layer or "?" in spec.layer:
        regex = glob_regex(spec.layer)
        names = [n for n in modules if n and regex.match(n)]
        if not names:
            raise UnknownLayerError(
                f"layer {spec.text!r}: the glob matches no module of {type(model).__name__}"
                + _closest(spec.layer, list(modules))
            )
    elif spec.layer in modules:
        names = [spec.layer]
    else:
        raise UnknownLayerError(_unknown_layer_message(model, spec.layer))
    if spec.members is not None:
        names = [m for n in names for m in _members(spec, n, modules[n], spec.members)]
    return tuple(n + spec.select for n in names)


def _closest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, [v for v in valid if v], n=3, cutoff=0.5)
    return f"; closest: {', '.join(repr(c) for c in close)}" if close else "; see mixhook-layers"


def _unknown_layer_message(model: nn.Module, name: str) -> str:
    valid = [INPUT] + [n for n, _ in model.named_modules() if n]
    wrapped = sorted((n for n in valid if n.endswith(f".{name}")), key=len)  # PEFT: base_model.model.
    if wrapped:
        hint = f"; did you mean {wrapped[0]!r} (the model wraps its layers: name them as it does)?"
    else:
        close = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else "."
    listed = [n for n in valid if n.count(".") < _LISTED_DEPTH]
    deeper = [n for n in valid if n.count(".") >= _LISTED_DEPTH]
    more = f" (and {len(deeper)} deeper modules such as {deeper[0]!r})" if deeper else ""
    return f"unknown layer {name!r} in {type(model).__name__}{hint} Valid layers: {', '.join(listed)}{more}"

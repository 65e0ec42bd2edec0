"""What a layer spec says, read before any model is seen: a real name (``"layer2"``, ``"lstm[1.0]"``), a
portable spec (``"stage:2"``, ``"block:-1"``, ``"depth:0.5"``, scoped ``"encoder.block:3"``, each with an
optional selector: ``"block:3[0]"``) or a pattern on real names (globs ``"layers.*.mlp"``, ``"**.attn"``;
an index or slice of a module list ``"blocks[2:6]"``, ``"stages.1.blocks[-1]"``).

Parsing refuses a malformed spec in one line; what it names is found on a model by :mod:`.resolve`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..sites import Site, parse_site

KINDS = ("stage", "block", "depth")

_PORTABLE = re.compile(
    r"^(?:(?P<scope>[^\[\]:]+)\.)?(?P<kind>[A-Za-z_]+):(?P<arg>[^\[\]]*)(?:\[(?P<select>[^\[\]]*)\])?$"
)
_BRACKET = re.compile(r"^(?P<layer>[^\[\]]+?)\[(?P<inside>[^\[\]]*)\]$")
_INDEX = re.compile(r"^\s*-?\d+\s*$")
_SLICE = re.compile(r"^\s*(-?\d+)?\s*:\s*(-?\d+)?\s*(?::\s*(-?\d+)?\s*)?$")


@dataclass(frozen=True)
class Spec:
    """A parsed layer spec.

    ``kind``: ``"name"`` (a real name, perhaps with a selector: ``site``), ``"stage"``/``"block"``/
    ``"depth"`` (portable: ``index`` or ``fraction``, within the module ``scope``), or ``"pattern"`` (a
    glob in ``layer``, and/or ``members``: an index or slice of the module list ``layer`` names).
    ``select``: the selector carried to every module found (``"[0]"``) or ``""``."""

    text: str
    kind: str
    layer: str = ""
    scope: str = ""
    index: int | None = None
    fraction: float | None = None
    members: slice | int | None = None
    select: str = ""
    site: Site | None = None

    @property
    def portable(self) -> bool:
        return self.kind in KINDS


def parse_spec(text: str) -> Spec:
    """Read ``text``; a malformed spec raises ``ValueError`` naming it and the valid forms."""
    portable = _PORTABLE.match(text)
    if portable and "*" not in text and "?" not in text:
        return _portable(text, portable)
    bracket = _BRACKET.match(text)
    if bracket and ":" in bracket["inside"] and _SLICE.match(bracket["inside"]):
        start, stop, step = (int(v) if v else None for v in _SLICE.match(bracket["inside"]).groups())
        if step == 0:
            raise ValueError(f"layer spec {text!r}: a slice's step cannot be 0")
        return Spec(text, "pattern", layer=bracket["layer"].strip(), members=slice(start, stop, step))
    if "*" in text or "?" in text:
        layer, select = text, ""
        if bracket:
            inside = bracket["inside"]
            layer = bracket["layer"].strip()
            if _INDEX.match(inside):  # (an index on each module list the glob finds: "stages.*.blocks[-1]")
                return Spec(text, "pattern", layer=layer, members=int(inside))
            select = f"[{inside}]"
            parse_site(f"x{select}")
        _check_glob(text, layer)
        return Spec(text, "pattern", layer=layer, select=select)
    site = parse_site(text)
    return Spec(text, "name", layer=site.layer, site=site)


def _portable(text: str, match: re.Match) -> Spec:
    kind, arg = match["kind"], match["arg"].strip()
    select = "" if match["select"] is None else f"[{match['select']}]"
    if select:
        parse_site(f"x{select}")  # the selector's own checks
    scope = (match["scope"] or "").strip()
    if kind not in KINDS:
        raise ValueError(
            f"layer spec {text!r}: {kind!r} is not a portable kind; write stage:k, block:k or depth:f "
            "(k an index, negative from the end; f a fraction of the depth in [0, 1])"
        )
    if kind == "depth":
        try:
            fraction = float(arg)
        except ValueError:
            fraction = float("nan")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(
                f"layer spec {text!r}: depth takes a fraction of the model's depth in [0, 1] (0 the "
                f"first block, 1 the last), got {arg!r}"
            )
        return Spec(text, kind, scope=scope, fraction=fraction, select=select)
    if not _INDEX.match(arg):
        raise ValueError(
            f"layer spec {text!r}: {kind} takes an integer index (negative from the end), got {arg!r}"
        )
    return Spec(text, kind, scope=scope, index=int(arg), select=select)


def _check_glob(text: str, layer: str) -> None:
    for part in layer.split("."):
        if not part or ("**" in part and part != "**"):
            raise ValueError(
                f"layer spec {text!r}: a glob's parts are names with * (any characters within one part) "
                "and ? (one character), or ** alone (any number of parts): 'layers.*.mlp', '**.attn'"
            )


def glob_regex(layer: str) -> re.Pattern:
    """The regular expression a glob on dotted module names means: ``*`` any characters within one
    part, ``?`` one character, a part ``**`` any number of parts (none included)."""
    out, parts = [], layer.split(".")
    for i, part in enumerate(parts):
        if part == "**":
            out.append(r"(?:[^.]+\.)*" if i < len(parts) - 1 else r"(?:[^.]+(?:\.[^.]+)*)?")
            continue
        piece = "".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in part)
        out.append(piece + (r"\." if i < len(parts) - 1 else ""))
    return re.compile("^" + "".join(out) + "$")


def written_site(text: str) -> Site:
    """The site of a spec as written, before a model resolves it: a real name's own; for a portable spec
    or a pattern, the spec itself as its layer (it names no module until resolved)."""
    spec = parse_spec(text)
    return spec.site if spec.site is not None else Site(text, text)

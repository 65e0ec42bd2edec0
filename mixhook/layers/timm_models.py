"""Stages and blocks of a timm model, from what it states: ``feature_info`` (one entry per feature
``features_only``/``forward_intermediates`` return: its module, reduction and channels).

- **Stages** are the entries of ``feature_info``, in its order, where they form a pyramid (``stage:k`` is
  timm's ``out_indices=(k,)``: a ResNet counts its stem as 0, a ConvNeXt does not). A plain transformer
  (every entry at one reduction: ViT, DeiT, EVA, Mixer) has no stages; its entries are its blocks.
- **Blocks** are the modules the listed stages hold in order: a stage that is a module list gives its
  members, one with a ``blocks`` list gives those. Where the listed modules are members of one list (a
  ViT's ``blocks``, an EfficientNet's ``blocks``, whose entries are its stage ends), every member of that
  list is taken, so unlisted stages are not skipped. A listed module between the first and the last that
  holds no block list leaves the block list unknown (refused, not guessed).

No timm import: a model is recognised by its ``feature_info``.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from .structure import Stage, Structure

_LISTS = (nn.Sequential, nn.ModuleList)


def describe(model: nn.Module) -> Structure | None:
    info = getattr(model, "feature_info", None)
    entries = _entries(info)
    if entries is None:
        return None
    kind = type(model).__name__
    modules = dict(model.named_modules())
    missing = [e["module"] for e in entries if e["module"] not in modules]
    names = [e["module"] for e in entries]
    if missing:
        why = f"timm's feature_info of {kind} names {missing[0]!r}, which is not one of its modules"
        return Structure("timm feature_info", no_stages=why, no_blocks=why)
    repeated = sorted(n for n, c in Counter(names).items() if c > 1)
    if repeated:
        why = f"timm's feature_info of {kind} lists {repeated[0]!r} twice (one model, several branches)"
        return Structure("timm feature_info", no_stages=why, no_blocks=why)
    stages = tuple(Stage(e["module"], int(e["reduction"]), int(e["num_chs"])) for e in entries)
    pyramid = len({s.reduction for s in stages}) > 1
    blocks, no_blocks = _blocks(modules, names, pyramid)
    if not pyramid:  # a plain transformer: one reduction
        why = (
            f"{kind} has no feature pyramid (every feature timm lists is at reduction "
            f"{stages[0].reduction}); name a block: block:k or depth:f"
        )
        return Structure("timm feature_info", blocks=blocks, no_stages=why, no_blocks=no_blocks)
    return Structure("timm feature_info", stages, blocks, no_blocks=no_blocks)


def _entries(info) -> list[dict] | None:
    if not isinstance(info, (list, tuple)) and type(info).__name__ != "FeatureInfo":
        return None
    entries = list(getattr(info, "info", info))
    keys = {"module", "reduction", "num_chs"}
    if not entries or not all(isinstance(e, dict) and keys <= e.keys() for e in entries):
        return None
    return entries


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _inner(modules: dict[str, nn.Module], name: str) -> list[str]:
    """The blocks a stage module holds: a list's members, or its ``blocks`` list's."""
    module = modules[name]
    if isinstance(module, _LISTS):
        return [f"{name}.{n}" for n, _ in module.named_children()]
    held = getattr(module, "blocks", None)
    if isinstance(held, _LISTS) and modules.get(f"{name}.blocks") is held:
        return [f"{name}.blocks.{n}" for n, _ in held.named_children()]
    return []


def _blocks(modules: dict[str, nn.Module], listed: list[str], pyramid: bool) -> tuple[tuple[str, ...], str]:
    parents = Counter(_parent(n) for n in listed if isinstance(modules.get(_parent(n)), _LISTS))
    units = listed
    if parents:  # the listed modules are members of one list: every member of it, in order
        parent, count = parents.most_common(1)[0]
        if count > 1:
            units = [f"{parent}.{n}" for n, _ in modules[parent].named_children()]
    inner = {u: _inner(modules, u) for u in units}
    if not any(inner.values()):
        # the members are the blocks where they are one kind and either a plain transformer's (no
        # pyramid) or more than the stage ends listed (Hiera's blocks); else they are stages (NesT's levels)
        same = all(type(modules[u]) is type(modules[units[0]]) for u in units)
        if units is not listed and same and (not pyramid or len(units) > len(listed)):
            return tuple(units), ""
        return (), "timm's feature_info names its stages but no block list inside them"
    holding = [i for i, u in enumerate(units) if inner[u]]
    for i in range(holding[0], holding[-1] + 1):
        unit = units[i]
        if not inner[unit] and unit in listed and any(True for _ in modules[unit].parameters()):
            kind = type(modules[unit]).__name__
            return (), f"timm's feature_info lists {unit!r} ({kind}), which holds no block list"
    # a member without parameters or children is a reshape between blocks (EfficientFormer's Flat)
    blocks = tuple(b for u in units for b in inner[u] if _holds(modules[b]))
    plain = next((b for b in blocks if not any(True for _ in modules[b].children())), None)
    if plain is not None:  # a list of plain layers (a stem's conv, norm, act) is not a block list
        return (), f"{_parent(plain)!r} holds plain layers ({type(modules[plain]).__name__}), not blocks"
    return blocks, ""


def _holds(module: nn.Module) -> bool:
    return any(True for _ in module.children()) or any(True for _ in module.parameters())

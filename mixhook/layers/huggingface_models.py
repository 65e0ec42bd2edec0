"""Stages and blocks of a HuggingFace model, from what its config states.

- **Blocks**: the module list whose length is the config's layer count (``num_hidden_layers``, and an
  encoder-decoder's ``encoder_layers``/``num_layers`` and ``decoder_layers``/``num_decoder_layers``), its
  members all one class; lists inside another candidate's members (T5's per-block sublayers) are not
  candidates. Where two lists qualify (an encoder-decoder's encoder and decoder) the spec must name one,
  scoped: ``encoder.block:k``, ``model.decoder.block:k`` (the scope's own config states its one list).
- **Stages** (a hierarchical vision model whose config states ``depths``: ConvNeXt, Swin): the module list
  with one member per depth, each holding a list of that many blocks; the blocks are those lists' members.

A model is recognised by its config (``model_type`` and ``to_dict``); PEFT's ``PeftModel`` forwards its
config, and its names carry PEFT's prefix. No transformers import.
"""

from __future__ import annotations

from torch import nn

from .structure import Stage, Structure

_COUNTS = ("num_hidden_layers", "num_layers", "encoder_layers", "num_decoder_layers", "decoder_layers")
_LISTS = (nn.ModuleList, nn.Sequential)


def describe(model: nn.Module) -> Structure | None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type") or not callable(getattr(config, "to_dict", None)):
        return None
    kind = type(model).__name__
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, _LISTS) and len(m)]
    depths = getattr(config, "depths", None)
    if isinstance(depths, (list, tuple)) and depths and all(isinstance(d, int) for d in depths):
        return _hierarchical(kind, lists, list(depths))
    counts = {int(v) for k in _COUNTS if isinstance(v := getattr(config, k, None), int) and v > 0}
    found = [
        n for n, m in lists
        if len(m) in counts and len({type(c) for c in m}) == 1 and _composite(m)
    ]  # fmt: skip
    found = [n for n in found if not any(n.startswith(f"{o}.") for o in found if o != n)]
    no_stages = f"{kind}'s config states no stages (no depths); name a block: block:k or depth:f"
    if len(found) == 1:
        return Structure("HuggingFace config", blocks=_members(found[0], model), no_stages=no_stages)
    if not found:
        why = (
            f"{kind} has no module list of its config's {sorted(counts)} layers (ALBERT shares one layer "
            "across its depth)"
            if counts
            else f"{kind}'s config states no layer count"
        )
        return Structure("HuggingFace config", no_stages=no_stages, no_blocks=why)
    scopes = [n.rpartition(".")[0] for n in found]
    why = f"{kind} has {len(found)} block lists ({', '.join(found)}); name one: " + ", ".join(
        f"{s}.block:k" if s else "" for s in scopes
    )
    return Structure("HuggingFace config", no_stages=no_stages, no_blocks=why)


def _composite(modules: nn.Module) -> bool:
    return all(any(True for _ in m.children()) for m in modules)


def _members(name: str, model: nn.Module) -> tuple[str, ...]:
    return tuple(f"{name}.{n}" for n, _ in model.get_submodule(name).named_children())


def _hierarchical(kind: str, lists, depths: list[int]) -> Structure:
    for name, stages in lists:
        if len(stages) != len(depths):
            continue
        held = []
        for i, stage in enumerate(stages):
            inner = [
                f"{name}.{i}.{n}" for n, m in stage.named_children()
                if isinstance(m, _LISTS) and len(m) == depths[i] and _composite(m)
            ]  # fmt: skip
            if len(inner) != 1:
                break
            held.append(inner[0])
        else:
            blocks = tuple(
                f"{h}.{n}" for h, stage in zip(held, stages, strict=True)
                for n, _ in stage.get_submodule(h.rpartition(".")[2]).named_children()
            )  # fmt: skip
            return Structure(
                "HuggingFace config", tuple(Stage(f"{name}.{i}") for i in range(len(depths))), blocks
            )
    why = f"{kind}'s config states depths {depths}, but no module list holds stages of those depths"
    return Structure("HuggingFace config", no_stages=why, no_blocks=why)

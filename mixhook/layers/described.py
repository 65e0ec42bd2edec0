"""What a model states about its stages and blocks, read (:func:`describe`): its registration
(:func:`~.structure.register_layers`, expanded on the model), else its library's statement
(:mod:`.timm_models`, :mod:`.huggingface_models`, :mod:`.torchvision_models`, in that order), else that of
the one outermost submodule that states something. :mod:`.structure` holds what is read, below the
readers."""

from __future__ import annotations

from torch import nn

from . import huggingface_models, timm_models, torchvision_models
from .names import UnknownLayerError, expand_names
from .specs import parse_spec
from .structure import Stage, Structure, _Registration, registered


def own_structure(model: nn.Module) -> Structure | None:
    """What ``model`` itself states (its registration or its library), or ``None``."""
    registration = registered(model)
    if registration is not None:
        return expand_registered(model, registration)
    for source in (timm_models, huggingface_models, torchvision_models):
        found = source.describe(model)
        if found is not None:
            return found
    return None


def describe(model: nn.Module) -> Structure | None:
    """What ``model`` states about its stages and blocks: its own statement, else that of the one
    outermost submodule that states something (names prefixed); ``None`` when nothing does. Where
    several submodules state their own (a user's model holding two timm backbones) the structure says
    which to name, in ``no_stages``/``no_blocks``."""
    own = own_structure(model)
    if own is not None:
        return own
    found = []
    pending = list(model.named_children())
    while pending:
        name, child = pending.pop(0)
        inner = own_structure(child)
        if inner is not None:
            found.append((name, inner))
        else:
            pending.extend((f"{name}.{n}", c) for n, c in child.named_children())
    if not found:
        return None
    if len(found) == 1:
        name, inner = found[0]
        return inner.prefixed(f"{name}.")
    scopes = [name for name, _ in found]
    why = f"it holds {len(found)} models that state their own ({', '.join(scopes)}); name one: " + ", ".join(
        f"{s}.block:k" for s in scopes[:3]
    )
    return Structure("several models inside", no_stages=why, no_blocks=why)


def expand_registered(model: nn.Module, registration: _Registration) -> Structure:
    """A registration's stages and blocks, expanded on ``model``."""
    modules = dict(model.named_modules())

    def names(value, what: str) -> list:
        if value is None:
            return []
        listed = value(model) if callable(value) else value
        out = []
        for item in listed:
            if isinstance(item, Stage):
                out.append(item)
                continue
            spec = parse_spec(item)
            if spec.portable:
                raise ValueError(
                    f"register_layers({type(model).__name__}, {what}=...): {item!r} is portable; state real "
                    "names, globs or slices"
                )
            try:
                out.extend(expand_names(model, spec, modules))
            except UnknownLayerError as err:
                raise UnknownLayerError(f"{registration.source}: {what}: {err}") from None
        return out

    stages = [s if isinstance(s, Stage) else Stage(s) for s in names(registration.stages, "stages")]
    blocks = [b.name if isinstance(b, Stage) else b for b in names(registration.blocks, "blocks")]
    cls = type(model).__name__
    return Structure(
        registration.source, tuple(stages), tuple(blocks),
        no_stages="" if stages else f"{cls}'s registration states no stages",
        no_blocks="" if blocks else f"{cls}'s registration states no blocks",
    )  # fmt: skip

"""What a model states about its own layers: its stages (the feature pyramid's levels) and its main
sequence of repeated blocks, as real module names in forward order. Read, in this order, from:

1. a registration for the model's class (:func:`register_layers`, one call for a user's own model);
2. timm's ``feature_info`` (the stages ``features_only``/``forward_intermediates`` use) and the block lists
   inside those stages (:mod:`.timm_models`);
3. a HuggingFace model's config (``num_hidden_layers``, an encoder's and a decoder's layer counts,
   ``depths``) and the module lists of that length (:mod:`.huggingface_models`, through PEFT wrappers);
4. torchvision's families (ResNet and ResNeXt/Wide ResNet, ConvNeXt, EfficientNet, MobileNet V2/V3,
   RegNet, ViT, Swin, MaxViT: :mod:`.torchvision_models`).

A model none of them describes states nothing: a portable spec on it is refused, never guessed from
module names. A model that wraps a described one (a user's ``nn.Module`` around a timm backbone, PEFT's
``PeftModel``) is described by it, its names prefixed. This module holds what is stated and the
registrations, below the readers; reading a model is :mod:`.described`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class Stage:
    """One stage: the module whose output is the stage's, and (where the model states them) the stage's
    reduction of the input's side and its channels."""

    name: str
    reduction: int | None = None
    channels: int | None = None


@dataclass(frozen=True)
class Structure:
    """A model's stages and blocks (real names, forward order), what stated them (``source``), and for
    what it does not state, why (one phrase each)."""

    source: str
    stages: tuple[Stage, ...] = ()
    blocks: tuple[str, ...] = ()
    no_stages: str = ""
    no_blocks: str = ""

    def prefixed(self, prefix: str) -> Structure:
        """The same structure seen from a model that holds this one at ``prefix`` (``"backbone."``)."""
        stages = tuple(Stage(prefix + s.name, s.reduction, s.channels) for s in self.stages)
        return Structure(
            self.source, stages, tuple(prefix + b for b in self.blocks), self.no_stages, self.no_blocks
        )


Names = Sequence[str] | Callable[[nn.Module], Sequence]


@dataclass(frozen=True)
class _Registration:
    stages: Names | None = None
    blocks: Names | None = None
    source: str = field(default="")


_REGISTERED: dict[type, _Registration] = {}


def register_layers(
    cls: type[nn.Module], *, stages: Names | None = None, blocks: Names | None = None
) -> None:
    """State the stages and blocks of ``cls``'s models, so portable specs (``stage:k``, ``block:k``,
    ``depth:f``) reach them. Each is a list of layer specs on real names, globs and slices included
    (``blocks=["layer*.*"]``, ``stages=["conv1", "layer1", "layer2", "layer3"]``), expanded on each model
    in the order given, or a function from the model to such a list (or to :class:`Stage` objects, which
    also state reductions and channels). Subclasses inherit it; registering a class again replaces it.

    Example::

        mixhook.register_layers(MyNet, stages=["stem", "down1", "down2"], blocks=["body.*"])
        ManifoldMixup(["input", "stage:1", "depth:0.5"]).attach(MyNet())
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_layers() takes an nn.Module class, got {cls!r}")
    if stages is None and blocks is None:
        raise ValueError(f"register_layers({cls.__name__}): state its stages, its blocks or both")
    for what, value in (("stages", stages), ("blocks", blocks)):
        if value is not None and not callable(value):
            if isinstance(value, str) or not all(isinstance(v, (str, Stage)) for v in value):
                raise TypeError(
                    f"register_layers({cls.__name__}, {what}=...): a list of layer specs or a function of "
                    f"the model, got {value!r}"
                )
    _REGISTERED[cls] = _Registration(stages, blocks, f"registered for {cls.__name__}")


def registered(model: nn.Module) -> _Registration | None:
    for cls in type(model).__mro__:
        if cls in _REGISTERED:
            return _REGISTERED[cls]
    return None

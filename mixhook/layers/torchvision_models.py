"""Stages and blocks of torchvision's classification families, which state no metadata of their own: each
family's classes build one layout, read here from the classes' attributes (numbered as timm numbers the
same architecture, so ``stage:k`` is the same place in a torchvision and a timm ResNet).

=============================  ===============================================  ==========================
family (class)                 stages                                            blocks
=============================  ===============================================  ==========================
ResNet, ResNeXt, Wide ResNet   ``relu`` (the stem), ``layer1`` .. ``layer4``     ``layerN.i``
ConvNeXt                       the members of ``features`` that are block lists  their members
EfficientNet, MobileNet V2/V3  ``features`` members at each reduction's end      ``features`` between stem
                               (from the convolutions' strides)                  and head (and inside)
RegNet                         ``stem``, ``trunk_output.block1`` ..              ``trunk_output.blockN.i``
VisionTransformer              none (no pyramid)                                 ``encoder.layers.*``
SwinTransformer (V1, V2)       the members of ``features`` that are block lists  their members
MaxVit                         ``stem``, ``blocks.0`` ..                        ``blocks.N.layers.i``
=============================  ===============================================  ==========================

A torchvision model outside these families (DenseNet, GoogLeNet, Inception, ShuffleNet, SqueezeNet,
MNASNet, video models) states nothing: refused. No torchvision import: a model is recognised by its class,
and only once torchvision's module defining it is loaded.
"""

from __future__ import annotations

import sys

from torch import nn

from .structure import Stage, Structure

_NO_PYRAMID = "a ViT has no feature pyramid; name a block: block:k or depth:f"


def _cls(module: str, name: str):
    loaded = sys.modules.get(f"torchvision.models.{module}")
    return getattr(loaded, name, None) if loaded is not None else None


def _is(model: nn.Module, module: str, *names: str) -> bool:
    classes = tuple(c for c in (_cls(module, n) for n in names) if c is not None)
    return bool(classes) and isinstance(model, classes)


def describe(model: nn.Module) -> Structure | None:
    if _is(model, "resnet", "ResNet"):
        stages = ("relu", "layer1", "layer2", "layer3", "layer4")
        return _structure("torchvision ResNet", model, stages, [f"layer{i}" for i in range(1, 5)])
    if _is(model, "convnext", "ConvNeXt"):
        lists = _block_lists(model.features, "features", _cls("convnext", "CNBlock"))
        return _structure("torchvision ConvNeXt", model, lists, lists)
    if _is(model, "swin_transformer", "SwinTransformer"):
        names = ("SwinTransformerBlock", "SwinTransformerBlockV2")
        kinds = tuple(c for c in (_cls("swin_transformer", n) for n in names) if c)
        lists = _block_lists(model.features, "features", kinds)
        return _structure("torchvision Swin", model, lists, lists)
    if _is(model, "regnet", "RegNet"):
        trunk = [f"trunk_output.{n}" for n, _ in model.trunk_output.named_children()]
        return _structure("torchvision RegNet", model, ["stem", *trunk], trunk)
    if _is(model, "maxvit", "MaxVit"):
        stages = [f"blocks.{n}" for n, _ in model.blocks.named_children()]
        return _structure("torchvision MaxViT", model, ["stem", *stages], [f"{s}.layers" for s in stages])
    if _is(model, "vision_transformer", "VisionTransformer"):
        blocks = tuple(f"encoder.layers.{n}" for n, _ in model.encoder.layers.named_children())
        return Structure("torchvision ViT", blocks=blocks, no_stages=_NO_PYRAMID)
    if (
        _is(model, "efficientnet", "EfficientNet")
        or _is(model, "mobilenetv2", "MobileNetV2")
        or _is(model, "mobilenetv3", "MobileNetV3")
    ):
        return _by_strides(type(model).__name__, model.features)
    return None


def _structure(source: str, model: nn.Module, stages, lists) -> Structure:
    blocks = tuple(f"{name}.{n}" for name in lists for n, _ in model.get_submodule(name).named_children())
    return Structure(source, tuple(Stage(s) for s in stages), blocks)


def _block_lists(features: nn.Module, prefix: str, kinds) -> list[str]:
    """The members of ``features`` that are lists of the family's blocks (its stages; the others are the
    stem and the downsampling layers between them)."""
    if not kinds:
        return []
    return [
        f"{prefix}.{n}" for n, m in features.named_children()
        if isinstance(m, nn.Sequential) and len(m) and all(isinstance(c, kinds) for c in m)
    ]  # fmt: skip


def _stride(module: nn.Module) -> int:
    """How much ``module`` reduces a map's side, from its convolutions' strides (their product, along the
    main path: these families' blocks have no strided shortcut)."""
    out = 1
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            out *= int(m.stride[0])
    return out


def _by_strides(kind: str, features: nn.Sequential) -> Structure:
    """EfficientNet and MobileNet: ``features`` is the stem, the blocks (an EfficientNet's grouped per
    stage in lists) and the head's convolution; a stage ends where the next member reduces again."""
    members = [(n, m) for n, m in features.named_children()]
    body = members[1:-1]
    blocks = tuple(
        f"features.{n}.{c}" if c else f"features.{n}"
        for n, m in body
        for c in ([k for k, _ in m.named_children()] if isinstance(m, nn.Sequential) else [""])
    )  # fmt: skip
    reduction, ends = _stride(members[0][1]), []
    for i, (name, module) in enumerate(body):
        reduction *= _stride(module)
        following = body[i + 1][1] if i + 1 < len(body) else None
        if following is None or _stride(following) > 1:
            ends.append(Stage(f"features.{name}", reduction))
    return Structure(f"torchvision {kind}", tuple(ends), blocks)

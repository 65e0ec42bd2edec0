"""Any torchvision classification model by name, adapted to the data's channels and classes.

torchvision is imported when a model is asked for (it takes seconds, torch._dynamo with it), so that a run
of another model does not pay for it."""

from __future__ import annotations

from torch import nn


def classification_models() -> list[str]:
    """The names of torchvision's classification models (``resnet18``, ``vit_b_16``, ...)."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def torchvision_model(name: str, in_channels: int = 3, num_classes: int = 1000, **options) -> nn.Module:
    """``torchvision.models.get_model(name, weights=None, num_classes=num_classes, **options)``, randomly
    initialised. ``options`` go to the model's builder (``image_size=32`` for a ViT on CIFAR-sized
    images: ``+model.image_size=32`` on the command line).

    When ``in_channels`` is not 3 (the 1-channel digits), the first ``Conv2d`` in ``named_modules()``
    order (the stem of every torchvision classifier, never a grouped one) is replaced by one with
    ``in_channels`` inputs and otherwise the same settings, so every module keeps its torchvision name
    (``layer2``, ``features.3``, ...).
    """
    valid = classification_models()
    if name not in valid:
        import difflib

        close = difflib.get_close_matches(name, valid, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"model.name={name!r} is not a torchvision classification model{hint} Valid: {', '.join(valid)}"
        )
    import torchvision

    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **options)
    if in_channels != 3:
        _replace_first_conv(model, in_channels)
    return model


def _replace_first_conv(model: nn.Module, in_channels: int) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            new = nn.Conv2d(
                in_channels,
                module.out_channels,
                module.kernel_size,
                stride=module.stride,
                padding=module.padding,
                dilation=module.dilation,
                bias=module.bias is not None,
                padding_mode=module.padding_mode,
            )
            setattr(parent, child, new)
            return
    raise ValueError(f"{type(model).__name__} has no Conv2d to adapt to {in_channels} input channels")

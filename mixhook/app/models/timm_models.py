"""Any timm model by name, randomly initialised (no download) and adapted to the data."""

from __future__ import annotations

from torch import nn


def timm_model(name: str, in_channels: int = 3, num_classes: int = 1000, **options) -> nn.Module:
    """``timm.create_model(name, pretrained=False, in_chans=in_channels, num_classes=num_classes,
    **options)``: timm adapts the stem to the data's channels itself, and ``options`` go to the model
    (``+model.img_size=8 +model.patch_size=4`` for a ViT on digits). Needs ``timm`` installed (the ``dev``
    and ``bench`` extras have it)."""
    try:
        import timm
    except ImportError:
        raise ValueError("model=timm needs the timm package: pip install timm") from None
    if name not in timm.list_models():
        import difflib

        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"model.name={name!r} is not a timm model{hint} (timm.list_models() lists them)")
    return timm.create_model(name, pretrained=False, in_chans=in_channels, num_classes=num_classes, **options)

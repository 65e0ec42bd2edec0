"""Layer specs: turn the names a user writes into the modules of a model.

A layer is named as ``model.named_modules()`` spells it (``"layer2"``, ``"layer3.1.conv2"``), or by the
special name ``"input"``, which stands for the model's own input; either may carry a selector
(``"lstm[1.0]"``, ``"input[x,meta]"``, see :mod:`mixhook.sites`). Beside real names:

- **portable specs**, read from what the model states about itself (:mod:`.structure`): ``stage:k`` (the
  output of the k-th stage of its feature pyramid), ``block:k`` (the k-th block of its main sequence of
  repeated blocks), ``depth:f`` (the block at fraction ``f`` of that sequence); ``k`` negative from the
  end; scoped to a submodule (``encoder.block:3``) and with a selector (``block:3[0]``);
- **patterns** on real names: globs (``"layers.*.mlp"``: ``*`` within one dotted part, ``**`` any number
  of parts) and an index or slice of a module list (``"blocks[2:6]"``, ``"stages.1.blocks[-1]"``,
  ``"stages.*.blocks[-1]"``): as Python indexes ``model.blocks[2:6]``.

A hook resolves its specs each time it is attached (:func:`resolve_layers`), so a spec follows the model
it is attached to. Unknown names raise :class:`UnknownLayerError` with the closest names.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..sites import INPUT, Inputs, parse_site
from .described import describe
from .names import UnknownLayerError
from .resolve import ResolvedLayers, depth_index, expand, portable_names, resolve_layer, resolve_layers
from .specs import parse_spec
from .structure import Stage, Structure, register_layers

__all__ = [
    "INPUT",
    "ResolvedLayers",
    "Stage",
    "Structure",
    "UnknownLayerError",
    "depth_index",
    "describe",
    "expand",
    "fastai_layers",
    "layer_names",
    "normalize_layers",
    "parse_spec",
    "portable_names",
    "register_layers",
    "resolve_layer",
    "resolve_layers",
    "trace_outputs",
]


def normalize_layers(layer: str | Sequence[str]) -> tuple[str, ...]:
    """Validate a layer spec (one spec or a list of specs) and return it as a tuple of specs."""
    names = (layer,) if isinstance(layer, str) else layer
    try:
        names = tuple(names)
    except TypeError:
        raise TypeError(
            f"layer must be a module name or a list of names, got {type(layer).__name__} {layer!r}"
        ) from None
    if not names:
        raise ValueError("layer must name at least one layer, got an empty list")
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"layer names must be non-empty strings, got {name!r} in {list(names)!r}")
        parse_spec(name)  # a malformed spec or selector is refused here, before any model is seen
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"layer lists {duplicates} more than once; name each layer once")
    return names


def layer_names(model: nn.Module) -> list[str]:
    """Every name a layer spec may use for ``model``: ``"input"`` then ``named_modules()`` order."""
    return [INPUT] + [name for name, _ in model.named_modules() if name]


# fastai ManifoldMixup's non_mixable_module_types (nestordemeure/ManifoldMixupV2, manifold_mixup.py), less
# fastai's own AWD_LSTM (matched by name below): modules that only pass their input on, and recurrent ones.
_FASTAI_NON_MIXABLE = (
    nn.Sequential, nn.Dropout, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.LSTM, nn.LSTMCell, nn.GRU, nn.GRUCell, nn.RNN, nn.RNNBase, nn.RNNCell, nn.RNNCellBase,
)  # fmt: skip


def fastai_layers(model: nn.Module, input: bool = True) -> list[str]:  # noqa: A002 (fastai's word)
    """The layers fastai's ``ManifoldMixup`` callback draws from when given no ``module_list``
    (nestordemeure/ManifoldMixupV2 at 9f066d6, ``manifold_mixup.py``, ``_get_mixup_module_list``), as
    names for any mixer's ``layer``: ``ManifoldMixup(fastai_layers(model), mode="elem", dominant=True,
    alpha=0.4)`` is that callback. The first rule that finds something decides:

    1. a fastai ``TabularModel``: its ``nn.Linear`` layers;
    2. fastai ``UnetBlock`` modules (the decoder of a U-Net);
    3. modules whose ``str(type(m)).lower()`` contains ``"block"`` or ``"bottleneck"`` (residual blocks:
       torchvision's ``BasicBlock``, timm's ViT ``Block``; the test is fastai's, on the module path too);
    4. every module not of a non-mixable type (containers ``nn.Sequential``, dropout, batch norm,
       recurrent layers).

    fastai's own ``ManifoldMixupModule`` wrapper (rule 0) has no counterpart here: name the layers. Its
    rule 4 also lists the model itself (mixing the logits); that is left out: mixing a model's output is
    output mixup, not a hidden-state mix. ``input=True`` (fastai's ``use_input_mixup``, its default) puts
    ``"input"`` first: fastai draws the input as one more candidate, uniformly with the others.
    Raises ``ValueError`` when no rule finds a layer, as fastai does."""
    named = [(name, m) for name, m in model.named_modules() if name]
    kind = type(model).__name__
    rules = [
        lambda m: kind == "TabularModel" and isinstance(m, nn.Linear),
        lambda m: type(m).__name__ == "UnetBlock",
        lambda m: "block" in str(type(m)).lower() or "bottleneck" in str(type(m)).lower(),
        lambda m: not isinstance(m, _FASTAI_NON_MIXABLE) and type(m).__name__ != "AWD_LSTM",
    ]
    for rule in rules:
        names = [name for name, m in named if rule(m)]
        if names:
            return [INPUT, *names] if input else names
    raise ValueError(
        f"no layer of {kind} is eligible for fastai's manifold mixup (its modules are all containers, "
        "dropout, batch norm or recurrent layers); name the layers to mix"
    )


def trace_outputs(model: nn.Module, names: Sequence[str], *args, **kwargs) -> dict[str, object]:
    """Run ``model(*args, **kwargs)`` once in eval mode without gradients and return what each named
    layer returned (``"input"``: the model's :class:`~mixhook.sites.Inputs`). Layers that did not run are
    absent. Keys are the real site specs the names resolve to (a real name: itself); a selector is not
    applied here.

    Used to check, before training starts, that the chosen layers can be mixed. The model's
    training flag is restored afterwards and no hook is left behind.
    """
    import torch

    modules = resolve_layers(model, names)
    outputs: dict[str, object] = {}
    handles = []

    def recorder(name: str):
        def hook(module, inputs, output):
            outputs.setdefault(name, output)

        return hook

    was_training = model.training
    try:
        for name, module in modules.items():
            if parse_site(name).layer == INPUT:
                outputs[name] = Inputs(model, args, kwargs)
            else:
                handles.append(module.register_forward_hook(recorder(name)))
        model.eval()
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return outputs

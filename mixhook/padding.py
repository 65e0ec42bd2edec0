"""Padding masks downstream of a mix: which ones get the union of the two partners' masks, and why.

A mixed sample blends two sequences, so it should attend to every position that is real in either of them
(``padding="union"``, the default; ``"keep"`` leaves every mask alone). Which masks describe the mixed
sequence depends on where the mix is and on what a module's mask argument refers to:

- **Own masks** (``attention_mask``, ``key_padding_mask``, ``src_key_padding_mask``,
  ``tgt_key_padding_mask``) describe the sequence a module is given; **cross masks**
  (``encoder_attention_mask``, ``memory_key_padding_mask``) the encoder sequence a decoder attends to
  (given as ``encoder_hidden_states``, HuggingFace, or ``memory``, PyTorch).
- The **region** of a mix at a hidden layer is the innermost module around that layer that takes a
  padding mask: the stack whose sequence was mixed (a BERT or T5 encoder, a T5 or BART decoder, an
  ``nn.TransformerEncoder``); without one, the part of the model that holds the layer (a child of the
  model: CLIP's vision tower), or the whole model for a layer directly under it.
- Downstream of the mix, the outermost module called with a mask decides for itself and every module
  inside it: **inside the region**, its own masks are unioned and its cross masks left (an encoder's
  later layers; a decoder's later layers when the mix is in the decoder); **outside the region**, a
  module that cross-attends (``encoder_hidden_states`` or ``memory`` given) gets its cross masks unioned
  and keeps its own (the decoder of an encoder-decoder, mixed in the encoder: its teacher-forced input
  is each sample's own, unmixed), and any other module keeps all of its masks (another tower, such as a
  CLIP text encoder after a mix in the vision encoder).
- At the model's **input** the model's own arguments decide: a mixed main input (the first argument,
  ``inputs_embeds``, ``input_values``, ``src``, ...) unions ``attention_mask``/``key_padding_mask``/
  ``src_key_padding_mask`` (and ``memory_key_padding_mask`` of a model that builds its memory from it,
  ``nn.Transformer``), a mixed ``decoder_inputs_embeds``/``tgt`` unions ``decoder_attention_mask``/
  ``tgt_key_padding_mask``, anything else (``pixel_values``) none; the modules inside then keep what
  the model hands them. A model that takes no mask argument itself leaves the decision to its modules,
  as for a hidden layer whose region is the whole model.

Refused in one line (:class:`PaddingPolicyError`), where the policy cannot be known: downstream of a mix
whose region is the whole model, a call that cross-attends or takes both a source and a target sequence
(an embedding that an encoder-decoder applies to both: which of the two was mixed?), and a mask to union
whose length is none of the mixed tensor's (it does not describe the mixed sequence).

Masks combine elementwise: the max where larger means "attend" (HuggingFace's 0/1, boolean
True-attends and additive 0/-inf masks), the min where a boolean True means "padding" (PyTorch's
``*key_padding_mask``; as an additive float mask it is max again).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from .sites import Inputs
from .transfer import to_device

PADDING = ("union", "keep")
OWN = {
    "attention_mask": False,
    "key_padding_mask": True,
    "src_key_padding_mask": True,
    "tgt_key_padding_mask": True,
}
CROSS = {"encoder_attention_mask": False, "memory_key_padding_mask": True}
DECODER = {"decoder_attention_mask": False, "tgt_key_padding_mask": True}
TRUE_IS_PADDING = {**OWN, **CROSS, **DECODER}  # name -> whether a boolean True means padding
CROSS_SOURCES = ("encoder_hidden_states", "memory")
TARGETS = (
    "tgt",
    "decoder_input_ids",
    "decoder_inputs_embeds",
    "decoder_attention_mask",
    "tgt_key_padding_mask",
)
_DECODER_INPUTS = ("decoder_inputs_embeds", "decoder_input_ids", "tgt")
_MAIN_INPUTS = ("inputs_embeds", "input_ids", "input_values", "input_features", "src", "x", "hidden_states")
_MODEL_OWN = ("attention_mask", "key_padding_mask", "src_key_padding_mask")


class PaddingPolicyError(RuntimeError):
    """Which padding masks describe the mixed sequence cannot be told: refused, never guessed."""


def takes_masks(module: nn.Module) -> bool:
    """Whether ``module.forward`` has a padding-mask parameter (any of :data:`TRUE_IS_PADDING`)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in params for name in TRUE_IS_PADDING)


def region_of(model: nn.Module, layer: str) -> str:
    """The name of the innermost module around ``layer`` (not itself) that takes a padding mask; where
    none does, the part of the model (a child of the model) that holds ``layer``, or ``""`` (the whole
    model) for a layer that is itself such a part."""
    parts = layer.split(".")
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        if takes_masks(model.get_submodule(name)):
            return name
    return parts[0] if len(parts) > 1 else ""


def _present(inputs: Inputs, names, batch: int) -> tuple[str, ...]:
    return tuple(
        n
        for n in names
        if isinstance(mask := inputs.get(n), torch.Tensor) and mask.ndim >= 1 and mask.shape[0] == batch
    )


def downstream(name: str, region: str, inputs: Inputs, batch: int) -> tuple[str, ...]:
    """The masks that the call of module ``name`` (with ``inputs``), downstream of a mix in ``region``,
    must get unioned (see the module docstring)."""
    cross = any(inputs.get(k) is not None for k in CROSS_SOURCES)
    inside = region == "" or name.startswith(f"{region}.")
    if inside and region == "" and (cross or any(k in inputs for k in TARGETS)):
        what = "cross-attends to an encoder" if cross else "takes a source and a target sequence"
        raise PaddingPolicyError(
            f"padding='union': {name!r} {what} downstream of a mix that lies in no module taking a padding "
            "mask, so which of its sequences was mixed cannot be told; mix a layer inside the encoder or "
            "the decoder, or pass padding='keep'"
        )
    if inside:
        return _present(inputs, OWN, batch)
    return _present(inputs, CROSS, batch) if cross else ()


def at_input(model_inputs: Inputs, mixed: tuple[str, ...], batch: int) -> tuple[str, ...] | None:
    """The model's own mask arguments to union when its inputs ``mixed`` (argument names) are mixed, or
    ``None`` when the model takes no mask argument (its modules decide)."""
    if not any(n in model_inputs for n in TRUE_IS_PADDING):
        return None
    first = next(iter(model_inputs), None)
    if any(n in _DECODER_INPUTS for n in mixed):
        return _present(model_inputs, DECODER, batch)
    if any(n == first or n in _MAIN_INPUTS for n in mixed):
        names = _MODEL_OWN
        if not any(model_inputs.get(k) is not None for k in CROSS_SOURCES):  # it builds its memory itself
            names = (*names, "memory_key_padding_mask")
        return _present(model_inputs, names, batch)
    return ()


def check_lengths(where: str, inputs: Inputs, names: tuple[str, ...], sizes: tuple[int, ...] | None) -> None:
    """Refuse a mask of ``names`` whose last dimension (its positions) is none of ``sizes`` (the mixed
    tensor's dimensions besides the batch): it does not describe the mixed sequence."""
    if not sizes:
        return
    for n in names:
        mask = inputs.get(n)
        if mask.ndim >= 2 and mask.shape[-1] not in sizes:
            raise PaddingPolicyError(
                f"padding='union': {where} gets {n} with {mask.shape[-1]} positions, but the mixed tensor "
                f"has shape (B, {', '.join(map(str, sizes))}): that mask does not describe the mixed "
                "sequence; pass padding='keep', or mix a layer of the sequence that mask describes"
            )


def union(
    inputs: Inputs, names: tuple[str, ...], index: torch.Tensor, source: Callable
) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of the call with each mask of ``names`` replaced by the union of the partners'
    masks; ``source(mask)`` gives the rows ``index`` indexes (the mask itself, or every rank's)."""
    new = {}
    for n in names:
        mask = inputs.get(n)
        partner = source(mask)[to_device(index, mask.device)]
        padding = TRUE_IS_PADDING[n] and mask.dtype == torch.bool
        new[n] = torch.minimum(mask, partner) if padding else torch.maximum(mask, partner)
    return inputs.rebuild(new)

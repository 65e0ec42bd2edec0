"""Padding masks downstream of a mix: which ones get the union of the two partners' masks, and why.

A mixed sample blends two sequences, so it should attend to every position that is real in either of them
(``padding="union"``, the default; ``"keep"`` leaves every mask alone). Which masks describe the mixed
sequence depends on where the mix is and on what each call's mask argument refers to:

- The **region** of a mix at a hidden layer is the stack whose sequence it changes: the outermost module
  around the layer (the model aside) that takes a padding mask, below any that takes two sequences (an
  encoder-decoder: a source and a target, ``input_ids`` and ``decoder_input_ids``, ``src`` and ``tgt``).
  So a mix anywhere in a BERT (``bert.encoder.layer.0`` or its ``output.LayerNorm``) has the region
  ``bert``; anywhere in a T5 or BART encoder, the encoder (``encoder``, ``model.encoder``); anywhere in
  their decoders, the decoder. A stack that is itself the mixed layer, directly under an encoder-decoder
  (T5's ``encoder``), is its own region. Around a layer in no such stack, the part of the model (a child
  of the model) that holds it (CLIP's vision tower), or the whole model for a layer directly under it.
- Each call's masks are of its **own** sequence (the one it is given as its hidden states: ``attention_mask``,
  ``key_padding_mask``, ``src_key_padding_mask``, ``tgt_key_padding_mask``) or of a **cross** sequence, the
  keys it attends to from elsewhere (``encoder_attention_mask``, ``memory_key_padding_mask``; and every mask
  of a call that attends to another sequence only: HuggingFace's attentions given ``key_value_states``
  (BART, T5's ``T5LayerCrossAttention``), a call given ``encoder_hidden_states`` with no
  ``encoder_attention_mask`` parameter (BERT's ``BertCrossAttention``), ``nn.MultiheadAttention`` called
  with a ``key`` that is not its ``query``).
- Downstream of the mix (the calls that start after it), the outermost module called with a mask decides
  for itself and every module inside it: **inside the region**, its own masks are unioned and its cross
  masks left (an encoder's later layers; a decoder's later layers and sub-layers when the mix is in the
  decoder, whose cross-attention keeps each sample's source mask); **outside the region**, a call that
  cross-attends gets its cross masks unioned and keeps its own (the decoder of an encoder-decoder, mixed
  in the encoder: its teacher-forced input is each sample's own, unmixed), and any other call keeps all of
  its masks (another tower, such as a CLIP text encoder after a mix in the vision encoder). A call in
  flight when the mix happens (a mix inside an attention module, at its query, key or value projection)
  has been handed its masks already: it keeps them, and the union starts with the next call.
- At the model's **input** the model's own arguments decide: a mixed main input (the first argument,
  ``inputs_embeds``, ``input_values``, ``src``, ...) unions ``attention_mask``/``key_padding_mask``/
  ``src_key_padding_mask`` (and ``memory_key_padding_mask`` of a model that builds its memory from it,
  ``nn.Transformer``), a mixed ``decoder_inputs_embeds``/``tgt`` unions ``decoder_attention_mask``/
  ``tgt_key_padding_mask``, anything else (``pixel_values``) none; the modules inside then keep what
  the model hands them. A model that takes no mask argument itself leaves the decision to its modules,
  as for a hidden layer whose region is the whole model.

Refused in one line (:class:`PaddingPolicyError`), where the policy cannot be known: downstream of a mix
whose region is the whole model, a call that cross-attends or takes both a source and a target sequence
(an embedding that an encoder-decoder applies to both: which of the two was mixed?), a mask to union
whose length is none of the mixed tensor's (it does not describe the mixed sequence), and a mask to union
that is not a tensor (flex attention's ``BlockMask``: HuggingFace's ``attn_implementation="flex_attention"``).

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
_SOURCES = ("src", "input_ids", "inputs_embeds", "input_values", "input_features", "pixel_values")
_MAIN_INPUTS = ("inputs_embeds", "input_ids", "input_values", "input_features", "src", "x", "hidden_states")
_MODEL_OWN = ("attention_mask", "key_padding_mask", "src_key_padding_mask")


class PaddingPolicyError(RuntimeError):
    """Which padding masks describe the mixed sequence cannot be told: refused, never guessed."""


_PARAMETERS: dict = {}  # forward function -> its parameter names (read at every call downstream of a mix)


def _parameters(module: nn.Module) -> tuple[str, ...]:
    forward = getattr(module.forward, "__func__", module.forward)
    found = _PARAMETERS.get(forward)
    if found is None:
        try:
            found = tuple(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            found = ()
        if len(_PARAMETERS) >= 1024:
            _PARAMETERS.clear()
        _PARAMETERS[forward] = found
    return found


def takes_masks(module: nn.Module) -> bool:
    """Whether ``module.forward`` has a padding-mask parameter (any of :data:`TRUE_IS_PADDING`)."""
    return any(name in TRUE_IS_PADDING for name in _parameters(module))


def takes_two_sequences(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes a source and a target sequence (an encoder-decoder)."""
    params = _parameters(module)
    return any(n in params for n in _DECODER_INPUTS) and any(n in params for n in _SOURCES)


def region_of(model: nn.Module, layer: str) -> str:
    """The name of the stack whose sequence a mix at ``layer`` changes (see the module docstring): the
    outermost module around ``layer`` (not itself, not the model) that takes a padding mask, below the
    first that takes two sequences; ``layer`` itself where it takes a mask directly under a module that
    takes two; else the part of the model (a child of the model) that holds ``layer``, or ``""`` (the
    whole model) for a layer that is itself such a part or lies in a part that takes two sequences."""
    parts = layer.split(".")
    region = None
    for i in range(len(parts) - 1, -1, -1):  # the modules around the layer, innermost first, the model last
        name = ".".join(parts[:i])
        module = model.get_submodule(name)
        if takes_two_sequences(module):
            if region is None and i == len(parts) - 1 and takes_masks(model.get_submodule(layer)):
                region = layer  # a stack directly under an encoder-decoder (T5's encoder)
            break
        if i and takes_masks(module):
            region = name
    if region is not None:
        return region
    part = parts[0] if len(parts) > 1 else ""
    return "" if part and takes_two_sequences(model.get_submodule(part)) else part


def _cross_only(module: nn.Module, inputs: Inputs) -> bool:
    """Whether a call attends to another sequence only, so that every mask it takes describes that one."""
    if inputs.get("key_value_states") is not None:  # HuggingFace's cross-attentions (BART, T5)
        return True
    if inputs.get("encoder_hidden_states") is not None and "encoder_attention_mask" not in _parameters(
        module
    ):
        return True  # its attention_mask is the encoder's (BERT's BertCrossAttention)
    key, query = inputs.get("key"), inputs.get("query")
    return isinstance(key, torch.Tensor) and isinstance(query, torch.Tensor) and key is not query


def _present(inputs: Inputs, names, batch: int, where: str = "") -> tuple[str, ...]:
    """The masks of ``names`` given to a call, per sample (a mask broadcast over the batch, ``(1, ...)``,
    is no sample's); a mask that is not a tensor (flex attention's ``BlockMask``) cannot be unioned and is
    refused in one line."""
    for n in names:
        mask = inputs.get(n)
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise PaddingPolicyError(
                f"padding='union': {where or 'a module'} gets {n} as a {type(mask).__name__}, which cannot "
                "be unioned with its partner's; pass padding='keep', or use an attention that takes tensor "
                "masks (HuggingFace: attn_implementation='eager' or 'sdpa')"
            )
    return tuple(
        n
        for n in names
        if isinstance(mask := inputs.get(n), torch.Tensor) and mask.ndim >= 1 and mask.shape[0] == batch
    )


def downstream(module: nn.Module, name: str, region: str, inputs: Inputs, batch: int) -> tuple[str, ...]:
    """The masks that the call of ``module`` (named ``name``, with ``inputs``), downstream of a mix in
    ``region``, must get unioned (see the module docstring)."""
    cross_only = _cross_only(module, inputs)
    cross = cross_only or any(inputs.get(k) is not None for k in CROSS_SOURCES)
    inside = region == "" or name == region or name.startswith(f"{region}.")
    if inside and region == "" and (cross or any(k in inputs for k in TARGETS)):
        what = "cross-attends to an encoder" if cross else "takes a source and a target sequence"
        raise PaddingPolicyError(
            f"padding='union': {name!r} {what} downstream of a mix that lies in no module taking a padding "
            "mask, so which of its sequences was mixed cannot be told; mix a layer inside the encoder or "
            "the decoder, or pass padding='keep'"
        )
    own, others = ((), {**OWN, **CROSS}) if cross_only else (OWN, CROSS)
    where = f"{type(module).__name__} {name!r}"
    if inside:
        return _present(inputs, own, batch, where)
    return _present(inputs, others, batch, where) if cross else ()


def at_input(model_inputs: Inputs, mixed: tuple[str, ...], batch: int) -> tuple[str, ...] | None:
    """The model's own mask arguments to union when its inputs ``mixed`` (argument names) are mixed, or
    ``None`` when the model takes no mask argument (its modules decide)."""
    if not any(n in model_inputs for n in TRUE_IS_PADDING):
        return None
    first = next(iter(model_inputs), None)
    if any(n in _DECODER_INPUTS for n in mixed):
        return _present(model_inputs, DECODER, batch, "the model")
    if any(n == first or n in _MAIN_INPUTS for n in mixed):
        names = _MODEL_OWN
        if not any(model_inputs.get(k) is not None for k in CROSS_SOURCES):  # it builds its memory itself
            names = (*names, "memory_key_padding_mask")
        return _present(model_inputs, names, batch, "the model")
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

"""Noise hooks: NEFTune's uniform noise on a language model's embeddings.

Paper: Jain, Chiang, Wen, Kirchenbauer, Chiang, Somepalli, Bartoldson, Kailkhura, Schwarzschild, Saha,
Goldblum, Geiping, Goldstein. "NEFTune: Noisy Embeddings Improve Instruction Finetuning." ICLR 2024.
https://arxiv.org/abs/2310.05914 (the authors' code: neelsjain/NEFTune; HuggingFace's hook:
``transformers/integrations/neftune.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import packing, recompute
from ..engine.card import HookCard
from ..functional import generator_on
from ..hooks import LayerHook, guard_unwrapped
from ..sites import Inputs
from .tokens import put_back, sequence_of

LENGTHS = ("sequence", "padded")


class NEFTune(LayerHook):
    """NEFTune (Jain et al. 2023): in training, uniform noise added to the embeddings of every token.

    Algorithm 1 of the paper adds ``eps * alpha / sqrt(L * d)`` to a sequence's ``(L, d)`` embeddings, with
    ``eps ~ Uniform(-1, 1)`` elementwise. What ``L`` is in a batch:

    - ``length="sequence"`` (default): each sequence's own length, from the ``attention_mask`` the model is
      called with (the number of real tokens), or from its segments in a packed row (``position_ids``
      that restart, ``cu_seq_lens_q``, ``seq_idx``: :mod:`mixhook.packing`); padded positions get no
      noise. A sequence's noise is then the paper's whatever it is batched or packed with, and the same
      under padding and under packing.
    - ``length="padded"``: the padded length of the batch, ``output.size(1)``, at every position, padding
      included: the authors' code and HuggingFace's hook (``neftune_noise_alpha``), equal to them on the
      same uniform draws. A short sequence's noise then depends on the longest one in its batch, and in a
      packed row ``L`` would be the whole row: a packed batch is refused in one line.

    The default is the paper's own definition because it makes a run's noise independent of batching;
    choose ``"padded"`` to reproduce a run of the authors' code or of the HuggingFace ``Trainer``.

    The noise is drawn from the hook's own generator (on the embeddings' device: a generator on another
    device seeds one there from its own draws, so a CUDA run moves no noise across), in the forwards that
    train only: in train mode with gradients (a forward under ``torch.no_grad()``, such as TRL's metrics
    pass, gets none and draws nothing);
    ``state_dict()`` holds the generator's state (a resumed run draws what the uninterrupted one would),
    and an activation-checkpoint recomputation adds the same noise again. ``.last`` is the magnitude
    ``alpha / sqrt(L * d)`` of each token's noise in the last training forward, ``(B, L)`` (0 on padding),
    or ``None``.

    Args:
        layer: the embedding layer (``"model.embed_tokens"``, ``"transformer.wte"``,
            ``"bert.embeddings.word_embeddings"``; ``model.get_input_embeddings()``'s name), or any layer
            whose output is ``(B, L, d)`` embeddings.
        alpha: the noise scale, > 0 (the paper: 5, 10 or 15).
        length: ``"sequence"`` or ``"padded"`` (see above).
        generator: as :class:`~mixhook.ManifoldMixup`.
        batch_dim: where mixhook cannot find the batch dimension itself (see :mod:`mixhook.sites`).

    Refused in one line: a layer whose output is not one ``(B, L, d)`` tensor of embeddings, an
    ``attention_mask`` of another length than the embeddings', a layer that already has HuggingFace's
    NEFTune hook (the ``Trainer``'s ``neftune_noise_alpha``: the noise would be added twice), a packed
    batch under ``length="padded"``, and a layer called more often in one forward than the model has
    sequences (a source, and a target).
    """

    card = HookCard(
        signature='NEFTune(layer, alpha=5.0, length="sequence")',
        hook="forward hook on the embedding layer (and the model's pre-hook, for its masks and packing)",
        formula=(
            "`e' = e + U(-1,1)·alpha/sqrt(L·d)` per token in training, `L` each sequence's own length "
            "(`length=\"padded\"`: the batch's padded length, as the authors' code and HuggingFace's hook)"
        ),
        paper="Jain et al. 2023",
        commands="none yet: [Language models](language-models.md#neftune-which-length)",
    )

    _hooks_model = True  # its own pre-hook on the model: the call's masks and packing

    def __init__(
        self,
        layer: str | Sequence[str] = "model.embed_tokens",
        alpha: float = 5.0,
        length: str = "sequence",
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
    ):
        super().__init__(layer, batch_dim)
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, (int, float))
            or not math.isfinite(alpha)
            or alpha <= 0
        ):
            raise ValueError(f"NEFTune: alpha must be a finite number > 0, got {alpha!r}")
        if length not in LENGTHS:
            raise ValueError(f"NEFTune: length must be one of {', '.join(LENGTHS)}, got {length!r}")
        self.alpha, self.length = float(alpha), length
        self._draw_from(generator)
        self.last: torch.Tensor | None = None

    _TRANSIENT = ("_call", "_calls")

    def _fresh(self) -> None:
        super()._fresh()
        self._call: dict | None = None  # this training forward's masks and packing (the model's pre-hook)
        self._calls: dict[str, int] = {}  # each layer's calls in this forward

    def __repr__(self) -> str:
        return f"NEFTune(layer={self._layer_spec!r}, alpha={self.alpha}, length={self.length!r})"

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        begin = recompute.hook(self._on_model_input)  # (a recomputation is not a new call)
        handles.append(model.register_forward_pre_hook(begin, with_kwargs=True))
        guard_unwrapped(self, model, handles, "noised")
        for spec, module in modules.items():
            handles.append(module.register_forward_hook(recompute.hook(self._hook(spec), self._again(spec))))
        # the call's masks and packing are dropped when it ends, raised or not (a recomputation under
        # activation checkpointing replays what each layer's hook noted)
        handles.append(model.register_forward_hook(self._on_model_output, always_call=True))

    def _reset(self) -> None:
        self._call, self._calls = None, {}

    def _on_model_output(self, model: nn.Module, args: tuple, output) -> None:
        self._reset()

    # --------------------------------------------------------------------------------- the model's call

    def _on_model_input(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        self._calls = {}
        if not model.training or not torch.is_grad_enabled():  # a forward that cannot train: no noise
            self._call = None
            return
        how, inputs, restarted = packing.packed(model, args, kwargs) or (None, None, None)
        if how is not None and self.length == "padded":
            raise packing.PackedBatchError(
                f"NEFTune(length='padded'): the batch given to {type(model).__name__} is packed ({how}), so "
                "its padded length would be the whole packed row; use length='sequence' (each packed "
                "sequence's own length), or padded batches"
            )
        if inputs is None:
            inputs = kwargs if len(args) <= 1 else Inputs(model, args, kwargs)  # (the usual call: kwargs)
        self._call = {
            "masks": [_mask(inputs, "attention_mask"), _mask(inputs, "decoder_attention_mask")],
            "sources": 2 if any(k in inputs for k in ("decoder_input_ids", "decoder_inputs_embeds")) else 1,
            "starts": packing.starts(inputs, restarted) if how is not None else None,
        }

    # ---------------------------------------------------------------------------------------- the noise

    def _hook(self, spec: str):
        def hook(module: nn.Module, args: tuple, output):
            if not self._training or self._call is None:
                return None
            _refuse_hf_neftune(spec, module)
            self._seed_for_rank()
            index = self._calls.get(spec, 0)
            self._calls[spec] = index + 1
            call, generator = self._call, self.generator  # (noted only where it may be recomputed)
            self._note(spec, lambda: (recompute.generator_state(generator), call, index))
            noised, magnitude = self._noised(spec, output, self.generator, self._call, index)
            self.last = magnitude.detach()
            return noised

        return hook

    def _again(self, spec: str):
        def again(module: nn.Module, args: tuple, output):
            """In a recomputation (activation checkpointing): the forward's noise again."""
            if not self._training:
                return None
            _refuse_hf_neftune(spec, module)
            payload = self._replayed(spec)
            if payload is None:
                raise recompute.RecomputeError(
                    f"NEFTune at {spec!r}: the noise of the recomputed forward was not recorded"
                )
            state, call, index = payload
            generator = recompute.replay_generator(self.generator, state)
            return self._noised(spec, output, generator, call, index)[0]

        return again

    def _noised(self, spec: str, output, generator: torch.Generator, call: dict | None, index: int):
        """``output`` with its noise added (drawn from ``generator``), and each token's magnitude."""
        leaf, h = sequence_of(
            output, self.sites[spec], self._dims[spec], f"NEFTune at {spec!r}", "NEFTune adds noise to one "
            "(B, L, d) tensor of embeddings: name the embedding layer (model.get_input_embeddings())",
        )  # fmt: skip
        batch, length, dim = h.shape
        if self.length == "padded":  # as the authors' code and HuggingFace's hook compute it
            scale = float(self.alpha / torch.sqrt(torch.tensor(length * dim)))
            noised = h + _uniform(h, generator, scale)
            magnitude = torch.full((batch, length), scale, dtype=torch.float64, device=h.device)
        else:
            magnitude = self._magnitudes(spec, h, call, index)
            noised = h + _uniform(h, generator, 1.0) * magnitude.to(h.dtype).unsqueeze(-1)
        return put_back(output, leaf, noised), magnitude

    def _magnitudes(self, spec: str, h: torch.Tensor, call: dict | None, index: int) -> torch.Tensor:
        """``alpha / sqrt(L_i * d)`` for each token of ``h`` (B, L, d), ``L_i`` its own sequence's length;
        0 on padding."""
        batch, length, dim = h.shape
        sources = call["sources"] if call else 1
        if index >= sources:
            raise ValueError(
                f"NEFTune at {spec!r}: the layer ran {index + 1} times in one forward of a model with "
                f"{sources} sequence(s), so which sequence each call embeds cannot be told; use "
                "length='padded', or name a layer that embeds one sequence"
            )
        mask = call["masks"][index] if call else None
        starts = call["starts"] if call and index == 0 else None
        if mask is not None and tuple(mask.shape) != (batch, length):
            what = "attention_mask" if index == 0 else "decoder_attention_mask"
            raise ValueError(
                f"NEFTune at {spec!r}: the model's {what} has shape {tuple(mask.shape)}, but the "
                f"embeddings are {tuple(h.shape)}: it does not describe them; use length='padded'"
            )
        real = None if mask is None else (mask if mask.device == h.device else mask.to(h.device)) != 0
        if starts is None:  # (B, 1)
            lengths = (
                torch.full((batch, 1), length, device=h.device)
                if real is None
                else real.sum(-1, keepdim=True)
            )
        else:
            if tuple(starts.shape) != (batch, length):
                raise ValueError(
                    f"NEFTune at {spec!r}: the packed batch's segments have shape {tuple(starts.shape)}, but "
                    f"the embeddings are {tuple(h.shape)}"
                )
            if real is None:
                real = torch.ones(batch, length, dtype=torch.bool, device=h.device)
            segment = starts.to(h.device).long().cumsum(-1)  # each token's sequence in its row
            counts = torch.zeros(batch, length + 1, dtype=torch.float64, device=h.device)
            counts.scatter_add_(1, segment, real.double())
            lengths = counts.gather(1, segment)
        # alpha / sqrt(L_i * d), and 0 on padding (a row of padding alone: L_i counted as 1, not a NaN)
        scale = (lengths * dim).clamp(min=1).double().rsqrt().mul(self.alpha)
        return scale.expand(batch, length) if real is None else scale * real


def _mask(inputs, name: str) -> torch.Tensor | None:
    mask = inputs.get(name)
    return mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None


def _uniform(h: torch.Tensor, generator: torch.Generator, bound: float) -> torch.Tensor:
    """``Uniform(-bound, bound)`` noise shaped and typed as ``h``, on its device: from ``generator`` itself
    where it is there, else from a generator there seeded by a draw of ``generator``."""
    if generator.device != h.device:
        generator = generator_on(h.device, generator)
    return torch.empty_like(h).uniform_(-bound, bound, generator=generator)


def _refuse_hf_neftune(spec: str, module: nn.Module) -> None:
    """HuggingFace's NEFTune hook on the same layer would add noise a second time."""
    if getattr(module, "neftune_noise_alpha", None) is not None:
        raise ValueError(
            f"NEFTune at {spec!r}: the layer already has HuggingFace's NEFTune hook "
            f"(neftune_noise_alpha={module.neftune_noise_alpha}), so the noise would be added twice; "
            "leave the Trainer's neftune_noise_alpha unset (None), or drop this hook"
        )

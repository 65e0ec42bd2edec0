"""The Mixup family: sampling (lam, index), the blend, mixed targets and the mixed loss.

Papers:
    - Zhang, Cisse, Dauphin, Lopez-Paz. "mixup: Beyond Empirical Risk Minimization." ICLR 2018.
      https://arxiv.org/abs/1710.09412 (mixing at the input)
    - Verma, Lamb, Beckham, Najafi, Mitliagkas, Lopez-Paz, Bengio. "Manifold Mixup: Better
      Representations by Interpolating Hidden States." ICML 2019. https://arxiv.org/abs/1806.05236
      (mixing at a hidden layer drawn per batch)
    - Lim, Erichson, Utrera, Xu, Mahoney. "Noisy Feature Mixup." ICLR 2022. https://arxiv.org/abs/2110.02180

The math is a handful of small pure functions (:func:`sample_beta`, :func:`blend`, :func:`smooth_one_hot`,
:func:`mix_targets`). :class:`Mixer` is the one mechanism every mixing regularizer shares (which layer,
whether to mix, ``pin``, ``last``, ``loss``, ``targets``); :class:`ManifoldMixup` and
:class:`NoisyFeatureMixup` live here, :class:`~mixhook.cutmix.CutMix` and :class:`~mixhook.patchup.PatchUp`
in their own modules.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.hooks import RemovableHandle

from . import recompute
from .hooks import LayerHook, own_generator
from .sites import (
    INPUT,
    Inputs,
    Leaf,
    batch_leaves,
    blendable,
    describe,
    embedding_layers,
    input_batch,
    replace_leaves,
)
from .transfer import to_device


def sample_beta(a: float, b: float, generator: torch.Generator, size: int | None = None) -> torch.Tensor:
    """Draw from ``Beta(a, b)`` with ``generator``: a 0-d float64 tensor, or ``size`` of them.

    ``torch.distributions.Beta`` cannot take a generator, so this draws the same Dirichlet(a, b) sample
    it would (Beta is its first coordinate) through the generator-aware kernel. Values are float64 and
    are cast to the activation's (or the loss's) dtype where they are used.
    """
    concentration = torch.tensor([a, b], dtype=torch.float64, device=generator.device)
    if size is not None:
        concentration = concentration.expand(size, 2).contiguous()
    return torch._sample_dirichlet(concentration, generator=generator)[..., 0]


def sample_lam(alpha: float, generator: torch.Generator) -> torch.Tensor:
    """``lam ~ Beta(alpha, alpha)`` as a 0-d float64 tensor (see :func:`sample_beta`)."""
    return sample_beta(alpha, alpha, generator)


def per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` in ``like``'s dtype and device; one value per sample (1-D) is shaped to broadcast over
    ``like``'s non-batch dimensions, a 0-d tensor is left as it is."""
    values = to_device(values, like.device, like.dtype)
    return values.view(-1, *([1] * (like.ndim - 1))) if values.ndim == 1 else values


class _PermutedBlend(torch.autograd.Function):
    """``lerp(h[index], h, lam)`` whose backward gathers through the inverse permutation.

    Indexing's own backward scatter-adds into a zeroed tensor; when ``index`` is a permutation the
    gradient of ``h[index]`` is just ``g[inverse]``, so the backward is one gather and one fused
    multiply-add: ``lam * g + ((1 - lam) * g)[inverse]``."""

    @staticmethod
    def forward(ctx, h, lam, index, inverse):
        ctx.save_for_backward(lam, inverse)
        return torch.lerp(h[index], h, lam)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        lam, inverse = ctx.saved_tensors
        return torch.addcmul(((1 - lam) * grad)[inverse], lam, grad), None, None, None


def inverse_permutation(index: torch.Tensor) -> torch.Tensor | None:
    """The inverse of ``index`` if it is a permutation of ``0..n-1``, else ``None``."""
    if not torch.equal(torch.sort(index).values, torch.arange(index.shape[0], device=index.device)):
        return None
    return _scatter_inverse(index)


def _scatter_inverse(index: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation ``index``, by one scatter (no check that it is one)."""
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.shape[0], device=index.device)
    return inverse


def blend(
    h: torch.Tensor, lam: torch.Tensor | float, index: torch.Tensor, inverse: torch.Tensor | None = None
) -> torch.Tensor:
    """``lam * h + (1 - lam) * h[index]``, in ``h``'s dtype on ``h``'s device.

    ``lam`` is a number, a 0-d tensor, or one value per sample (a 1-D tensor of the batch's length).
    Computed as one gather and one ``torch.lerp`` (equal to the formula up to rounding). Differentiable
    in ``h`` through both terms, exactly like the hand-edited forward of the papers; given ``inverse``
    (``index``'s inverse permutation), the backward gathers through it instead of scatter-adding.
    """
    lam = per_sample(torch.as_tensor(lam, dtype=torch.float64), h)
    index = to_device(index, h.device)
    if inverse is not None and h.requires_grad and torch.is_grad_enabled():
        return _PermutedBlend.apply(h, lam, index, to_device(inverse, h.device))
    return torch.lerp(h[index], h, lam)


def smooth_one_hot(target: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """One-hot class probabilities with label smoothing (timm's convention).

    The true class gets ``1 - smoothing + smoothing / num_classes``, every other class
    ``smoothing / num_classes``; rows sum to 1.
    """
    off = smoothing / num_classes
    out = torch.full((target.shape[0], num_classes), off, device=target.device)
    return out.scatter_(1, target.unsqueeze(1), 1.0 - smoothing + off)


def mix_targets(
    target: torch.Tensor,
    num_classes: int,
    lam: torch.Tensor | float,
    index: torch.Tensor,
    smoothing: float = 0.0,
) -> torch.Tensor:
    """``lam * s(target) + (1 - lam) * s(target[index])`` with ``s`` = :func:`smooth_one_hot`."""
    soft = smooth_one_hot(target, num_classes, smoothing)
    return blend(soft, lam, index)


@dataclass(frozen=True)
class MixState:
    """What one training forward mixed.

    Attributes:
        layer: the layer spec that was mixed (as given, selector included).
        lam: the weight of each sample's own target (float64): a 0-d tensor, or one per sample (1-D) in
            ``mode="elem"``. For CutMix it is the area-corrected lam, for PatchUp the paper's target
            weight; ``loss`` and ``targets`` use it as is.
        index: 1-D int64 tensor: sample ``i`` was mixed with sample ``index[i]``.
        box: CutMix's pasted box ``(y1, y2, x1, x2)`` (rows ``y1:y2``, columns ``x1:x2``), else ``None``.
        mask: PatchUp's block mask ``(C, H, W)`` (1 where features were altered), else ``None``.
        elements: the elements of the layer's output (or of the model's inputs) that were mixed, as
            selector paths (``("[0]", "[1.0]")``; ``("[]",)`` for a plain tensor), with their batch
            dimensions in ``batch_dims``.
    """

    layer: str
    lam: torch.Tensor
    index: torch.Tensor
    box: tuple[int, int, int, int] | None = None
    mask: torch.Tensor | None = None
    elements: tuple[str, ...] = ("[]",)
    batch_dims: tuple[int, ...] = (0,)


@dataclass
class _Draw:
    """A mix decided at the start of a forward and applied when its layer runs."""

    layer: str
    pinned: dict = field(default_factory=dict)
    done: bool = False
    batch: int | None = None  # the batch size of the model's input, where it can be told
    index: torch.Tensor | None = None  # once mixed: for the padding-mask policy downstream


PADDING = ("union", "keep")
# Arguments that carry a per-sample padding mask, and how two samples' masks combine so that a mixed
# sample attends to the positions that are real in either partner: the elementwise max where larger means
# "attend" (HuggingFace's 0/1, boolean True-attends and additive 0/-inf masks), the min where a boolean
# True means "padding" (PyTorch's key_padding_mask; as an additive float mask it is max again).
# A mask under another name is left as it is.
_MASK_ARGS = {  # name -> whether a boolean True means padding
    "attention_mask": False,
    "key_padding_mask": True,
    "src_key_padding_mask": True,
    "tgt_key_padding_mask": True,
    "memory_key_padding_mask": True,
}

_MIXING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its mixing regularizer


class Mixer(LayerHook):
    """Base class of the Mixup family: mixes the output of one of ``layer`` per training batch.

    The shared mechanism: at the start of each training forward (a forward pre-hook on the model)
    decide, with probability ``prob``, to mix, and at which layer (uniformly); when that layer runs (a
    forward hook; for ``"input"`` the model's pre-hook) replace the tensors it returns that carry the
    batch (all of them, or the selected ones, each along its own batch dimension, see
    :mod:`mixhook.sites`) by :meth:`_mix`'s result; after the forward (a forward hook on the model) check
    that the layer did run. A recomputation by activation checkpointing replays the same mix
    (:mod:`mixhook.recompute`). ``pin``, ``last``, ``loss`` and ``targets`` work the same for every
    subclass. Subclasses implement :meth:`_mix` and may extend :meth:`_check_leaves` and ``_pin_keys``.

    A model has at most one mixing regularizer attached at a time (two would each mix every batch):
    combine several with :class:`~mixhook.OneOf`.
    """

    _pin_keys: tuple[str, ...] = ()

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
    ):
        super().__init__(layer, batch_dim)
        self.alpha = _check_positive("alpha", alpha)
        self.prob = check_fraction("prob", prob)
        self.generator = own_generator(generator)
        if padding not in PADDING:
            raise ValueError(f"padding must be one of {', '.join(PADDING)}, got {padding!r}")
        self.padding = padding
        self.last: MixState | None = None
        self._draw: _Draw | None = None
        self._pinned: dict | None = None
        self._mask_stack: list[bool] = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer={self._layer_spec!r}, alpha={self.alpha}, prob={self.prob})"

    # ----------------------------------------------------------------------------------- user API

    def pin(
        self,
        layer: str | None = None,
        lam: float | torch.Tensor | None = None,
        index: Sequence[int] | torch.Tensor | None = None,
        **values,
    ) -> None:
        """Make the next training forward mix with exactly these values (and mix, whatever ``prob``).

        What is left out is drawn as usual. Sampling resumes after that forward. ``index`` is any 1-D
        integer index of the batch's length (a permutation, or e.g. a reversal to reproduce timm's
        ``flip`` pairing); its length is checked against the batch when it is used. ``lam`` is a number
        in [0, 1] (or, in ``mode="elem"``, one per sample). Subclasses take more values (CutMix ``box``,
        PatchUp ``mask``).
        """
        unknown = sorted(set(values) - set(self._pin_keys))
        if unknown:
            valid = ", ".join(("layer", "lam", "index", *self._pin_keys))
            raise TypeError(f"{type(self).__name__}.pin() got unknown values {unknown}; valid: {valid}")
        if layer is not None and layer not in self.layers:
            raise ValueError(
                f"pin(layer={layer!r}): not one of this regularizer's layers {list(self.layers)}"
            )
        if lam is not None:
            lam = torch.as_tensor(lam, dtype=torch.float64).detach().cpu()
            if lam.ndim > 1 or not bool(((lam >= 0) & (lam <= 1)).all()):
                raise ValueError(f"pin(lam={lam.tolist()}): lam must be a number (or 1-D values) in [0, 1]")
        if index is not None:
            index = torch.as_tensor(index)
            if index.ndim != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
                raise ValueError(
                    f"pin(index=...): needs a 1-D integer index, got {index.dtype} {tuple(index.shape)}"
                )
            index = index.to(torch.int64)
        pinned = {"layer": layer, "lam": lam, "index": index, **values}
        self._pinned = {k: v for k, v in pinned.items() if v is not None}

    def loss(
        self,
        criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        logits: torch.Tensor,
        target: torch.Tensor,
    ) -> torch.Tensor:
        """``lam * criterion(logits, target) + (1 - lam) * criterion(logits, target[index])`` for the
        last training forward, or ``criterion(logits, target)`` when it did not mix.

        With one lam per sample (``mode="elem"``) the criterion must return one loss per sample
        (``reduction="none"``); the weighted per-sample losses are returned for you to reduce."""
        last = self.last
        if last is None:
            return criterion(logits, target)
        index = self._index_for(target, "loss")
        loss_a = criterion(logits, target)
        loss_b = criterion(logits, target[index])
        lam = to_device(last.lam, loss_a.device, loss_a.dtype)
        if lam.ndim == 1 and loss_a.shape != lam.shape:
            raise ValueError(
                f"loss(): lam has one value per sample ({lam.shape[0]}), so the criterion must return one "
                f"loss per sample (reduction='none'), but it returned shape {tuple(loss_a.shape)}"
            )
        return lam * loss_a + (1 - lam) * loss_b

    def targets(self, target: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
        """Soft targets ``lam * s(target) + (1 - lam) * s(target[index])`` for the last training forward
        (``s(target)`` when it did not mix), where ``s`` puts ``1 - smoothing + smoothing/num_classes``
        on the true class and ``smoothing/num_classes`` elsewhere. They drop into
        ``nn.CrossEntropyLoss``, which accepts class probabilities."""
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
        if target.ndim != 1 or target.dtype.is_floating_point or target.dtype == torch.bool:
            raise ValueError(
                f"targets() needs 1-D integer class indices, got {target.dtype} {tuple(target.shape)}"
            )
        if target.numel() and (int(target.min()) < 0 or int(target.max()) >= num_classes):
            raise ValueError(
                f"targets(): class indices must lie in [0, {num_classes}), "
                f"got values from {int(target.min())} to {int(target.max())}"
            )
        if self.last is None:
            return smooth_one_hot(target, num_classes, smoothing)
        return mix_targets(target, num_classes, self.last.lam, self._index_for(target, "targets"), smoothing)

    def check_output(self, spec: str, value, batch: int | None = None) -> None:
        """Raise ``TypeError``/``ValueError`` (one line) unless what layer ``spec`` returned (for
        ``"input"``: the model's :class:`~mixhook.sites.Inputs`) can be mixed by this class, for a model
        input of ``batch`` samples.

        The app calls it on a sample batch before training; the hooks check every mix the same way.
        Needs the regularizer to be attached (the batch dimensions depend on the model)."""
        self._leaves(spec, self._site_value(spec, value), batch)

    # ---------------------------------------------------------------------------------- the hooks

    def _check_attach(self, model: nn.Module) -> None:
        other = _MIXING.get(model)
        if other is not None and other is not self:
            raise RuntimeError(
                f"{type(model).__name__} already has a mixing regularizer attached ({other!r}); two would "
                "each mix every batch: remove it first, or combine both with mixhook.OneOf([...])"
            )

    def _register(
        self,
        model: nn.Module,
        modules: dict[str, nn.Module],
        handles: list[RemovableHandle],
        root: bool = True,
    ) -> None:
        """Register the layer hooks, the padding-mask hooks, and (``root``) the model hooks that start
        and end each forward. :class:`~mixhook.compose.OneOf` registers the model hooks itself and passes
        ``root=False``."""
        if root:
            handles.append(model.register_forward_pre_hook(self._on_model_input, with_kwargs=True))
        for spec, module in modules.items():
            if self.sites[spec].layer != INPUT:
                handles.append(module.register_forward_hook(self._layer_hook(spec)))
        if self.padding == "union":
            for name, module in model.named_modules():
                if module is not model and _mask_params(module):
                    pre, post = self._mask_hooks(f"padding mask of {name}")
                    handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                    handles.append(module.register_forward_hook(post, always_call=True))
        if root:
            handles.append(model.register_forward_hook(self._on_model_output))
            _MIXING[model] = self

    def _reset(self) -> None:
        self._draw = None
        for model, mixer in list(_MIXING.items()):
            if mixer is self:
                del _MIXING[model]

    def _on_model_input(self, model: nn.Module, args: tuple, kwargs: dict):
        if recompute.in_backward():  # the whole model is being recomputed: replay its input's mix
            return self._replay_input(model, args, kwargs)
        if not model.training:
            self._draw = None
            return None
        return self._begin(model, args, kwargs, self._decide())

    def _begin(self, model: nn.Module, args: tuple, kwargs: dict, draw: _Draw | None):
        """Start a training forward with ``draw`` (or no mix); mix the input now if it is the layer."""
        self.last = None
        self._draw = draw
        self._mask_stack = []
        if draw is None:
            return None
        draw.batch = self._reference_batch(model, args, kwargs)
        if self.sites[draw.layer].layer != INPUT:
            return None
        inputs = Inputs(model, args, kwargs)
        self._note(draw.layer, lambda: (recompute.generator_state(self.generator), draw.pinned))
        value, self.last = self._apply(draw.layer, inputs, draw.pinned, self.generator, draw.batch)
        draw.done, draw.index = True, self.last.index
        args, kwargs = _rebuild_inputs(inputs, self.sites[draw.layer], value)
        unioned = self._union_masks(model, args, kwargs, draw.index)
        if unioned is not None:  # the modules inside get the model's unioned mask: none unions again
            self._mask_stack.append(True)
        return unioned or (args, kwargs)

    def _replay_input(self, model: nn.Module, args: tuple, kwargs: dict):
        for spec, site in self.sites.items():
            if site.layer == INPUT:
                payload = self._replayed(spec)
                if payload is not None:
                    state, pinned = payload
                    inputs = Inputs(model, args, kwargs)
                    gen = recompute.replay_generator(self.generator, state)
                    value, state = self._apply(spec, inputs, pinned, gen)
                    args, kwargs = _rebuild_inputs(inputs, site, value)
                    return self._union_masks(model, args, kwargs, state.index) or (args, kwargs)
        return None

    def _layer_hook(self, spec: str):
        def hook(module: nn.Module, args: tuple, output):
            draw = self._draw
            if draw is not None and not draw.done and draw.layer == spec:  # this forward mixes here
                self._note(spec, lambda: (recompute.generator_state(self.generator), draw.pinned))
                mixed, self.last = self._apply(spec, output, draw.pinned, self.generator, draw.batch)
                draw.done, draw.index = True, self.last.index
                return mixed
            if draw is None and recompute.in_backward():  # a recomputation, after its forward ended
                payload = self._replayed(spec)
                if payload is None:
                    return None
                state, pinned = payload
                return self._apply(spec, output, pinned, recompute.replay_generator(self.generator, state))[0]
            self._note(spec)
            return None

        return hook

    def _on_model_output(self, model: nn.Module, args: tuple, output) -> None:
        if self._draw is None:  # (also during a recomputation, which runs after its forward ended)
            return
        draw, self._draw = self._draw, None
        if draw is not None and not draw.done:
            raise RuntimeError(
                f"mixup layer {draw.layer!r} did not run during {type(model).__name__}.forward(), so nothing "
                "was mixed; choose a layer that forward() calls. (Under torch.compile: attach before "
                "compiling, and if hooks changed after compiling, or another instance of this class was "
                "compiled without them, set torch._dynamo.config.skip_nnmodule_hook_guards = False before "
                "compiling.)"
            )

    def _decide(self) -> _Draw | None:
        """Whether this forward mixes, and where (pinned values win; a pinned forward always mixes)."""
        pinned, self._pinned = self._pinned, None
        g = self.generator
        if pinned is None:
            if self.prob < 1.0 and float(torch.rand((), generator=g, device=g.device)) >= self.prob:
                return None
            pinned = {}
        layer = pinned.get("layer")
        if layer is None:
            k = 0
            if len(self.layers) > 1:
                k = int(torch.randint(len(self.layers), (), generator=g, device=g.device))
            layer = self.layers[k]
        return _Draw(layer=layer, pinned=pinned)

    # -------------------------------------------------------------------------- padding masks

    def _mask_hooks(self, key: str):
        """Downstream of a mix, a module that takes a padding mask gets the union of the partners' masks:
        only the outermost such call (the calls inside it get what it hands them). ``key`` names the
        module for a recomputation, which applies the same union again."""

        def pre(module: nn.Module, args: tuple, kwargs: dict):
            if recompute.in_backward():
                index = self._replayed(key)
                return None if index is None else self._union_masks(module, args, kwargs, index)
            draw = self._draw
            if draw is None or draw.index is None or any(self._mask_stack):
                self._mask_stack.append(False)
                self._note(key)
                return None
            result = self._union_masks(module, args, kwargs, draw.index)
            self._mask_stack.append(result is not None)
            self._note(key, draw.index if result is not None else None)
            return result

        def post(module: nn.Module, args: tuple, output) -> None:
            if self._mask_stack and not recompute.in_backward():
                self._mask_stack.pop()

        return pre, post

    def _union_masks(self, module: nn.Module, args: tuple, kwargs: dict, index: torch.Tensor):
        """``(args, kwargs)`` with every padding mask among them replaced by the union of the partners'
        masks, or ``None`` when there is none to change (or ``padding="keep"``)."""
        if self.padding != "union":
            return None
        inputs = Inputs(module, args, kwargs)
        new = {}
        for name, true_is_padding in _MASK_ARGS.items():
            mask = inputs.get(name)
            if isinstance(mask, torch.Tensor) and mask.ndim >= 1 and mask.shape[0] == index.shape[0]:
                partner = mask[to_device(index, mask.device)]
                padding = true_is_padding and mask.dtype == torch.bool
                new[name] = torch.minimum(mask, partner) if padding else torch.maximum(mask, partner)
        return inputs.rebuild(new) if new else None

    # ------------------------------------------------------------------------------ the mix itself

    def _site_value(self, spec: str, value):
        """What a spec acts on in a layer's output or, for ``"input"``, the model's :class:`Inputs`:
        with a selector, the whole (the selector picks), else the output or the first argument."""
        site = self.sites[spec]
        if site.layer != INPUT:
            return value
        if not len(value):
            raise TypeError(f"mixup layer {spec!r}: the model was called without arguments; nothing to mix")
        return value if site.paths is not None else value[0]

    def _leaves(self, spec: str, value, expected: int | None = None) -> tuple[list[Leaf], int]:
        site = self.sites[spec]
        if site.layer == INPUT:
            self._check_token_ids(spec, value)
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__}.check_output() needs the regularizer attached")
        kind = type(self).__name__
        found, batch = batch_leaves(value, site, self._dims[spec], kind, inputs=site.layer == INPUT)
        if expected is not None and batch != expected:
            raise TypeError(
                f"{kind} at {spec!r}: it returned {describe(value)}, whose batch dimension "
                f"{found[0].dim} has size {batch}, but the model's input has a batch of {expected}: the "
                "layer loses or reshapes the batch dimension; choose another layer, or pass batch_dim"
            )
        self._check_leaves(spec, found)
        return found, batch

    def _reference_batch(self, model: nn.Module, args: tuple, kwargs: dict) -> int | None:
        """The batch size of the model's input, to check each mixed layer against: the first tensor
        argument's batch dimension, where the model's layout tells it (``None`` where it does not)."""
        dims = next(iter(self._dims.values()), None)
        first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        return input_batch(model, first, dims.seq_first) if dims is not None else None

    def _check_token_ids(self, spec: str, value) -> None:
        selected = value if isinstance(value, torch.Tensor) else None
        if selected is None and isinstance(value, Inputs):
            paths = self.sites[spec].paths or ()
            picked = [value.get(value.key(p[0])) if isinstance(p[0], str) or p[0] < len(value) else None
                      for p in paths]  # fmt: skip
            selected = next((t for t in picked if isinstance(t, torch.Tensor) and not blendable(t)), None)
        if isinstance(selected, torch.Tensor) and not blendable(selected):
            embeddings = embedding_layers(self._model) if self._model is not None else []
            where = (f"mix the embeddings instead: {', '.join(embeddings[:4])}, or a layer after them"
                     if embeddings else "mix a layer whose output is floating point")  # fmt: skip
            dtype = str(selected.dtype).removeprefix("torch.")
            raise TypeError(
                f"mixup layer {spec!r}: the model's input is a {dtype} tensor of shape "
                f"{tuple(selected.shape)} (token ids or labels), which cannot be blended; {where}"
            )

    def _check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        """Subclasses refuse what they cannot mix (CutMix: anything but one (B, C, H, W) map)."""

    def _apply(self, spec: str, value, pinned: dict, generator: torch.Generator, batch: int | None = None):
        """Mix what ``spec`` returned (or the model's inputs); draws come from ``generator``. Returns the
        mixed value (same structure; for ``"input"`` the changed arguments) and the :class:`MixState`."""
        site_value = self._site_value(spec, value)
        found, n = self._leaves(spec, site_value, batch)
        saved, self.generator = self.generator, generator  # a replay draws from a copy of the state
        try:
            index = pinned.get("index")
            lam = pinned.get("lam")
            if lam is None:
                lam = self._sample_lam(n)
            elif lam.ndim == 1 and lam.shape[0] != n:
                raise ValueError(
                    f"pinned lam has {lam.shape[0]} values but the batch at layer {spec!r} has {n}"
                )
            if index is None:
                index = torch.randperm(n, generator=generator, device=generator.device)
            elif index.shape[0] != n or (n and (int(index.min()) < -n or int(index.max()) >= n)):
                raise ValueError(
                    f"pinned index of length {index.shape[0]} (values {index.tolist()[:8]}...) "
                    f"does not index the batch of {n} at layer {spec!r}"
                )
            inverse = _inverse(index, pinned)
            mixed, state = self._mix(spec, found, lam, index, inverse, pinned)
        finally:
            self.generator = saved
        state = dataclasses.replace(
            state, elements=tuple(leaf.name for leaf in found), batch_dims=tuple(leaf.dim for leaf in found)
        )
        return replace_leaves(site_value, mixed), state

    # ------------------------------------------------------------------------------ for subclasses

    def _sample_lam(self, n: int) -> torch.Tensor:
        return sample_lam(self.alpha, self.generator)

    def _mix(
        self,
        spec: str,
        leaves: list[Leaf],
        lam: torch.Tensor,
        index: torch.Tensor,
        inverse: torch.Tensor | None,
        pinned: dict,
    ) -> tuple[dict, MixState]:
        """Return ``{path: mixed tensor}`` for the ``leaves`` (each carrying the batch along
        ``leaf.dim``) and the :class:`MixState` that ``loss``/``targets`` will use. ``inverse`` is
        ``index``'s inverse permutation (``None`` for a pinned index that is not one). Draws come from
        ``self.generator``."""
        raise NotImplementedError

    def _index_for(self, target: torch.Tensor, what: str) -> torch.Tensor:
        index = self.last.index
        if target.shape[0] != index.shape[0]:
            raise ValueError(
                f"{what}(): target has {target.shape[0]} rows but the last forward mixed a batch of "
                f"{index.shape[0]}"
            )
        return to_device(index, target.device)


def _rebuild_inputs(inputs: Inputs, site, value) -> tuple[tuple, dict]:
    """The model's ``(args, kwargs)`` with the mixed value put back: the first argument, or the selected
    arguments of the :class:`Inputs` copy."""
    if site.paths is None:
        return inputs.rebuild({inputs.first()[0]: value})
    return inputs.rebuild(value)


def _mask_params(module: nn.Module) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in params for name in _MASK_ARGS)


def along(dim: int, fn: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """``fn`` applied with the batch moved to dim 0 and moved back (a view; nothing copied for dim 0)."""
    if dim == 0:
        return fn(h)
    return fn(h.movedim(dim, 0)).movedim(0, dim)


class ManifoldMixup(Mixer):
    """Manifold Mixup (Verma et al. 2019) at any named layer of any model, through forward hooks.

    On each forward in training mode (``model.training``), with probability ``prob``: one layer is drawn
    uniformly from ``layer``, ``lam ~ Beta(alpha, alpha)`` and a uniformly random permutation ``index``
    of the batch are drawn, and that layer's output ``h`` is replaced by
    ``lam * h + (1 - lam) * h[index]``. ``layer="input"`` mixes the model's input (its first positional
    argument): classic input mixup (Zhang et al. 2018). Gradients flow through ``h`` and ``h[index]``
    exactly as in a hand-edited ``forward()``. In eval mode nothing is mixed.

    Train with :meth:`loss` (the mixed criterion) or :meth:`targets` (mixed soft targets)::

        mix = ManifoldMixup(["input", "layer1", "layer2"], alpha=2.0)
        with mix.attach(model):
            logits = model(x)
            loss = mix.loss(F.cross_entropy, logits, y)

    Args:
        layer: a module name as ``model.named_modules()`` spells it, ``"input"``, or a list of names
            (one is drawn per training batch).
        alpha: the Beta distribution's concentration, > 0 (the paper uses 2.0; input mixup 1.0).
        prob: the probability that a training batch is mixed at all, in [0, 1].
        mode: ``"batch"`` (one lam for the batch, as in the papers) or ``"elem"`` (one lam per sample,
            timm's elem mode; ``loss`` then needs a per-sample criterion, ``reduction="none"``).
        generator: the ``torch.Generator`` every draw comes from. By default a CPU generator seeded from
            ``torch.initial_seed()``, so ``torch.manual_seed(s)`` makes the draws reproducible without
            consuming the global random stream.
        batch_dim: where mixhook cannot find the batch dimension itself (see :mod:`mixhook.sites`): an
            int, or a dict from layer spec to int.
        padding: ``"union"`` (default): downstream of the mixed layer, every module that takes a padding
            mask (``attention_mask``, ``key_padding_mask``, ...) gets the union of the two partners'
            masks, so a mixed sample attends to the positions that are real in either; ``"keep"``:
            masks are left as they are.

    A layer's output is mixed as a whole: every tensor in it that carries the batch, each along its
    own batch dimension, with one lam and one permutation; a selector (``"lstm[1.0]"``) restricts it.
    A layer called several times in one forward is mixed at its first call only.
    """

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 2.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        mode: str = "batch",
        batch_dim: int | dict | None = None,
        padding: str = "union",
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding)
        if mode not in ("batch", "elem"):
            raise ValueError(f"mode must be 'batch' or 'elem', got {mode!r}")
        self.mode = mode

    def __repr__(self) -> str:
        base = super().__repr__()
        return base if self.mode == "batch" else f"{base[:-1]}, mode={self.mode!r})"

    def _sample_lam(self, n: int) -> torch.Tensor:
        if self.mode == "elem":
            return sample_beta(self.alpha, self.alpha, self.generator, size=n)
        return sample_lam(self.alpha, self.generator)

    def _mix(self, spec, leaves, lam, index, inverse, pinned):
        if self.mode == "elem" and lam.ndim == 0:
            lam = lam.expand(index.shape[0])
        mixed = {
            leaf.path: along(leaf.dim, lambda h: blend(h, lam, index, inverse), leaf.tensor)
            for leaf in leaves
        }
        return mixed, MixState(layer=spec, lam=lam, index=index)


class NoisyFeatureMixup(ManifoldMixup):
    """Noisy Feature Mixup (Lim et al. 2022): Manifold Mixup, then additive and multiplicative noise.

    The mixed tensor ``m = lam * h + (1 - lam) * h[index]`` becomes ``mult * m + add`` with, as in the
    paper's code, ``add = add_noise * b1 * N(0, 1)`` and ``mult = 1 + mult_noise * b2 * U(-1, 1)``
    elementwise, where ``b1, b2 ~ Beta(2, 5)`` are drawn once per batch. With ``add_noise=0`` and
    ``mult_noise=0`` nothing more is drawn or computed: it equals :class:`ManifoldMixup` exactly.

    Args:
        layer, alpha, prob, generator, mode, batch_dim, padding: as :class:`ManifoldMixup` (alpha defaults
            to the paper's 1.0).
        add_noise: the additive noise level, >= 0 (paper: 0.4).
        mult_noise: the multiplicative noise level, >= 0 (paper: 0.2).
    """

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 1.0,
        add_noise: float = 0.4,
        mult_noise: float = 0.2,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        mode: str = "batch",
        batch_dim: int | dict | None = None,
        padding: str = "union",
    ):
        super().__init__(layer, alpha, prob, generator, mode, batch_dim, padding)
        self.add_noise = _check_non_negative("add_noise", add_noise)
        self.mult_noise = _check_non_negative("mult_noise", mult_noise)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, add_noise={self.add_noise}, mult_noise={self.mult_noise})"

    def _mix(self, spec, leaves, lam, index, inverse, pinned):
        mixed, state = super()._mix(spec, leaves, lam, index, inverse, pinned)
        g = self.generator
        if self.mult_noise > 0:  # the levels are drawn once per batch, the noise per element
            level = self.mult_noise * sample_beta(2.0, 5.0, g)
            for path, m in mixed.items():
                uniform = torch.rand(m.shape, generator=g, device=g.device, dtype=torch.float64)
                mixed[path] = m * to_device(1 + level * (2 * uniform - 1), m.device, m.dtype)
        if self.add_noise > 0:
            level = self.add_noise * sample_beta(2.0, 5.0, g)
            for path, m in mixed.items():
                normal = torch.randn(m.shape, generator=g, device=g.device, dtype=torch.float64)
                mixed[path] = m + to_device(level * normal, m.device, m.dtype)
        return mixed, state


def _inverse(index: torch.Tensor, pinned: dict) -> torch.Tensor | None:
    """The inverse of a drawn permutation (built by a scatter), or of a pinned index that is one."""
    return inverse_permutation(index) if "index" in pinned else _scatter_inverse(index)


def check_spatial(kind: str, spec: str, leaves: list[Leaf]) -> torch.Tensor:
    """The one ``(B, C, H, W)`` map (batch at dim 0) that the mixers cutting regions act on, or a one-line
    ``TypeError`` naming the elements to choose from."""
    if len(leaves) != 1:
        names = ", ".join(f"{leaf.name} {tuple(leaf.tensor.shape)}" for leaf in leaves)
        raise TypeError(
            f"{kind} at {spec!r}: the layer returns {len(leaves)} tensors that carry the batch ({names}); "
            f"{kind} cuts one map: select it, e.g. '{spec.split('[')[0]}{leaves[0].name}'"
        )
    h = leaves[0].tensor
    if h.ndim != 4 or leaves[0].dim != 0:
        element = f" element {leaves[0].name}" if leaves[0].path else ""
        raise TypeError(
            f"{kind} at {spec!r} needs a (B, C, H, W) map with the batch first, but{element} has shape "
            f"{tuple(h.shape)} with the batch at dim {leaves[0].dim}"
        )
    return h


def _number(name: str, value) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None


def _check_positive(name: str, value) -> float:
    number = _number(name, value)
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number


def _check_non_negative(name: str, value) -> float:
    number = _number(name, value)
    if not (number >= 0 and math.isfinite(number)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


def check_fraction(name: str, value) -> float:
    """``value`` as a float in [0, 1], or a ``ValueError`` naming ``name``."""
    number = _number(name, value)
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return number

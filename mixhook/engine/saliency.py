"""Saliency for the saliency-guided mixers (SaliencyMix, Attentive CutMix), at any layer they mix.

Two sources, each a ``(B, H, W)`` map over the map the mixer cuts:

- ``"activation"``: the channel-mean magnitude ``mean_c |h|`` of the map being mixed, or of an earlier
  layer's ``(B, C, H', W')`` output (``saliency_layer``, recorded in the same forward and resized
  bilinearly to the mixed map). **No extra pass**: it is read from the forward that mixes. There is none
  at ``"input"`` (the input is mixed before any layer runs).
- ``"gradient"``: ``sqrt(mean_c g**2)`` of the gradient ``g`` of the summed cross-entropy of the batch's
  labels with respect to the mixed map (PuzzleMix's and Co-Mixup's saliency): **one more forward and a
  backward down to that layer**, in eval mode, before the training forward
  (:meth:`~mixhook.engine.mixer.Mixer.gradient_at`: no parameter gradient or batch-norm statistic is
  touched). It needs the labels: ``mixer.use_targets(y)`` before each forward.

The map is computed once per mixing forward and kept with the draw, so activation checkpointing's
recomputation and ``pin_last`` cut the same region; ``pin(saliency=...)`` supplies one of your own (e.g.
the OpenCV saliency SaliencyMix's authors compute on the images).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import recompute
from ..layers import resolve_layer
from ..layouts import channels_first, site_layout
from ..sites import INPUT, Leaf, describe, parse_site
from ..transfer import to_device

SOURCES = ("activation", "gradient")
KEY = "saliency"


def activation_saliency(h: torch.Tensor) -> torch.Tensor:
    """``mean_c |h|`` of a ``(B, C, H, W)`` map: ``(B, H, W)``, detached, in float32 at least."""
    return h.detach().abs().mean(1, dtype=torch.promote_types(h.dtype, torch.float32))


def gradient_saliency(grad: torch.Tensor) -> torch.Tensor:
    """``sqrt(mean_c g**2)`` of a ``(B, C, H, W)`` gradient: ``(B, H, W)``, detached."""
    g = grad.detach().to(torch.promote_types(grad.dtype, torch.float32))
    return g.square().mean(1).sqrt()


class Saliency:
    """The saliency source of one mixer (``kind`` names it in errors)."""

    def __init__(self, kind: str, source: str, layer: str | None, mixer_layers: tuple[str, ...]):
        if source not in SOURCES:
            raise ValueError(f"saliency must be one of {', '.join(SOURCES)}, got {source!r}")
        if layer is not None and (source != "activation" or not isinstance(layer, str) or layer == INPUT):
            raise ValueError(
                f"saliency_layer={layer!r}: an earlier module's name, for saliency='activation' only"
            )
        if source == "activation" and layer is None and INPUT in mixer_layers:
            raise ValueError(
                f"{kind} at 'input' with saliency='activation': the input is mixed before any layer runs, "
                "so there is no activation to read; use saliency='gradient' there (one more forward and "
                "backward) or mix at a hidden layer"
            )
        self.kind, self.source, self.layer = kind, source, layer
        self._recorded: torch.Tensor | None = None

    def __repr__(self) -> str:
        layer = "" if self.layer is None else f", saliency_layer={self.layer!r}"
        return f"saliency={self.source!r}{layer}"

    def register(self, mixer, model: nn.Module, handles: list[RemovableHandle]) -> None:
        """With ``saliency_layer``: a forward hook that records its activation saliency in a forward
        that is about to mix."""
        if self.layer is None:
            return
        name, module = resolve_layer(model, self.layer, "saliency_layer")
        layout = site_layout(model, parse_site(name), None)

        def record(module: nn.Module, args: tuple, output) -> None:
            forward = mixer.current
            if not model.training or forward is None or forward.done:
                return
            if not isinstance(output, torch.Tensor) or output.ndim != 4:
                raise TypeError(
                    f"{self.kind}: saliency_layer {self.layer!r} must output a (B, C, H, W) map, "
                    f"got {describe(output)}"
                )
            output = channels_first(output, layout.of(f"{self.kind}'s saliency_layer", self.layer))
            self._recorded = activation_saliency(output)

        handles.append(module.register_forward_hook(recompute.hook(record)))  # (not in a recomputation)

    def before_forward(self, mixer, model, args, kwargs, spec: str, pinned: Mapping, targets) -> dict:
        self._recorded = None
        if self.source != "gradient" or KEY in pinned:
            return {}
        return {KEY: gradient_saliency(mixer.gradient_at(model, args, kwargs, spec, targets))}

    def before_mix(self, spec: str, leaves: list[Leaf], pinned: Mapping) -> dict:
        if self.source != "activation" or KEY in pinned:
            return {}
        h = leaves[0].tensor
        if self.layer is None:
            return {KEY: activation_saliency(h)}
        recorded, self._recorded = self._recorded, None
        if recorded is None:
            raise RuntimeError(
                f"{self.kind}: saliency_layer {self.layer!r} did not run before the mixed layer {spec!r} "
                "in this forward; choose a layer that runs earlier"
            )
        if recorded.shape[0] != h.shape[0]:
            raise ValueError(
                f"{self.kind}: saliency_layer {self.layer!r} has a batch of {recorded.shape[0]}, the mixed "
                f"layer {spec!r} one of {h.shape[0]}"
            )
        if recorded.shape[-2:] != h.shape[-2:]:
            recorded = F.interpolate(recorded[:, None], size=h.shape[-2:], mode="bilinear")[:, 0]
        return {KEY: recorded}


class SaliencyGuided:
    """What a saliency-guided mixer (a :class:`~mixhook.engine.mixer.Mixer` with a :class:`Saliency` as
    ``self.saliency``) adds to the base's hooks: the ``saliency_layer`` hook, the gradient pass at the
    start of a forward and the activation read at the mixed layer. Listed before ``Mixer`` among the
    bases; :meth:`needs_saliency` says when a mix needs none (SaliencyMix with a pinned box)."""

    saliency: Saliency

    def needs_saliency(self, pinned: Mapping) -> bool:
        return True

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        super()._register(model, modules, handles)
        self.saliency.register(self, model, handles)

    def before_forward(self, model, args, kwargs, spec: str, pinned: Mapping, targets, generator) -> Mapping:
        if not self.needs_saliency(pinned):
            return {}
        return self.saliency.before_forward(self, model, args, kwargs, spec, pinned, targets)

    def before_mix(self, spec: str, leaves: list[Leaf], pinned: Mapping, generator) -> Mapping:
        return self.saliency.before_mix(spec, leaves, pinned) if self.needs_saliency(pinned) else {}


def pinned_saliency(
    kind: str, pinned: Mapping, batch: int, height: int, width: int, device: torch.device
) -> torch.Tensor:
    """The ``(B, H, W)`` saliency of this mix, as a float64 tensor on ``device`` (the mixed map's: the
    boxes and cells are placed there, so that nothing waits for the device), or a one-line error."""
    saliency = pinned.get(KEY)
    if saliency is None:
        raise RuntimeError(f"{kind}: no saliency for this mix (pin one, or attach the mixer to the model)")
    saliency = torch.as_tensor(saliency).detach()
    if tuple(saliency.shape) != (batch, height, width):
        raise ValueError(
            f"{kind}: saliency of shape {tuple(saliency.shape)} does not fit the batch of {batch} "
            f"{height}x{width} maps; it must be ({batch}, {height}, {width})"
        )
    return to_device(saliency, device, torch.float64)


def peaks(saliency: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each map's maximum (the first in row-major order on ties, as numpy's
    ``argmax``): two ``(B,)`` int64 tensors."""
    flat = saliency.flatten(1).argmax(1)
    width = saliency.shape[-1]
    return flat // width, flat % width


def gaussian_blur(maps: torch.Tensor, size: int, sigma: float) -> torch.Tensor:
    """``(B, H, W)`` maps blurred as torchvision's ``GaussianBlur((size, size), sigma)`` blurs them (its
    normalised 1-D kernel in both directions, reflect padding); ``size`` shrinks to the largest odd size
    the map's sides can reflect (a hidden layer's 4x4 map takes 7x7 kernels down to 7; 2x2 to 3)."""
    size = min(size, 2 * min(maps.shape[-2:]) - 1)
    if size < 3:
        return maps
    size -= 1 - size % 2
    x = torch.linspace(-(size - 1) / 2, (size - 1) / 2, size, dtype=maps.dtype, device=maps.device)
    pdf = torch.exp(-0.5 * (x / sigma).square())
    kernel = pdf / pdf.sum()
    pad = size // 2
    out = F.pad(maps[:, None], [pad, pad, pad, pad], mode="reflect")
    out = F.conv2d(out, kernel.view(1, 1, 1, -1))
    return F.conv2d(out, kernel.view(1, 1, -1, 1))[:, 0]


def greedy_cycle(distance: torch.Tensor) -> torch.Tensor:
    """GuidedMixup's ``onecycle_cover`` (3neutronstar/GuidedMixup ``FGVC/Implementor/pairing.pyx``) on
    the device: start at the farthest pair ``(row, col)`` (the first in row-major order on ties, as
    numpy's ``argmax``), then from each partner to its farthest sample not yet taken, and close the cycle
    back to the first: every sample is one partner's once (a permutation). ``n - 2`` steps of device ops,
    no host read."""
    n = distance.shape[0]
    d = distance.clone()
    d.fill_diagonal_(float("-inf"))
    first = d.flatten().argmax().view(1)
    row, col = first // n, first % n
    first = row
    index = torch.empty(n, dtype=torch.int64, device=d.device)
    index.index_put_((row,), col)
    d.index_fill_(1, row, float("-inf"))
    for _ in range(n - 2):
        row = col
        col = d.index_select(0, row).argmax(1)
        index.index_put_((row,), col)
        d.index_fill_(1, row, float("-inf"))
    index.index_put_((col,), first)
    return index


def guided_maps(saliency: torch.Tensor, blur: int, sigma: float) -> torch.Tensor:
    """GuidedMixup's saliency maps as its authors compare and mix them (3neutronstar/GuidedMixup
    ``FGVC/Implementor/guidedmixup.py``: ``self.blur(sc_a)``, then ``_saliency_normalization``'s
    ``sumto1``): ``(B, H, W)`` maps blurred (``blur``: the kernel size, 0 for none), then each normalised to
    sum 1 (a map that sums to 0 stays 0); any other ``(B, ...)`` map normalised only."""
    if saliency.ndim == 3 and blur:
        saliency = gaussian_blur(saliency, blur, sigma)
    dims = tuple(range(1, saliency.ndim))
    return saliency / saliency.sum(dims, keepdim=True).clamp_min(torch.finfo(saliency.dtype).tiny)


def guided_pairs(saliency: torch.Tensor, blur: int, sigma: float) -> torch.Tensor:
    """GuidedMixup's partners: :func:`greedy_cycle` over the L2 distances between the :func:`guided_maps`
    of ``saliency`` (the authors' ``distance_function(..., 'l2')`` and ``onecycle_cover``), on its device."""
    flat = guided_maps(saliency, blur, sigma).flatten(1)
    return greedy_cycle(torch.cdist(flat, flat, compute_mode="donot_use_mm_for_euclid_dist"))

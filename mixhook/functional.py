"""The mixing math, as small pure functions: sampling lam, the blend, soft targets.

Every mixer is built from these; they are public for code that mixes by hand (a custom loop, a test).
Draws take an explicit ``torch.Generator`` and are made in float64 on the generator's device, so that a
seed gives the same draw on every device; they are cast to the activation's dtype where they are used.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from . import fused
from .rows import gather_rows as gather_rows  # (public here: the mixers gather with it)
from .transfer import to_device

_ALMOST_ONE = float.fromhex("0x1.fffffffffffffp-1")  # the largest double below 1
_CONCENTRATIONS: dict = {}  # (a, b, device) -> the [a, b] tensor the samplers take
_CPU = torch.device("cpu")  # (compared with a generator's device: cheaper than reading its .type)


def _concentration(a: float, b: float, device: torch.device) -> torch.Tensor:
    """The ``[a, b]`` tensor the samplers take on ``device``, made once."""
    key = (a, b, device)
    found = _CONCENTRATIONS.get(key)
    if found is None:
        found = _CONCENTRATIONS[key] = torch.tensor([a, b], dtype=torch.float64, device=device)
    return found


def beta_value(a: float, b: float, generator: torch.Generator) -> float:
    """One draw from ``Beta(a, b)`` with a CPU ``generator``, as a Python float: the same number (and
    the same generator state after it) as ``float(sample_beta(a, b, generator))``, drawn the way
    torch's Dirichlet kernel draws it (two Gamma variates, the first over their sum, clamped into
    ``[DBL_MIN, 1)``) at a fraction of its host cost, with no tensor made for the result."""
    concentration = _CONCENTRATIONS.get((a, b, generator.device))
    if concentration is None:
        concentration = _concentration(a, b, generator.device)
    g0, g1 = torch._standard_gamma(concentration, generator=generator).tolist()
    return min(_ALMOST_ONE, max(sys.float_info.min, g0 / (g0 + g1)))


def sample_beta(a: float, b: float, generator: torch.Generator, size: int | None = None) -> torch.Tensor:
    """Draw from ``Beta(a, b)`` with ``generator``: a 0-d float64 tensor, or ``size`` of them.

    ``torch.distributions.Beta`` cannot take a generator, so this draws the same Dirichlet(a, b) sample
    it would (Beta is its first coordinate) through the generator-aware kernel. Values are float64 and
    are cast to the activation's (or the loss's) dtype where they are used.
    """
    if size is None and generator.device == _CPU:
        return torch.scalar_tensor(beta_value(a, b, generator), dtype=torch.float64)
    concentration = _concentration(a, b, generator.device)
    if size is not None:
        concentration = concentration.expand(size, 2).contiguous()
    return torch._sample_dirichlet(concentration, generator=generator)[..., 0]


def sample_lam(alpha: float, generator: torch.Generator) -> torch.Tensor:
    """``lam ~ Beta(alpha, alpha)`` as a 0-d float64 tensor (see :func:`sample_beta`; on the CPU, its
    :func:`beta_value` directly: the draw of every mix)."""
    if generator.device == _CPU:
        return torch.scalar_tensor(beta_value(alpha, alpha, generator), dtype=torch.float64)
    return sample_beta(alpha, alpha, generator)


def generator_on(device: torch.device, generator: torch.Generator) -> torch.Generator:
    """A generator on ``device`` seeded by one draw of ``generator`` (a 62-bit integer): a CPU
    ``generator`` then decides the draws made on any device, with no host sync and nothing copied."""
    seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
    return torch.Generator(device=device).manual_seed(seed)


class DeviceNoise:
    """Elementwise noise for one mix, drawn where the tensor lives (NFM's noise; any method that draws a
    tensor of a map's size): a map-sized draw on the host and its copy to a GPU would cost far more than
    the mix.

    Made from the mix's generator (``draw.generator``): a generator on another device than the one asked
    for (the default CPU generator, for a CUDA map) seeds one there from one draw of its own, on the CPU
    too, so every device runs this one path; a generator already on that device (a user's CUDA generator)
    draws itself. Each device's generator is made once per mix and its draws follow in the order they are
    asked for. Since the seed is drawn from the mix's generator, a recomputation under activation
    checkpointing and ``pin_last`` (which replay that generator) draw the same noise, and a seed gives one
    run's noise on each device. The numbers on a CUDA device differ from the CPU's (Philox, not Mersenne
    Twister); lam, the partners and everything else drawn from the mix's generator do not.
    """

    __slots__ = ("_source", "_made")

    def __init__(self, generator: torch.Generator):
        self._source, self._made = generator, {}

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The generator this mix draws its noise on ``device`` from (``None`` on the meta device, which
        has values to draw for none)."""
        device = torch.device(device)
        if device.type == "meta":
            return None
        found = self._made.get(device)
        if found is None:
            source = self._source
            same = source.device == device and device.type != "cpu"
            found = self._made[device] = source if same else generator_on(device, source)
        return found

    def uniform_(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` filled with ``U(0, 1)`` in place (``torch.rand``'s numbers), on its device."""
        return out.uniform_(generator=self.generator(out.device))

    def normal_(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` filled with ``N(0, 1)`` in place (``torch.randn``'s numbers), on its device."""
        return out.normal_(generator=self.generator(out.device))


def weight_of(lam: torch.Tensor) -> float | torch.Tensor:
    """What the blends and the loss weigh with: one lam on the CPU as a Python float (it then enters
    each op as a scalar: no cast, no copy to the device, no host sync), anything else as it is."""
    if lam.ndim == 0 and lam.is_cpu and not torch.compiler.is_compiling():
        return lam.item()
    return lam


def without_autocast(t: torch.Tensor):
    """A context in which torch's ops run in the dtypes they are given on ``t``'s device: autocast, where
    it is on, turned off there. A mix whose own arithmetic has matmuls (a transport, an alignment plan)
    runs in it, so that it keeps its site's dtype (``torch.autocast`` would run the matmuls in bfloat16 on
    a float32 map, and hand a bfloat16 result back); a network a method runs (a learned mask's) is left
    to autocast."""
    device = t.device.type
    if torch.amp.is_autocast_available(device):
        return torch.autocast(device, enabled=False)
    return contextlib.nullcontext()


def per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` in ``like``'s dtype and device; one value per sample (1-D) is shaped to broadcast over
    ``like``'s non-batch dimensions, a 0-d tensor is left as it is."""
    values = to_device(values, like.device, like.dtype)
    return values.view(-1, *([1] * (like.ndim - 1))) if values.ndim == 1 else values


class _GatherBlend(torch.autograd.Function):
    """``lerp(h[index], h, lam)`` for a permutation ``index``, whose backward gathers through the inverse
    permutation instead of scatter-adding.

    Indexing's own backward scatter-adds into a zeroed tensor; when ``index`` is a permutation the
    gradient of ``h[index]`` is just ``g[inverse]``, so the backward is one gather and one lerp,
    ``lerp(g[inverse], g, lam)`` (one lam; with one per sample, ``lam * g + ((1 - lam) * g)[inverse]``).
    The inverse is computed there (an argsort of the batch's indices), or given."""

    @staticmethod
    def forward(ctx, h, lam, index, inverse):
        ctx.lam = lam if not isinstance(lam, torch.Tensor) else None
        ctx.save_for_backward(*((lam,) if ctx.lam is None else ()), index if inverse is None else inverse)
        ctx.inverted = inverse is not None
        partner = gather_rows(h, index)
        return torch.lerp(partner, h, lam)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        *lam, index = ctx.saved_tensors
        inverse = index if ctx.inverted else torch.argsort(index)
        if ctx.lam is not None or lam[0].ndim == 0:
            rows = gather_rows(grad, inverse)
            out = torch.lerp(rows, grad, ctx.lam if ctx.lam is not None else lam[0])
        else:
            out = torch.addcmul(gather_rows((1 - lam[0]) * grad, inverse), lam[0], grad)
        return out, None, None, None


# From how many elements the blend's backward gathers through the inverse permutation (a custom autograd
# Function: about 25 us more host time per call) instead of indexing's scatter-add (3x slower per byte
# on the CPU): measured on a (8, 16) and a (16, 64, 32, 32) blend, benchmarks/cases/blend.py.
GATHER_FROM = 1 << 16


def inverse_permutation(index: torch.Tensor) -> torch.Tensor | None:
    """The inverse of ``index`` if it is a permutation of ``0..n-1``, else ``None``."""
    if not is_permutation(index):
        return None
    return torch.argsort(index)


def is_permutation(index: torch.Tensor) -> bool:
    """Whether a 1-D ``index`` holds each of ``0..n-1`` once (reads the values: a pinned index only)."""
    n = index.shape[0]
    return bool(torch.equal(torch.sort(index).values, torch.arange(n, device=index.device)))


def blend(
    h: torch.Tensor,
    lam: torch.Tensor | float,
    index: torch.Tensor,
    inverse: torch.Tensor | None = None,
    permutation: bool = False,
    dim: int = 0,
) -> torch.Tensor:
    """``lam * h + (1 - lam) * h[index]`` along the batch dimension ``dim``, in ``h``'s dtype on ``h``'s
    device.

    ``lam`` is a number, a 0-d tensor, or one value per sample (a 1-D tensor of the batch's length);
    ``index`` holds partners in ``[0, B)`` (it is taken with ``index_select``).
    Computed as one gather and one ``torch.lerp`` (equal to the formula up to rounding). Differentiable
    in ``h`` through both terms, exactly like the hand-edited forward of the papers; given ``inverse``
    (``index``'s inverse permutation), or told that ``index`` is a ``permutation``, the backward gathers
    through the inverse instead of scatter-adding (an index that is not a permutation must not say so:
    its repeated rows would get one gradient instead of their sum). It does so from
    ``GATHER_FROM`` elements on: below, the scatter-add costs less than the custom backward's host time.
    On CUDA with one lam it can do so in one kernel each way (:mod:`mixhook.fused`, opt-in:
    ``mixhook.fused.use(True)``).
    """
    if dim:  # (a view: the batch first, and back)
        return blend(h.movedim(dim, 0), lam, index, inverse, permutation).movedim(0, dim)
    if isinstance(lam, torch.Tensor):
        lam = per_sample(lam.to(torch.float64) if not lam.dtype.is_floating_point else lam, h)
    else:
        lam = float(lam)
    if index.device != h.device:
        index = to_device(index, h.device)
    if (
        (inverse is not None or permutation)
        and h.requires_grad
        and torch.is_grad_enabled()
        and h.numel() >= GATHER_FROM
    ):
        inverse = None if inverse is None else to_device(inverse, h.device)
        if h.is_cuda and isinstance(lam, float) and fused.enabled() and not torch.compiler.is_compiling():
            return fused.gather_lerp(h, index, torch.argsort(index) if inverse is None else inverse, lam)
        return _GatherBlend.apply(h, lam, index, inverse)
    return torch.lerp(gather_rows(h, index), h, lam)


def lerp_rows(h: torch.Tensor, lam: torch.Tensor, index: torch.Tensor, one: bool = True) -> torch.Tensor:
    """``lerp(h[index], h, lam)`` with ``lam`` given per sample (1-D, float64, on ``h``'s device), bit for
    bit as :func:`blend` computes it: for ``one`` lam (a number; repeated here) torch's kernel weighs
    16-bit floats in float32 and rounds the result once, for a lam per sample it weighs with lam rounded
    to ``h``'s dtype. The traced blend (no host read)."""
    if not one:
        return torch.lerp(gather_rows(h, index), h, lam.to(h.dtype).view(-1, *([1] * (h.ndim - 1))))
    compute = torch.float32 if h.dtype in (torch.float16, torch.bfloat16) else h.dtype
    w = lam.to(compute).view(-1, *([1] * (h.ndim - 1)))
    return torch.lerp(gather_rows(h, index).to(compute), h.to(compute), w).to(h.dtype)


def mask_blend(h: torch.Tensor, mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``mask * h + (1 - mask) * h[index]`` for ``h`` (B, C, H, W) and one ``(H, W)`` mask of weights (1:
    the sample's own), in ``h``'s dtype on ``h``'s device; gradients flow to both terms."""
    m = mask if mask.device == h.device and mask.dtype == h.dtype else to_device(mask, h.device, h.dtype)
    return m * h + (1 - m) * h[index if index.device == h.device else to_device(index, h.device)]


def positions(target: torch.Tensor) -> int:
    """How many position dimensions a target has beyond its batch (and, floating, its class) dimension:
    0 for ``(B,)`` indices and ``(B, K)`` floating targets, 2 for a ``(B, H, W)`` or ``(B, K, H, W)`` map."""
    return target.ndim - (2 if target.dtype.is_floating_point else 1)


def smooth_one_hot(
    target: torch.Tensor, num_classes: int, smoothing: float = 0.0, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """One-hot class probabilities with label smoothing (timm's convention), in ``dtype`` (torch's
    default dtype if ``None``).

    The true class gets ``1 - smoothing + smoothing / num_classes``, every other class
    ``smoothing / num_classes``; rows sum to 1.
    """
    off = smoothing / num_classes
    out = torch.full((target.shape[0], num_classes), off, device=target.device, dtype=dtype)
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


def along(dim: int, fn: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """``fn`` applied with the batch moved to dim 0 and moved back (a view; nothing copied for dim 0)."""
    if dim == 0:
        return fn(h)
    return fn(h.movedim(dim, 0)).movedim(0, dim)

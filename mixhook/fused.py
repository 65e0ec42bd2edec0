"""The blend in one pass over memory each way: a Triton kernel on CUDA, as a ``torch.library`` op.

Eager torch blends a permutation ``index`` as a gather and a ``lerp`` (the gather reads ``h`` and writes a
copy, the lerp reads both and writes the result: five passes over the tensor), and its backward does the
same on the gradient (:class:`~mixhook.functional._GatherBlend`): ten passes, where one kernel reading
``h`` at its own row and at its partner's and writing the result does three each way. On an H200 the eager
blend forward + backward moved 0.385 of the copy bandwidth (2026-11-26).

``gather_lerp(h, index, inverse, lam)`` is ``lerp(h[index], h, lam)`` for one ``lam`` (a number) along the
first dimension: one kernel on CUDA (its rows read where they lie, so any layout whose samples are dense
blocks, channels-last included), torch's two ops elsewhere. Its backward is the same op on the gradient
with the inverse permutation (the gradient of ``h[index]`` is ``g[inverse]``), so it stays one kernel, and
its double backward too. The kernel computes in float32 with torch's ``lerp`` formula; it may round
once less than eager torch where the compiler fuses a multiply-add, as torch's own CUDA kernel may.
Float64 and other layouts take torch's ops.

Off by default (``use(True)`` turns it on for :func:`mixhook.functional.blend`'s permutation blends on
CUDA outside ``torch.compile``, which fuses its own): it stays opt-in until a GPU run has measured it
against the eager blend (``benchmarks/cases/blend.py``).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from .rows import gather_rows

_ENABLED = False


def use(enabled: bool = True) -> None:
    """Whether :func:`mixhook.functional.blend` blends a permutation on CUDA with :func:`gather_lerp`."""
    global _ENABLED
    _ENABLED = bool(enabled)


def enabled() -> bool:
    """Whether :func:`use` turned the fused blend on (and Triton is there to run it)."""
    return _ENABLED and has_triton()


@functools.cache
def has_triton() -> bool:
    """Whether Triton can be imported (it ships with torch's CUDA wheels); it is imported only when the
    kernel first runs (:mod:`mixhook.fused_kernel`: importing it costs 0.2 s)."""
    return importlib.util.find_spec("triton") is not None


FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # (float64 is no speed case: torch's ops)
# the longest row the kernel takes: its blocks of 1,024 run along CUDA's second grid dimension, at most
# 65,535 (a language model's (T, D) row of 16k tokens by 8k is twice that: torch's ops)
ROW_LIMIT = 65_535 * 1024


def fusable(h: torch.Tensor) -> bool:
    """Whether the kernel blends ``h``: a float32, bfloat16 or float16 tensor whose samples are each one
    dense block of memory, one after another, so that sample ``i`` is elements ``[i * row, (i + 1) *
    row)`` of its storage (contiguous, or channels-last), of at most ``ROW_LIMIT`` elements."""
    if h.ndim == 0 or h.shape[0] == 0 or h.dtype not in FUSED_DTYPES or h[0].numel() > ROW_LIMIT:
        return False
    if h.is_contiguous():
        return True
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return h.ndim in formats and h.is_contiguous(memory_format=formats[h.ndim])


@torch.library.custom_op("mixhook::gather_lerp", mutates_args=())
def gather_lerp(h: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, lam: float) -> torch.Tensor:
    """``lerp(h[index], h, lam)`` for a permutation ``index`` of ``h``'s first dimension, ``inverse`` its
    inverse (what the backward gathers with): one kernel on CUDA for a tensor that is :func:`fusable`."""
    if h.is_cuda and has_triton() and fusable(h):
        from . import fused_kernel

        return fused_kernel.launch(fused_kernel.jitted, h, index, lam)
    return torch.lerp(gather_rows(h, index), h, lam)


@gather_lerp.register_fake
def _(h, index, inverse, lam):
    return torch.empty_like(h)


def _setup(ctx, inputs, output):
    _, index, inverse, lam = inputs
    ctx.save_for_backward(index, inverse)
    ctx.lam = lam


def _backward(ctx, grad):
    index, inverse = ctx.saved_tensors
    # d out[i] = lam d h[i] + (1 - lam) d h[index[i]]: h[j]'s gradient is lam g[j] + (1 - lam) g[inverse[j]]
    return gather_lerp(grad, inverse, index, ctx.lam), None, None, None


gather_lerp.register_autograd(_backward, setup_context=_setup)

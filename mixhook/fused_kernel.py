"""The Triton kernel of :mod:`mixhook.fused` (imported when it first runs on CUDA: Triton's import costs
0.2 s, which ``import mixhook`` does not pay); Triton's interpreter runs the same function on the CPU in
the tests."""

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements of one row a program blends (mixhook.fused.ROW_LIMIT counts in these)


def gather_lerp_kernel(h, index, out, lam, row, BLOCK: tl.constexpr):  # noqa: N803 (Triton's constexpr style)
    """Program ``(i, j)``: ``out[i, cols] = lerp(h[index[i], cols], h[i, cols], lam)`` for the ``j``-th
    block of a row of ``row`` elements, torch's formula (``lam < 0.5``: ``start + lam (end - start)``,
    else ``end - (end - start)(1 - lam)``), in float32 as torch's CUDA kernel weighs these dtypes
    (``lam`` is passed as a float32, as torch rounds a scalar weight for them)."""
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < row
    partner = tl.load(index + i).to(tl.int64)
    start = tl.load(h + partner * row + cols, mask=keep).to(tl.float32)
    end = tl.load(h + i * row + cols, mask=keep).to(tl.float32)
    diff = end - start
    mixed = tl.where(lam < 0.5, start + lam * diff, end - diff * (1.0 - lam))
    tl.store(out + i * row + cols, mixed.to(out.dtype.element_ty), mask=keep)


jitted = triton.jit(gather_lerp_kernel)


def launch(kernel, h: torch.Tensor, index: torch.Tensor, lam: float) -> torch.Tensor:
    """``kernel`` (:func:`gather_lerp_kernel`, jitted or interpreted) run over ``h``: the blended tensor,
    laid out as ``h`` (``h`` must be :func:`mixhook.fused.fusable`)."""
    out = torch.empty_like(h)
    row = h[0].numel()
    kernel[(h.shape[0], triton.cdiv(row, BLOCK))](h, index, out, lam, row, BLOCK=BLOCK)
    return out

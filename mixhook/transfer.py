"""Moving a hook's draws (lam, the permutation, masks, noise) to the activation's device without a host sync.

The draws are made on the CPU from the hook's own generator, so that a seed gives the same mix on every
device. ``tensor.to("cuda")`` from ordinary (pageable) memory synchronises the host with the stream
before it copies: the Python side then waits for every queued kernel, each step, and the GPU idles while
the next step is being launched. Copying from page-locked memory with ``non_blocking=True`` queues the
copy like a kernel instead; the caching host allocator keeps the page-locked buffer until the copy has
run, so the source may be dropped at once.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t.to(device, dtype)``, queued without a host sync when ``t`` is on the CPU and ``device`` is CUDA."""
    if dtype is None and t.device == device:
        return t
    if (
        t.device.type != "cpu"
        or torch.device(device).type != "cuda"
        or torch.compiler.is_compiling()  # traced: the compiled graph does its own transfers
    ):
        return t.to(device=device, dtype=dtype)
    if dtype is not None:
        t = t.to(dtype)  # on the CPU, before the copy: the same rounding as t.to(device, dtype)
    return t.pin_memory().to(device, non_blocking=True)

"""Moving a hook's draws (lam, the permutation, masks, noise) to the activation's device without a host sync.

The draws are made on the CPU from the hook's own generator, so that a seed gives the same mix on every
device. ``tensor.to("cuda")`` from ordinary (pageable) memory synchronises the host with the stream
before it copies: the Python side then waits for every queued kernel, each step, and the GPU idles while
the next step is being launched. Copying from page-locked memory with ``non_blocking=True`` queues the
copy like a kernel instead; the caching host allocator keeps the page-locked buffer until the copy has
run, so the source may be dropped at once.
"""

from __future__ import annotations

import collections
import threading
import weakref

import torch

# The partner indices copied last: id(the CPU index) -> (a weak reference to it, its version counter when
# copied, the device, the CUDA stream the copy was queued on, the copy). A mix needs its index on the
# device twice, in the blend and in the loss (the partners' targets): the second asks for the copy the
# first made, so a mix copies it once, as a hand-written hook keeps its index on the device. An index
# changed in place since (its version moved) or gone (its reference dead) is copied anew. A few are kept:
# a blend may copy the inverse permutation between the two.
_INDICES: collections.OrderedDict = collections.OrderedDict()
_KEEP = 4
_LOCK = threading.Lock()


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t.to(device, dtype)``, queued without a host sync when ``t`` is on the CPU and ``device`` is CUDA;
    a 1-D int64 CPU tensor (a partner index) is copied to a device once while it is unchanged."""
    if dtype is None and t.device == device:
        return t
    if (
        not torch.compiler.is_compiling()
        and dtype is None
        and t.dtype == torch.int64
        and t.ndim == 1
        and t.device.type == "cpu"
        and not t.is_inference()  # (no version counter)
    ):
        return _index_on(t, torch.device(device))
    return _copy(t, device, dtype)


def _index_on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The index ``t`` on ``device``: the copy made before if ``t`` is unchanged since and the same CUDA
    stream asks (another stream could read it before the queued copy ran), else a new one."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    with _LOCK:  # (threads: nn.DataParallel's replicas run their forwards at once)
        found = _INDICES.get(id(t))
    if found is not None and found[0]() is t and found[1:4] == (t._version, device, stream):
        return found[4]
    copy = _copy(t, device, None)
    with _LOCK:
        _INDICES.pop(id(t), None)
        _INDICES[id(t)] = (weakref.ref(t), t._version, device, stream, copy)
        while len(_INDICES) > _KEEP:
            _INDICES.popitem(last=False)
    return copy


def _copy(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    if (
        t.device.type != "cpu"
        or torch.device(device).type != "cuda"
        or torch.compiler.is_compiling()  # traced: the compiled graph does its own transfers
    ):
        return t.to(device=device, dtype=dtype)
    if dtype is not None:
        t = t.to(dtype)  # on the CPU, before the copy: the same rounding as t.to(device, dtype)
    return t.pin_memory().to(device, non_blocking=True)

"""Case 4: the blend's forward + backward as GB/s, next to a device-to-device copy of the same tensor.

The rate counts the least traffic a blend forward + backward can do, four passes over the tensor (read
``h``, write the result; read the gradient, write ``h``'s), so that 1.0 is a copy's speed. What each way
really moves: eager torch's gather and ``lerp`` make five passes each way (the gather reads and writes,
the lerp reads two and writes), 4/10 of a copy's rate at best; the fused kernel (``mixhook.fused``, CUDA)
three each way (its own row, its partner's, the result), 4/6 of a copy's rate where the partner's row
comes from memory, more where it is still in the cache (an H200's L2 holds 50 MB: a CIFAR layer1 map of
batch 128 is 34 MB)."""

from __future__ import annotations

import statistics

import torch

from mixhook import blend, fused


def blend_bandwidth(device, timer, reps, shape) -> dict:
    torch.manual_seed(0)
    h = torch.randn(*shape, device=device, requires_grad=True)
    grad = torch.randn(*shape, device=device)
    index = torch.randperm(shape[0], device=device)
    inverse = torch.argsort(index)
    lam = torch.tensor(0.3, device=device)
    src, dst = torch.randn(*shape, device=device), torch.empty(*shape, device=device)

    def formula():
        torch.autograd.grad(lam * h + (1 - lam) * h[index], h, grad)

    def mixhook_blend():  # as the hooks call it: lam a float, the index a drawn permutation
        torch.autograd.grad(blend(h, 0.3, index, permutation=True), h, grad)

    def lerp():
        torch.autograd.grad(torch.lerp(h[index], h, lam), h, grad)

    def fused_blend():  # mixhook.fused's kernel each way (torch's ops where it does not run: a CPU)
        torch.autograd.grad(fused.gather_lerp(h, index, inverse, 0.3), h, grad)

    def copy_():
        dst.copy_(src)

    variants = {"formula": formula, "lerp": lerp, "mixhook_blend": mixhook_blend, "copy": copy_}
    if device.type == "cuda" and fused.has_triton():
        variants["fused"] = fused_blend
    times = timer.side_by_side(variants, reps=reps, inner=3, warmup=2)
    nbytes = h.numel() * h.element_size()
    rates = {k: 4 * nbytes / statistics.median(v) / 1e9 for k, v in times.items() if k != "copy"}
    copy_rate = 2 * nbytes / statistics.median(times["copy"]) / 1e9
    return {
        "shape": list(shape),
        "megabytes": nbytes / 1e6,
        "GBps": rates,
        "copy_GBps": copy_rate,
        "fraction_of_copy": {k: v / copy_rate for k, v in rates.items()},
    }

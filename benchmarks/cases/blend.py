"""Case 4: the blend's forward + backward as GB/s, next to a device-to-device copy of the same tensor."""

from __future__ import annotations

import statistics

import torch

from mixhook import blend


def blend_bandwidth(device, timer, reps, shape) -> dict:
    torch.manual_seed(0)
    h = torch.randn(*shape, device=device, requires_grad=True)
    grad = torch.randn(*shape, device=device)
    index = torch.randperm(shape[0], device=device)
    lam = torch.tensor(0.3, device=device)
    src, dst = torch.randn(*shape, device=device), torch.empty(*shape, device=device)

    def formula():
        torch.autograd.grad(lam * h + (1 - lam) * h[index], h, grad)

    def mixhook_blend():  # as the hooks call it: lam a float, the index a drawn permutation
        torch.autograd.grad(blend(h, 0.3, index, permutation=True), h, grad)

    def lerp():
        torch.autograd.grad(torch.lerp(h[index], h, lam), h, grad)

    def copy_():
        dst.copy_(src)

    times = timer.side_by_side(
        {"formula": formula, "lerp": lerp, "mixhook_blend": mixhook_blend, "copy": copy_},
        reps=reps,
        inner=3,
        warmup=2,
    )
    nbytes = h.numel() * h.element_size()
    # the least traffic a blend forward + backward can do: read h, write out; read grad, write grad_h.
    # mixhook's eager blend makes five passes each way (the gather: read, write; the lerp: read two,
    # write), so 4/10 of a copy's rate is the most torch ops allow; a compiled blend can fuse to four.
    rates = {k: 4 * nbytes / statistics.median(v) / 1e9 for k, v in times.items() if k != "copy"}
    copy_rate = 2 * nbytes / statistics.median(times["copy"]) / 1e9
    return {
        "shape": list(shape),
        "megabytes": nbytes / 1e6,
        "GBps": rates,
        "copy_GBps": copy_rate,
        "fraction_of_copy": {k: v / copy_rate for k, v in rates.items()},
    }

"""The parameters a method trains beside the model (AutoMix's Mix Block, SMMix's token head): no DDP wrapper
holds them, so their gradients are averaged over the ranks here, as DDP averages the model's."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist


def average_over_ranks(parameters: Iterable[torch.Tensor], wanted: Callable[[], bool]) -> bool:
    """Under ``torch.distributed`` with several ranks: each of ``parameters``' gradients averaged over the
    ranks as each backward accumulates it, while ``wanted()`` says so (every rank must then run the
    backward, as under DDP). Returns whether the hooks were registered (not outside several ranks)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False

    def average(p: torch.Tensor) -> None:
        if wanted():
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())

    for p in parameters:
        p.register_post_accumulate_grad_hook(average)
    return True

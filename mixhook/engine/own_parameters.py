"""The parameters a method trains beside the model (AutoMix's Mix Block, SMMix's token head, SUMix's
uncertainty layer): no DDP wrapper holds them, so their gradients are averaged over the ranks here, as DDP
averages the model's; and a layer sized as the model's classifier follows it where the model is moved or
cast after attach."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn


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


def following(layer: nn.Module, like: nn.Module | None) -> nn.Module:
    """``layer`` on the device and dtype of ``like``'s weight (the classifier it is sized as), moved there
    (its parameters the same objects) where the model was moved or cast after attach (``model.float()``),
    as a layer made now would be; as it is where ``like`` is ``None``."""
    weight = None if like is None else like.weight
    if weight is not None and (layer.weight.dtype, layer.weight.device) != (weight.dtype, weight.device):
        layer.to(device=weight.device, dtype=weight.dtype)
    return layer

"""Mixing partners from the global batch of a data-parallel job (OpenMixup's ``dist_mode``).

With ``partners="global"`` a mixer's partner for each local sample is drawn from the batches of all
ranks: one permutation of the ``world * n`` samples, drawn on rank 0 and broadcast, each rank taking its
slice; the mixed layer's output is gathered from every rank with an all-gather whose backward sends each
partner's gradient back to the rank that owns it (``torch.distributed.nn.functional.all_gather``), so the
gradients are those of one process mixing the global batch. Whether a forward mixes and at which layer is
rank 0's decision, broadcast at the start of every training forward: the ranks must run the same training
forwards (a forward on one rank only would wait for the others), with equal local batches.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

PARTNERS = ("local", "global")


def crosses_ranks(*hooks) -> bool:
    """Whether one of ``hooks`` (or of a ``OneOf``'s mixers) draws partners from every rank."""
    found = [m for hook in hooks if hook is not None for m in [hook, *getattr(hook, "mixers", [])]]
    return any(getattr(m, "partners", "local") == "global" for m in found)


def check_partners(partners: str) -> str:
    if partners not in PARTNERS:
        raise ValueError(f"partners must be one of {', '.join(PARTNERS)}, got {partners!r}")
    return partners


def world(kind: str) -> tuple[int, int]:
    """``(world size, rank)`` of the initialised default process group, or a one-line ``RuntimeError``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{kind}(partners='global') needs torch.distributed initialised (torchrun, "
            "init_process_group): a single process has only its own batch; use partners='local'"
        )
    return dist.get_world_size(), dist.get_rank()


def _device() -> torch.device:
    """Where the default group's collectives take tensors (NCCL: the current CUDA device)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast(values: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``values`` on every rank (a copy; on the CPU)."""
    out = values.to(_device()).clone()
    dist.broadcast(out, src=0)
    return out.cpu()


def gather(h: torch.Tensor) -> torch.Tensor:
    """Every rank's ``h`` concatenated along dim 0, in rank order; differentiable: the gradient of each
    rank's part goes back to that rank (summed over the ranks that used it).

    ``torch.distributed.nn.functional.all_gather`` is marked deprecated in favour of the functional
    collectives, whose backward is a reduce-scatter that gloo lacks; this one falls back to an all-to-all
    on gloo, so it is kept (its warning silenced) until the replacement works on every backend."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.cat(dist_nn.all_gather(h), dim=0)


def gather_labels(target: torch.Tensor) -> torch.Tensor:
    """Every rank's ``target`` concatenated along dim 0 (no gradient), on ``target``'s device."""
    parts = [torch.empty_like(target, device=_device()) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, target.to(_device()).contiguous())
    return torch.cat(parts).to(target.device)


def global_index(n: int, generator: torch.Generator) -> torch.Tensor:
    """This rank's slice of one permutation of the global batch (``world * n`` samples), drawn on rank 0
    and broadcast; every rank draws it (so the streams stay in step) and takes rank 0's."""
    size, rank = dist.get_world_size(), dist.get_rank()
    perm = broadcast(torch.randperm(size * n, generator=generator, device=generator.device))
    return perm[rank * n : (rank + 1) * n]

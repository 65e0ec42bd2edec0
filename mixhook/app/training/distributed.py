"""Data-parallel training on PyTorch's own engine: ``torchrun`` starts the processes, this module joins
them (NCCL on CUDA, gloo on CPU) and gives the loop the few collective operations it needs.

Two strategies (``trainer.strategy``): ``ddp`` wraps the model in ``DistributedDataParallel`` (every rank
holds all of it); ``fsdp`` shards it with FSDP2 (:func:`shard`: ``fully_shard`` on each unit, then on the
model), so each rank holds a share of the parameters, gradients and optimizer state. Either way the hooks
are attached to the model before it is wrapped or sharded, every rank starts each forward from rank 0's
buffers (batch-norm statistics: DDP broadcasts them, :func:`shard` does the same), the gradients are the
mean of the ranks', and the checkpoint holds the whole model and optimizer (:func:`full_state`).

One process per device. Each rank trains on its share of every epoch (:class:`mixhook.app.data.EpochSampler`
shards like ``DistributedSampler``), mixes its own local batch with its own generator stream, and takes
part in agreeing when to stop (a signal or a non-finite loss on any rank stops every rank at the same
step). Only rank 0 writes logs, ``metrics.csv``, checkpoints and ``summary.json``; test metrics are
summed over the ranks' shards of the test set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

STRATEGIES = ("ddp", "fsdp")


@dataclass
class Dist:
    """This process's place in the job: ``world == 1`` for a single process (no collective runs)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")  # where collective tensors live (CUDA for NCCL)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, cuda: bool) -> Dist:
        """Join the job ``torchrun`` started (``WORLD_SIZE`` > 1) or that submitit started with several
        tasks (Hydra's submitit launchers with ``tasks_per_node`` > 1; submitit's own helper exports the
        variables), or a single process otherwise."""
        if "WORLD_SIZE" not in os.environ and os.environ.get("SUBMITIT_EXECUTOR"):
            from submitit import JobEnvironment
            from submitit.helpers import TorchDistributedEnvironment

            if JobEnvironment().num_tasks > 1:
                TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        return cls(rank, world, local, device)

    def seed(self, seed: int) -> int:
        """This rank's seed for its own random streams: ``seed`` itself on a single process."""
        if not self.enabled:
            return seed
        return int(np.random.SeedSequence([seed, self.rank]).generate_state(1, np.uint32)[0])

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (every rank must call this at the same point)."""
        if not self.enabled:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def max(self, value: int) -> int:
        """The largest of the ranks' ``value``."""
        if not self.enabled:
            return value
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks, in float64."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def shard_units(model: nn.Module, units: list[str] | None) -> list[str]:
    """The names of the modules :func:`shard` shards one by one: ``units`` (each checked to be a module of
    ``model`` holding parameters, and none inside another; a one-line ``ValueError`` otherwise), or each
    of the model's children that holds parameters."""
    if units is None:
        return [name for name, child in model.named_children() if any(True for _ in child.parameters())]
    names = dict(model.named_modules())
    for name in units:
        if name not in names or name == "":
            children = ", ".join(n for n, _ in model.named_children())
            raise ValueError(
                f"trainer.fsdp_units: {name!r} is not a module of the model; its children: {children}"
            )
        if not any(True for _ in names[name].parameters()):
            raise ValueError(
                f"trainer.fsdp_units: {name!r} holds no parameters, so there is nothing to shard"
            )
    for name in units:
        outer = next((o for o in units if o != name and name.startswith(o + ".")), None)
        if outer is not None:
            raise ValueError(f"trainer.fsdp_units: {name!r} is inside {outer!r}; name units that do not nest")
    return list(units)


def shard(model: nn.Module, units: list[str], dist_: Dist) -> None:
    """Shard ``model`` in place with FSDP2 over the job's ranks: ``fully_shard`` on each of ``units``, then
    on the model; and, as ``DistributedDataParallel`` does, every forward starts from rank 0's buffers
    (a model pre-hook broadcasts them), so that the ranks' batch-norm statistics agree and the checkpoint
    rank 0 writes is every rank's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dist_.device.type, (dist_.world,))
    for name in units:
        fully_shard(model.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    buffers = [b for b in model.buffers() if b.numel()]
    if buffers:
        model.register_forward_pre_hook(lambda module, args: _broadcast(buffers))


def _broadcast(buffers: list[torch.Tensor]) -> None:
    """Rank 0's values of ``buffers`` on every rank, in one broadcast per dtype (as DDP coalesces them)."""
    for dtype in dict.fromkeys(b.dtype for b in buffers):
        group = [b for b in buffers if b.dtype == dtype]
        flat = torch.cat([b.reshape(-1) for b in group])
        dist.broadcast(flat, src=0)
        for b, values in zip(group, flat.split([b.numel() for b in group]), strict=True):
            b.copy_(values.view_as(b))


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole model's and optimizer's state dicts of a sharded model, on the CPU, as one process's
    would be (every rank must call it: the shards are gathered)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(
        model, optimizer, options=options
    )


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict):
    """Put :func:`full_state`'s dicts back into a sharded model and its optimizer (each rank takes its
    shard)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)

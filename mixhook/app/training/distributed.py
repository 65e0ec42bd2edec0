"""Data-parallel training on PyTorch's own engine: ``torchrun`` starts the processes, this module joins
them (NCCL on CUDA, gloo on CPU) and gives the loop the few collective operations it needs.

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

"""Run by test_distributed.py under torchrun (2 processes, gloo): ManifoldMixup(partners="global") in a
DDP training step equals one process mixing the global batch by hand, in float64.

Each rank holds 4 of the same 8 samples and its own mixer stream (different seeds, so that agreeing on rank
0's decisions is what is tested); over several steps with prob < 1 and three layers, rank 0 gathers what
every rank mixed (layer, lam, global index) and the DDP gradients, recomputes the step on the whole batch
in one process, and writes the largest differences to the file named by argv[1]."""

import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_worker import end_without_finalizing  # (this script's folder is on sys.path under torchrun)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mixhook import ManifoldMixup
from tests.helpers import per_sample_ce


def scenario() -> dict:
    """The scenario, in the process group already joined: what rank 0 found (``{}`` on the other ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g, dtype=torch.double), torch.randint(0, 3, (8,), generator=g)
    n = 8 // world
    local_x, local_y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
    mix = ManifoldMixup(
        ["input", "1", "3"],
        alpha=1.0,
        prob=0.7,
        partners="global",
        generator=torch.Generator().manual_seed(10 + rank),
    )
    mix.attach(model)
    ddp = DDP(model)
    worst = {"logits": 0.0, "loss": 0.0, "grad": 0.0, "targets": 0.0}
    mixed_steps, layers_seen = 0, set()
    for _ in range(12):
        ddp.zero_grad()
        logits = ddp(local_x)
        loss = mix.loss(per_sample_ce, logits, local_y).mean()
        loss.backward()
        last = mix.last
        # what every rank did, gathered
        layer = torch.tensor([-1 if last is None else mix.layers.index(last.layer)])
        layers = [torch.zeros_like(layer) for _ in range(world)]
        dist.all_gather(layers, layer)
        assert len({int(t) for t in layers}) == 1, f"ranks mixed at different layers: {layers}"
        all_logits = [torch.zeros_like(logits) for _ in range(world)]
        dist.all_gather(all_logits, logits.detach())
        if last is None:
            continue
        mixed_steps += 1
        layers_seen.add(last.layer)
        lam = last.lam.expand(n).contiguous()
        lams, indices = (
            [torch.zeros_like(lam) for _ in range(world)],
            [torch.zeros_like(last.index) for _ in range(world)],
        )
        dist.all_gather(lams, lam)
        dist.all_gather(indices, last.index.contiguous())
        soft = mix.targets(local_y, 3, dtype=torch.double)
        all_soft = [torch.zeros_like(soft) for _ in range(world)]
        dist.all_gather(all_soft, soft)
        losses = [torch.zeros(()).double() for _ in range(world)]
        dist.all_gather(losses, loss.detach().reshape(()))
        if rank != 0:
            continue
        lam_all, index_all = torch.cat(lams), torch.cat(indices)
        assert sorted(index_all.tolist()) == list(range(8)), index_all  # one permutation of the global batch
        # one process, the whole batch, the blend written by hand
        reference.zero_grad()
        w = lam_all.view(-1, 1)
        h = x
        if last.layer == "input":
            h = w * h + (1 - w) * h[index_all]
        for i, module in enumerate(reference):
            h = module(h)
            if str(i) == last.layer:
                h = w * h + (1 - w) * h[index_all]
        ref_loss = (lam_all * per_sample_ce(h, y) + (1 - lam_all) * per_sample_ce(h, y[index_all])).mean()
        ref_loss.backward()
        ref_soft = (
            lam_all.view(-1, 1) * F.one_hot(y, 3).double()
            + (1 - lam_all.view(-1, 1)) * F.one_hot(y[index_all], 3).double()
        )
        worst["logits"] = max(worst["logits"], float((torch.cat(all_logits) - h.detach()).abs().max()))
        worst["loss"] = max(worst["loss"], abs(float(torch.stack(losses).mean()) - float(ref_loss.detach())))
        worst["targets"] = max(worst["targets"], float((torch.cat(all_soft) - ref_soft).abs().max()))
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            worst["grad"] = max(worst["grad"], float((p.grad - q.grad).abs().max()))
    return {"worst": worst, "mixed_steps": mixed_steps, "layers": sorted(layers_seen)} if rank == 0 else {}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    found = scenario()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(found, f)
    dist.barrier()  # (neither rank tears gloo down while the other may still be in its last collective)
    dist.destroy_process_group()
    end_without_finalizing()  # (fsdp_worker.py says why: gloo's threads can outlive Python's shutdown)


if __name__ == "__main__":
    main(sys.argv[1])

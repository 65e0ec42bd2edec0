"""The matrix's own-loop cells under DDP and FSDP2: run by torchrun (two processes, gloo, CPU) as
``python -m torch.distributed.run --nproc_per_node 2 harness/matrix/distributed.py OUT.json [--modes=M,...]
METHOD...`` (the modes: ``ddp`` and ``fsdp`` by default; ``fsdp_late``, the mixer attached before
``fully_shard`` of the root alone, whose forward then replaces the root's parameters by the gathered ones).

For each method and each of DDP (``DistributedDataParallel``) and FSDP2 (``fully_shard`` on each child of
the model with parameters, then on the model):
each rank trains ``STEPS`` steps on its own half of each step's batch, its draws reseeded from ``(seed,
rank, step)`` (its partner batch, for Balanced-MixUp, from ``PartnerStream`` with the rank), the per-sample
criterion's mean under the mix, SGD; rank 0 then replays both ranks' batches in one process (the gradients
averaged, as both reduce them) and compares the weights (a learned mixer's Mix Block and momentum copy
too): ``exact`` within 1e-12, ``refused`` (one line before the first step), ``fails`` otherwise. Rank 0
writes every cell to OUT.json. The hooks with a loss of their own (NoiseFiT, SFTMix) train their language
model the same way (:func:`harness.matrix.language.distributed`: each rank on its own batches, SFTMix's
pairs within each).
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import mixhook
from harness.matrix import language
from harness.matrix.cells import BATCH, LR, STEPS, TOLERANCE, hand_setup, hand_step
from harness.matrix.methods import BY_NAME, Method, criterion, model

WORLD = 2


def shard(step: int, rank: int, x: torch.Tensor, y: torch.Tensor):
    start = step * BATCH * WORLD + rank * BATCH
    return x[start : start + BATCH], y[start : start + BATCH]


def trained(method: Method, mode: str, rank: int) -> list[torch.Tensor]:
    """This rank's run under ``mode``: the full weights after ``STEPS`` steps."""
    net = model(method.kind)
    x, y, mixer, stream = hand_setup(method, n=STEPS * BATCH * WORLD)
    loss_of = criterion(method.kind)
    if mode == "ddp":
        wrapped = DistributedDataParallel(net)
    elif mode == "fsdp":  # as users shard: each child with parameters of its own, then the root
        for child in net.children():
            if any(True for _ in child.parameters()):
                fully_shard(child)
        fully_shard(net)
        wrapped = net
    else:  # "fsdp_late": attached first (as the app and Lightning do), then one unit, the root
        wrapped = net
    hooks = method.hooks("")
    with mixhook.attach(net, *hooks, mixer):
        if mode == "fsdp_late":
            fully_shard(net)
        opt = torch.optim.SGD([*net.parameters(), *mixer.parameters()], lr=LR)
        for step in range(STEPS):
            hand_step(mixer, stream, wrapped, *shard(step, rank, x, y), loss_of, rank, step, hooks=hooks)
            opt.step()
            opt.zero_grad()
    weights = [*net.parameters(), *mixer.parameters(), *_copy_of(mixer)]
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in weights]


def _copy_of(mixer) -> list[torch.Tensor]:
    """A learned mixer's momentum copy's parameters (AutoMix's: an EMA of the model's, whole on each rank
    under FSDP), compared too."""
    copied = getattr(mixer, "momentum_model", None)
    return [] if copied is None else list(copied.parameters())


def replayed(method: Method) -> list[torch.Tensor]:
    """Both ranks' batches in one process, the gradients averaged."""
    net = model(method.kind)
    x, y, mixer, stream = hand_setup(method, n=STEPS * BATCH * WORLD)
    loss_of = criterion(method.kind)
    mixer.average_over_ranks = False  # (rank 0 replays alone: its Mix Block's gradients averaged below)
    hooks = method.hooks("")
    with mixhook.attach(net, *hooks, mixer):
        params = [*net.parameters(), *mixer.parameters()]  # (the Mix Block's averaged too, as DDP's)
        opt = torch.optim.SGD(params, lr=LR)
        for step in range(STEPS):
            grads, count = [], getattr(mixer, "iteration", None)
            for rank in range(WORLD):
                if count is not None:  # (a mixer that counts its training forwards, AdAutoMix's turns: each
                    mixer.iteration = count  # rank counts its own, one per step here)
                hand_step(mixer, stream, net, *shard(step, rank, x, y), loss_of, rank, step, hooks=hooks)
                grads.append([p.grad.clone() for p in params])
                opt.zero_grad()
            for p, *gs in zip(params, *grads, strict=True):
                p.grad = sum(gs) / WORLD
            opt.step()
            opt.zero_grad()
    return [p.detach() for p in [*params, *_copy_of(mixer)]]


def cell(method: Method, mode: str, rank: int) -> tuple[str, str]:
    lm = method.kind == "lm"  # (a hook with a loss of its own: harness/matrix/language.py)
    try:
        weights = language.distributed(method, mode, rank, WORLD) if lm else trained(method, mode, rank)
    except (TypeError, ValueError, RuntimeError) as error:
        text = str(error)
        if text and "\n" not in text.strip():
            return "refused", f"{type(error).__name__}: {text}"
        return "fails", f"{type(error).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"
    if rank != 0:
        return "", ""
    expected = language.replayed(method, WORLD) if lm else replayed(method)
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(weights, expected, strict=True))
    if diff <= TOLERANCE:
        return "exact", f"{diff:.1e}"
    return "fails", f"differs from the replay by {diff:.2e}"


def cells(names: list[str], modes: tuple[str, ...]) -> dict:
    """The cells of ``names`` under ``modes``, in the process group already joined: ``{name: {mode:
    (outcome, detail)}}`` (rank 0's judgement)."""
    rank, found = dist.get_rank(), {}
    for name in names:
        for mode in modes:
            outcome = cell(BY_NAME.get(name) or language.BY_NAME[name], mode, rank)
            found.setdefault(name, {})[mode] = outcome
            dist.barrier()
    return found


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out, names = sys.argv[1], sys.argv[2:]
    modes = ("ddp", "fsdp")
    if names and names[0].startswith("--modes="):
        modes, names = tuple(names[0].removeprefix("--modes=").split(",")), names[1:]
    cells_found = cells(names, modes)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(cells_found, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    from harness.processes import end_without_finalizing

    end_without_finalizing()


if __name__ == "__main__":
    main()

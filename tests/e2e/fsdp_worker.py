"""Run by test_distributed.py under torchrun (2 processes, gloo): ManifoldMixup on a model sharded by FSDP2
(``fully_shard`` on each block, then on the root), and by FSDP1 (``FullyShardedDataParallel`` wrapping each
Linear, then the root; ``use_orig_params`` both ways), equals, in float64, one process replaying each rank's
batch with the blend written by hand: every rank's logits and loss, and the gradients FSDP reduces
(the mean over the ranks of each rank's gradient), for partners from each rank's own batch
(``partners="local"``) and from the global batch (``partners="global"``).

Each rank holds 4 of the same 8 samples and its own mixer stream; over several steps with prob < 1 and
three layers, rank 0 gathers what every rank mixed and writes the largest differences to argv[1]."""

import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # (run as a script) the repository's root

from harness.processes import end_without_finalizing  # noqa: E402
from mixhook import GradClip, GradScale, InputScale, ManifoldMixup, NoisyFeatureMixup  # noqa: E402
from tests.helpers import per_sample_ce  # noqa: E402


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def gathered(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous())
    return out


def shard(model: nn.Module) -> None:
    """FSDP2 as the tests shard: each module with parameters of its own, then the root."""
    for block in model.children():
        if any(True for _ in block.parameters()):
            fully_shard(block)
    fully_shard(model)


def wrap_fsdp1(model: nn.Module, use_orig_params: bool) -> FullyShardedDataParallel:
    """FSDP1 as a user wraps with it: each Linear its own unit (auto-wrapped), then the root."""
    policy = ModuleWrapPolicy({nn.Linear})
    device = torch.device("cpu")
    return FullyShardedDataParallel(
        model, auto_wrap_policy=policy, use_orig_params=use_orig_params, device_id=device
    )


def fsdp1_grads(module: FullyShardedDataParallel, use_orig_params: bool) -> list[torch.Tensor]:
    """The gradients FSDP1 reduced, each of its parameter's full shape: unsharded with the parameters where
    it can (``use_orig_params=True``); else read from an SGD step of rate 1 (each flat shard less its reduced
    gradient: the full parameters before less after), then the parameters put back as they were."""
    if use_orig_params:
        with FullyShardedDataParallel.summon_full_params(module, with_grads=True):
            return [p.grad.detach().clone() for p in module.parameters()]
    with FullyShardedDataParallel.summon_full_params(module):
        before = [p.detach().clone() for p in module.parameters()]
    torch.optim.SGD(module.parameters(), lr=1.0).step()
    with FullyShardedDataParallel.summon_full_params(module, writeback=True), torch.no_grad():
        grads = [b - p for b, p in zip(before, module.parameters(), strict=True)]
        for b, p in zip(before, module.parameters(), strict=True):
            p.copy_(b)
    return grads


def note(worst: dict, key: str, measured, expected) -> None:
    """Keep the largest absolute difference seen for ``key``."""
    worst[key] = max(worst[key], float((torch.as_tensor(measured) - torch.as_tensor(expected)).abs().max()))


class Step(NamedTuple):
    """One training step of a mixing model, and what every rank did in it, gathered in rank order."""

    last: object  # this rank's MixState, or None
    codes: list  # each rank's mixed layer's position in mix.layers (-1: none)
    logits: list
    losses: list
    lams: list  # each rank's lam per sample (zeros where it did not mix)
    indices: list  # each rank's partner index (zeros where it did not mix)


def mixed_step(module, mix, local_x, local_y, world: int) -> Step:
    """``mix.loss`` of ``module(local_x)`` (the per-sample criterion, averaged) and its backward."""
    n = local_x.shape[0]
    module.zero_grad()
    logits = module(local_x)
    loss = mix.loss(per_sample_ce, logits, local_y).mean()
    loss.backward()
    last = mix.last
    code = torch.tensor([-1 if last is None else mix.layers.index(last.layer)])
    lam = (torch.zeros(n, dtype=torch.double) if last is None else last.lam.expand(n)).contiguous()
    index = torch.zeros(n, dtype=torch.int64) if last is None else last.index
    gather = [gathered(t, world) for t in (code, logits.detach(), loss.detach().reshape(1), lam, index)]
    return Step(last, *gather)


def compare(worst: dict, all_logits: list, all_losses: list, replays: list, grads: list, reference) -> None:
    """Each rank's logits and loss against its replay ``(h, lr)`` in one process, and the gradients FSDP
    reduced against those of the replays' mean (FSDP averages the ranks' gradients)."""
    total = 0.0
    for r, (h, lr) in enumerate(replays):
        note(worst, "logits", all_logits[r], h.detach())
        note(worst, "loss", all_losses[r], lr.detach().reshape(1))
        total = total + lr / len(replays)
    total.backward()
    for g, q in zip(grads, reference.parameters(), strict=True):
        note(worst, "grad", g, q.grad)


def replay(reference, x, layer, lam, index, partners_x=None):
    """``reference``'s forward of ``x`` with the mix at ``layer`` written by hand: ``lam * h + (1 - lam) *
    partner`` where the partners are rows ``index`` of ``partners_x``'s activations (default: ``x``'s)."""
    w = lam.view(-1, 1)
    source = x if partners_x is None else partners_x
    h, g = x, source
    if layer == "input":
        h = w * h + (1 - w) * g[index]
    for i, module in enumerate(reference):
        h, g = module(h), module(g) if partners_x is not None else None
        if str(i) == layer:
            h = w * h + (1 - w) * (g if partners_x is not None else h)[index]
    return h


def run(
    partners: str, rank: int, world: int, x, y, fsdp1: bool | None = None, compiled: bool = False
) -> dict:
    """FSDP2, or with ``fsdp1`` FSDP1 with ``use_orig_params=fsdp1`` (the mixer attached before wrapping, as
    before sharding); FSDP2 ``compiled`` by ``torch.compile`` (its graphs broken at FSDP2's hooks, which
    call ``torch._dynamo.disable``: :func:`fullgraph_refusal`)."""
    model, reference = net(), net()
    n = 8 // world
    local_x, local_y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
    mix = ManifoldMixup(
        ["input", "1", "3"],
        alpha=1.0,
        prob=0.7,
        partners=partners,
        generator=torch.Generator().manual_seed(10 + rank),
    )
    mix.attach(model)
    if compiled:  # (a clean cache: what is counted below is this model's graphs)
        torch._dynamo.reset()
        counters.clear()
    if fsdp1 is None:
        shard(model)  # the unit: each layer with parameters, then the root
        module = torch.compile(model) if compiled else model
    else:
        module = wrap_fsdp1(model, use_orig_params=fsdp1)
    worst = {"logits": 0.0, "loss": 0.0, "grad": 0.0}
    mixed_steps, layers = 0, set()
    for _ in range(10):
        last, codes, all_logits, all_losses, lams, indices = mixed_step(module, mix, local_x, local_y, world)
        if fsdp1 is None:
            grads = [p.grad.full_tensor() for p in model.parameters()]  # (DTensor: gathered from every rank)
        else:
            grads = fsdp1_grads(module, use_orig_params=fsdp1)
        if partners == "global":  # every rank follows rank 0's decision
            assert len({int(c) for c in codes}) == 1, codes
        if last is not None:
            mixed_steps += 1
            layers.add(last.layer)
        if rank != 0:
            continue
        if partners == "global" and last is not None:  # one permutation of the global batch
            assert sorted(torch.cat(indices).tolist()) == list(range(8)), indices
        reference.zero_grad()
        replays = []  # each rank's batch replayed in one process: (logits, loss)
        for r in range(world):
            xr, yr = x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]
            k = int(codes[r])
            if k < 0:
                h = reference(xr)
                lr = per_sample_ce(h, yr).mean()
            else:
                layer = mix.layers[k]
                source = x if partners == "global" else None
                h = replay(reference, xr, layer, lams[r], indices[r], source)
                y_partner = (y if partners == "global" else yr)[indices[r]]
                lr = (lams[r] * per_sample_ce(h, yr) + (1 - lams[r]) * per_sample_ce(h, y_partner)).mean()
            replays.append((h, lr))
        compare(worst, all_logits, all_losses, replays, grads, reference)
    found = {"worst": worst, "mixed_steps": mixed_steps, "layers": sorted(layers)}
    if compiled:  # the graphs inductor compiled (a compile past dynamo's recompile limit runs eagerly)
        found["graphs"] = counters["stats"]["unique_graphs"]
    return found


def fullgraph_refusal(rank: int, world: int, x) -> str:
    """What ``torch.compile(fullgraph=True)`` of an FSDP2 model with a mixer says at its first forward: torch
    refuses (FSDP2's hooks call ``torch._dynamo.disable``, a graph break; pytorch/pytorch#181924's
    custom-op hooks, which would make one graph, are not in torch), before anything is mixed."""
    model = net()
    ManifoldMixup("1", generator=torch.Generator().manual_seed(50 + rank)).attach(model)
    shard(model)
    # (dynamo's caches from the scenarios before: with the same code compiled past its recompile limit,
    # a new fullgraph compile runs it eagerly, saying nothing but a warning)
    torch._dynamo.reset()
    try:
        torch.compile(model, fullgraph=True)(x[: 8 // world])
    except Exception as err:  # (torch's own: torch._dynamo.exc.Unsupported)
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return "compiled"


class Checkpointed(nn.Module):
    """A Linear, a block recomputed in backward (activation checkpointing, non-reentrant), the head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.double()

    def forward(self, x, recompute: bool = True):
        h = self.stem(x)
        h = checkpoint(self.block, h, use_reentrant=False) if recompute else self.block(h)
        return self.head(h)


def run_checkpointed(rank: int, world: int, x, y) -> dict:
    """Manifold Mixup inside an activation-checkpointed block of an FSDP2 model: the recomputation in
    backward replays each rank's mix, so the reduced gradients equal one process replaying each rank's
    batch without checkpointing."""
    model, reference = Checkpointed(), Checkpointed()
    n = 8 // world
    local_x, local_y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
    mix = ManifoldMixup(
        ["block.0", "block.2"], alpha=1.0, prob=0.8, generator=torch.Generator().manual_seed(20 + rank)
    )
    mix.attach(model)
    for module in (model.stem, model.block[1], model.head, model):
        fully_shard(module)
    worst = {"logits": 0.0, "loss": 0.0, "grad": 0.0}
    mixed_steps, layers = 0, set()
    for _ in range(8):
        last, codes, all_logits, all_losses, lams, indices = mixed_step(model, mix, local_x, local_y, world)
        grads = [p.grad.full_tensor() for p in model.parameters()]
        if last is not None:
            mixed_steps += 1
            layers.add(last.layer)
        if rank != 0:
            continue
        reference.zero_grad()
        replays = []  # each rank's batch replayed in one process: (logits, loss)
        for r in range(world):
            xr, yr = x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]
            h = reference.stem(xr)
            k = int(codes[r])
            w, index = lams[r].view(-1, 1), indices[r]
            for i, module in enumerate(reference.block):
                h = module(h)
                if k >= 0 and mix.layers[k] == f"block.{i}":
                    h = w * h + (1 - w) * h[index]
            h = reference.head(h)
            if k < 0:
                lr = per_sample_ce(h, yr).mean()
            else:
                lr = (lams[r] * per_sample_ce(h, yr) + (1 - lams[r]) * per_sample_ce(h, yr[index])).mean()
            replays.append((h, lr))
        compare(worst, all_logits, all_losses, replays, grads, reference)
    return {"worst": worst, "mixed_steps": mixed_steps, "layers": sorted(layers)}


def run_scales(rank: int, world: int, x, y) -> dict:
    """InputScale with per-sample factors at the input of Linear "2" and GradScale (-0.5) at Linear "4" on an
    FSDP2 model: every rank's logits and loss and the reduced gradients equal one process replaying each
    rank's batch with the factors it drew and the gradient scaled by hand."""
    model, reference = net(), net()
    n = 8 // world
    local_x, local_y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
    scale = InputScale("2", factor=(0.5, 1.5), generator=torch.Generator().manual_seed(30 + rank))
    flip = GradScale("4", factor=-0.5)
    scale.attach(model)
    flip.attach(model)
    shard(model)
    worst = {"logits": 0.0, "loss": 0.0, "grad": 0.0}
    for _ in range(4):
        model.zero_grad()
        logits = model(local_x)
        loss = per_sample_ce(logits, local_y).mean()
        loss.backward()
        factors = gathered(scale.last.to(torch.double).reshape(n), world)
        all_logits, all_losses = gathered(logits.detach(), world), gathered(loss.detach().reshape(1), world)
        grads = [p.grad.full_tensor() for p in model.parameters()]
        if rank != 0:
            continue
        reference.zero_grad()
        replays = []  # each rank's batch replayed in one process: (logits, loss)
        for r in range(world):
            xr, yr = x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]
            h = xr
            for i, module in enumerate(reference):
                if i == 2:
                    h = h * factors[r].view(-1, 1)
                if i == 4:  # the value h, the gradient upstream times -0.5
                    h = -0.5 * h + 1.5 * h.detach()
                h = module(h)
            lr = per_sample_ce(h, yr).mean()
            replays.append((h, lr))
        compare(worst, all_logits, all_losses, replays, grads, reference)
    return {"worst": worst, "mixed_steps": 4, "layers": ["2", "4"]}


def run_clip(rank: int, world: int, x, y, max_norm: float = 0.02) -> dict:
    """GradClip at Tanh "3" (each sample's gradient at its output clipped to L2 norm ``max_norm``) on an
    FSDP2 model: each rank clips its own backward's gradient, then FSDP averages the parameters'; the
    reference replays each rank's batch, clips by hand, and averages the same way."""
    model, reference = net(), net()
    n = 8 // world
    local_x, local_y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
    clip = GradClip("3", max_norm=max_norm)
    clip.attach(model)
    shard(model)
    model.zero_grad()
    loss = per_sample_ce(model(local_x), local_y).mean()
    loss.backward()
    clipped = gathered((clip.last_norms > max_norm).sum().reshape(1), world)
    grads = [p.grad.full_tensor() for p in model.parameters()]
    worst = {"grad": 0.0}
    if rank == 0:
        reference.zero_grad()
        for r in range(world):
            h = x[r * n : (r + 1) * n]
            for i, module in enumerate(reference):
                h = module(h)
                if i == 3:
                    h.register_hook(lambda g: g * (max_norm / g.norm(dim=1, keepdim=True)).clamp(max=1.0))
            per_sample_ce(h, y[r * n : (r + 1) * n]).mean().backward()
        for g, q in zip(grads, reference.parameters(), strict=True):
            note(worst, "grad", g, q.grad / world)
    return {"worst": worst, "mixed_steps": int(sum(int(c) for c in clipped)), "layers": ["3"]}


def run_nfm(rank: int, world: int, x, y) -> dict:
    """Noisy Feature Mixup (its draws: the layer, lam, the partners and the noise) on an FSDP2 model:
    each rank's step equals the same mixer, started from that rank's generator state, on the unsharded
    model in one process, and the reduced gradients equal the mean of those processes' gradients."""
    model, reference = net(), net()
    n = 8 // world
    local_x, local_y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
    options = {"alpha": 1.0, "add_noise": 0.4, "mult_noise": 0.2, "prob": 0.9}
    nfm = NoisyFeatureMixup(
        ["input", "1", "3"], generator=torch.Generator().manual_seed(40 + rank), **options
    )
    nfm.attach(model)
    shard(model)
    replayed = NoisyFeatureMixup(["input", "1", "3"], generator=torch.Generator(), **options)
    replayed.attach(reference)
    worst = {"logits": 0.0, "loss": 0.0, "grad": 0.0}
    mixed_steps, layers = 0, set()
    for _ in range(10):
        states = gathered(nfm.generator.get_state(), world)
        model.zero_grad()
        logits = model(local_x)
        loss = nfm.loss(per_sample_ce, logits, local_y).mean()
        loss.backward()
        all_logits, all_losses = gathered(logits.detach(), world), gathered(loss.detach().reshape(1), world)
        grads = [p.grad.full_tensor() for p in model.parameters()]
        if nfm.last is not None:
            mixed_steps += 1
            layers.add(nfm.last.layer)
        if rank != 0:
            continue
        reference.zero_grad()
        replays = []  # each rank's batch replayed in one process: (logits, loss)
        for r in range(world):
            replayed.generator.set_state(states[r])
            h = reference(x[r * n : (r + 1) * n])
            lr = replayed.loss(per_sample_ce, h, y[r * n : (r + 1) * n]).mean()
            replays.append((h, lr))
        compare(worst, all_logits, all_losses, replays, grads, reference)
    return {"worst": worst, "mixed_steps": mixed_steps, "layers": sorted(layers)}


def run_dcp(rank: int, world: int, x, y, folder: str) -> dict:
    """A sharded checkpoint (torch.distributed.checkpoint) of the model, its optimizer and each rank's mixer
    state under the rank's own key resumes exactly (the losses of the steps after it, bit for bit); the
    mixer states of every rank under one key (one copy kept) are refused on loading, not resumed wrongly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from mixhook.hooks import StateError

    n = 8 // world
    local_x, local_y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]

    def build():
        model = net()
        mix = ManifoldMixup(
            ["input", "1", "3"], alpha=1.0, prob=0.8, generator=torch.Generator().manual_seed(50 + rank)
        )
        mix.attach(model)
        shard(model)
        return model, mix, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def steps(model, mix, opt, k: int) -> list[float]:
        losses = []
        for _ in range(k):
            opt.zero_grad()
            loss = mix.loss(per_sample_ce, model(local_x), local_y).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return losses

    def state(model, mix, opt, key: str) -> dict:
        return {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
            key: mix.state_dict(),
        }

    model, mix, opt = build()
    steps(model, mix, opt, 3)
    dcp.save(state(model, mix, opt, f"mixup_rank{rank}"), checkpoint_id=f"{folder}/own")
    dcp.save(state(model, mix, opt, "mixup"), checkpoint_id=f"{folder}/shared")
    after = steps(model, mix, opt, 4)
    model, mix, opt = build()
    loaded = state(model, mix, opt, f"mixup_rank{rank}")
    dcp.load(loaded, checkpoint_id=f"{folder}/own")
    set_model_state_dict(model, loaded["model"])
    set_optimizer_state_dict(model, opt, loaded["optim"])
    mix.load_state_dict(loaded[f"mixup_rank{rank}"])
    resumed = steps(model, mix, opt, 4)
    shared = state(*build(), "mixup")
    dcp.load(shared, checkpoint_id=f"{folder}/shared")
    try:
        build()[1].load_state_dict(shared["mixup"])
        refused = 0
    except StateError:
        refused = 1
    exact = gathered(torch.tensor([int(after == resumed)]), world)
    refusals = gathered(torch.tensor([refused]), world)
    return {"exact": [int(e) for e in exact], "refused": [int(r) for r in refusals]}


def scenarios(folder: str) -> dict:
    """Every scenario of this file, in the process group already joined (``folder``: where the sharded
    checkpoint goes): what each found."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g, dtype=torch.double), torch.randint(0, 3, (8,), generator=g)
    found = {partners: run(partners, rank, world, x, y) for partners in ("local", "global")}
    for orig in (True, False):
        for partners in ("local", "global"):
            found[f"fsdp1_{'orig' if orig else 'flat'}_{partners}"] = run(partners, rank, world, x, y, orig)
    found["compiled"] = run("local", rank, world, x, y, compiled=True)
    found["fullgraph"] = fullgraph_refusal(rank, world, x)
    found["checkpointed"] = run_checkpointed(rank, world, x, y)
    found["scales"] = run_scales(rank, world, x, y)
    found["clip"] = run_clip(rank, world, x, y)
    found["nfm"] = run_nfm(rank, world, x, y)
    found["dcp"] = run_dcp(rank, world, x, y, folder)
    return found


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    folder = [os.path.dirname(os.path.abspath(out_path))]
    dist.broadcast_object_list(folder)
    found = scenarios(folder[0])
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(found, f)
    dist.barrier()  # (neither rank tears gloo down while the other may still be in its last collective)
    dist.destroy_process_group()
    end_without_finalizing()


if __name__ == "__main__":
    main(sys.argv[1])

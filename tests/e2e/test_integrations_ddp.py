"""The trainer adapters under DDP on CPU with gloo, two processes: Lightning's ddp_spawn (the mixer is
pickled to the workers detached and attached there) and the HuggingFace Trainer under accelerate launch,
each against a one-process replay of both ranks (each rank's own draws from (seed, rank, step), the
gradients combined as DDP combines them)."""

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from mixhook import ManifoldMixup
from mixhook.integrations.draws import reseed
from tests.conftest import ROOT
from tests.helpers import lightning_ddp
from tests.unit.test_integrations_lightning import Lit, MixupCallback, data, integration, trainer
from tests.unit.test_integrations_transformers import BERT_LAYERS, bert

pytestmark = [pytest.mark.slow, pytest.mark.process]  # two processes each


def end_at_exit_without_finalizing(trainer, pl_module, stage) -> None:
    """A Lightning ``setup`` hook: in a worker that ``ddp_spawn`` started, end the process at its exit before
    Python's shutdown (tests/e2e/fsdp_worker.py's ``end_without_finalizing`` says why: gloo's threads can
    outlive it, and the worker aborted, SIGABRT, after its fit had finished). Run before Lightning's own
    exit handler (the last registered runs first), once the worker has handed back its results."""
    import atexit
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        from tests.e2e.fsdp_worker import end_without_finalizing

        atexit.register(end_without_finalizing)


def simulate(model, loader, epochs, seed, ranks):
    """DDP by hand: one replica per rank on its shard (Lightning's DistributedSampler for a training set:
    shuffled with seed 0, set_epoch per epoch), each drawing as that rank, the gradients averaged, one SGD
    step for all."""
    replicas = [copy.deepcopy(model) for _ in ranks]
    mixers = [ManifoldMixup(["0", "2"], alpha=1.0) for _ in ranks]
    handles = [m.attach(r) for m, r in zip(mixers, replicas, strict=True)]
    samplers = [
        DistributedSampler(loader.dataset, len(ranks), r, shuffle=True, seed=0) for r in range(len(ranks))
    ]
    for epoch in range(epochs):
        shards = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            shards.append(list(DataLoader(loader.dataset, loader.batch_size, sampler=sampler)))
        for i, batches in enumerate(zip(*shards, strict=True)):
            grads = []
            for replica, mixer, rank, (x, y) in zip(replicas, mixers, ranks, batches, strict=True):
                reseed(mixer, seed, rank, integration.step_key(epoch, i))
                replica.zero_grad()
                mixer.loss(F.cross_entropy, replica(x), y).backward()
                grads.append([p.grad for p in replica.parameters()])
            with torch.no_grad():
                for replica in replicas:
                    for p, *gs in zip(replica.parameters(), *grads, strict=True):
                        p -= 0.1 * (sum(gs) / len(gs))
    for h in handles:
        h.remove()
    return replicas[0]


@pytest.mark.slow
def test_ddp_spawn_two_processes_draw_per_rank_and_equal_ddp_by_hand():
    loader = data(n=48)
    lit = Lit().double()
    start = copy.deepcopy(lit.net)
    mixer = ManifoldMixup(["net.0", "net.2"], alpha=1.0, generator=torch.Generator().manual_seed(5))
    from lightning.pytorch.callbacks import LambdaCallback

    ends = LambdaCallback(setup=end_at_exit_without_finalizing)
    with lightning_ddp():
        trainer(max_epochs=2, strategy="ddp_spawn", devices=2, callbacks=[MixupCallback(mixer), ends]).fit(
            lit, loader
        )
    expected = simulate(start, loader, 2, 5, ranks=[0, 1])
    for a, b in zip(lit.net.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    # every rank drew its own mixes: both ranks drawing rank 0's would train other weights
    same = simulate(start, loader, 2, 5, ranks=[0, 0])
    assert not torch.allclose(next(same.parameters()), next(lit.net.parameters()))


@pytest.mark.slow
def test_hf_trainer_under_accelerate_two_processes_equals_ddp_by_hand(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on CPU (accelerate's torchrun launcher; the
    Trainer runs on the CPU with gloo by use_cpu=True; `--cpu` takes one process unless MPI runs it): each
    process draws its own mixes from (seed, rank, step)
    and normalizes by the num_items_in_batch of both processes' batches; the trained weights equal a
    one-process replay of the batches each process saw, with each rank's draws, summed."""
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         str(ROOT / "tests" / "e2e" / "hf_accelerate_worker.py"), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert records[0]["world"] == 2
    model = bert()
    model.train()
    mixer = ManifoldMixup(BERT_LAYERS, alpha=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = sorted({step for step, _, _ in records[0]["seen"]})
    drew = []
    with mixer.attach(model):
        for step in steps:
            for rank, record in enumerate(records):
                reseed(mixer, 7, rank, step)
                for (s, labels, n), inputs in zip(record["seen"], record["inputs"], strict=True):
                    if s == step:
                        assert int(n) == sum(
                            int(lab.numel()) for r in records for t, lab, _ in r["seen"] if t == step
                        )
                        out = model(**inputs)
                        mixer.loss(
                            lambda logits, t: F.cross_entropy(logits, t, reduction="sum"), out.logits, labels
                        ).div(n).backward()
                        drew.append((rank, float(mixer.last.lam)))
            opt.step()
            opt.zero_grad()
    trained = torch.load(tmp_path / "model.pt", weights_only=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=0, atol=1e-13)
    assert {lam for rank, lam in drew if rank == 0}.isdisjoint({lam for rank, lam in drew if rank == 1})

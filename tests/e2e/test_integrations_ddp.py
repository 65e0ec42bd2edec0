"""The trainer adapters under DDP on CPU with gloo, two processes: Lightning's ddp_spawn (the mixer is
pickled to the workers detached and attached there) and the HuggingFace Trainer under accelerate launch,
each against a one-process replay of both ranks (each rank's own draws from (seed, rank, step), the
gradients combined as DDP combines them); SFTMix's Trainer mixins (its paired batches and loss) under
accelerate, resumed mid-epoch."""

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
from tests.integrations.test_integrations_lightning import Lit, MixupCallback, data, integration, trainer
from tests.integrations.test_integrations_transformers import BERT_LAYERS, bert

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
    _launch("hf_accelerate_worker.py", tmp_path)
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


def _launch(worker: str, out) -> None:
    """``worker`` under `accelerate launch --multi_gpu --num_processes 2` (CPU, gloo), writing to ``out``."""
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         str(ROOT / "tests" / "e2e" / worker), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_sftmix_in_the_hf_trainer_on_two_processes_pairs_each_ranks_batches_and_resumes_exactly(tmp_path):
    """SFTMixLoss and PairedBatches in the Trainer under accelerate (two processes, two micro-batches a
    step, six steps over two epochs): every micro-batch of every process is half confident rows then half
    unconfident ones, the processes' batches of an epoch are disjoint, and the weights equal a one-process
    replay of the batches each process saw with its own draws (each micro-batch's sums divided by the
    tokens of the step's micro-batches on both processes, times the processes, whose gradients DDP
    averages); resumed from the checkpoint after step 4 (mid-way through
    the second epoch, whose shuffle the resumed processes must set themselves), each
    process draws the uninterrupted run's batches and the weights end the same. The evaluation loss of odd
    batches over both processes is the Trainer's own."""
    from harness.matrix.language import data, model
    from mixhook import SFTMix
    from mixhook.integrations.transformers import HookCallback
    from tests.e2e.sftmix_accelerate_worker import ROWS

    _launch("sftmix_accelerate_worker.py", tmp_path)
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert records[0]["world"] == 2
    losses = records[0]["eval"]  # (odd batches: no pairs to refuse; the tokens' mean over both processes)
    assert losses["sftmix"] == pytest.approx(losses["plain"], rel=1e-6), losses
    rows, flags = data(ROWS)
    index = {tuple(ids.tolist()): i for i, ids in enumerate(rows["input_ids"])}
    epochs: dict = {}
    for rank, record in enumerate(records):
        steps = [step for step, _ in record["whole"]]
        assert steps == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5], steps
        for step, batch in record["whole"]:
            which = [index[tuple(ids.tolist())] for ids in batch["input_ids"]]
            assert [flags[i] for i in which] == [True, True, False, False], (rank, step)
            epochs.setdefault(step // 3, []).extend(which)
        resumed = [(s, b["input_ids"]) for s, b in record["resumed"]]
        assert [s for s, _ in resumed] == [4, 4, 5, 5]
        for (s, ids), (t, batch) in zip(resumed, record["whole"][8:], strict=True):
            assert s == t and torch.equal(ids, batch["input_ids"]), (rank, s)
    for epoch in (0, 1):  # (every row once an epoch: 3 steps x 2 processes x 2 micro-batches x 4 rows)
        assert sorted(epochs[epoch]) == list(range(ROWS)), epoch
    assert epochs[0] != epochs[1]  # (each epoch shuffled anew)

    net, mix = model(), SFTMix("model.norm")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with mix.attach(net):
        for step in range(6):
            grads = []
            micro = [[b for s, b in record["whole"] if s == step] for record in records]
            counts = sum(mix.counts(b["labels"]) for batches in micro for b in batches)  # (the step's)
            for rank, batches in enumerate(micro):
                reseed(mix, 7, rank, step, HookCallback._FIRST_PART)
                for batch in batches:
                    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
                    (mix.loss(net, inputs, counts)[0] * 2).backward()  # (x processes: DDP's mean)
                grads.append([p.grad.clone() for p in net.parameters()])
                opt.zero_grad()
            for p, *gs in zip(net.parameters(), *grads, strict=True):
                p.grad = sum(gs) / 2
            opt.step()
            opt.zero_grad()
    trained = torch.load(tmp_path / "models.pt", weights_only=True)
    for name, p in net.named_parameters():
        torch.testing.assert_close(trained["whole"][name], p.detach(), rtol=0, atol=1e-12, msg=name)
        torch.testing.assert_close(trained["resumed"][name], p.detach(), rtol=0, atol=1e-12, msg=name)
    assert not torch.equal(trained["whole"]["lm_head.weight"], model().lm_head.weight)

"""DDP and FSDP through torchrun: two processes on CPU with gloo, one summary, test metrics over both
ranks' shards, each rank's own mixing stream, and the same metrics again for the same seed through Hydra's
submitit launcher with two tasks; the library under DDP, FSDP2 and FSDP1 against one process replaying each
rank's batch; the matrix's DDP and FSDP2 cells.

Every scenario that runs in one job is run by one torchrun launch of two processes
(tests/e2e/distributed_worker.py, the module fixture :func:`launch`); a launch of its own is kept only where
the launch is what is tested: ``train.py`` under torchrun stopped by SIGTERM and resumed, a job of three
processes refused, submitit's launcher."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from mixhook import ManifoldMixup
from mixhook.app.data import build_data
from mixhook.app.models import PreActResNet18
from mixhook.app.training import checkpoint as ckpt
from mixhook.app.training import evaluate
from mixhook.hooks import rank_seed
from tests.conftest import ROOT
from tests.helpers import SmallCNN

pytestmark = [pytest.mark.slow, pytest.mark.process]  # torchrun

ARGS = [
    "data.train_size=200",
    "trainer.epochs=1",
    "trainer.batch_size=32",
    "trainer.progress_bar=false",
    "seed=2",
    "+model.width=0.25",  # the paper's network a quarter wide: what is tested does not depend on its width
]


def metrics_without_time(run_dir):
    return [
        {k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(open(run_dir / "metrics.csv"))
    ]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes on two cores: one thread each


def command(script, *args, processes: int = 2) -> list[str]:
    """``torchrun --standalone --nproc_per_node=processes script *args``."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    return [*run, str(script), *args]


def torchrun(script, *args, cwd, processes: int = 2, timeout: int = 300):
    """``script`` under torchrun in ``cwd``: the completed process (stdout, stderr, returncode)."""
    return subprocess.run(
        command(script, *args, processes=processes), cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env=ENV,
    )  # fmt: skip


def torchrun_app(out, cwd, *args, processes: int = 2, timeout: int = 300):
    """``train.py *args`` under torchrun, writing to ``out``."""
    return torchrun(
        ROOT / "train.py", *args, f"hydra.run.dir={out}", cwd=cwd, processes=processes, timeout=timeout
    )


COMMON = [  # the app under FSDP and DDP: test_the_app_under_fsdp_trains_as_ddp...
    "data.train_size=240", "data.test_size=0.1997", "trainer.batch_size=8", "trainer.epochs=2",
    "trainer.eval_batch_size=179", "trainer.progress_bar=false", "seed=2", "+model.width=0.25",
    "scheduler=multistep", "scheduler.milestones=[1]",
]  # fmt: skip
# train.py's own launch stopped by SIGTERM: a checkpoint every 3 steps (of a rank's 15 an epoch), the
# first one the sign to stop it, mid-epoch; the launch's runs checkpoint at the ends of epochs only (a
# sharded checkpoint gathers the whole model: one every step made the FSDP run three times as long)
STOPPED = [*COMMON, "trainer.checkpoint_every=3"]
STRATEGIES = {
    "fsdp": ["trainer.strategy=fsdp", "trainer.fsdp_units=[layer1,layer2,layer3,layer4]"],
    "ddp": [],
}
MATRIX = ["SaliencyMix", "SnapMix", "Balanced-MixUp", "TransMix", "RegMixup", "AutoMix", "SFTMix"]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One torchrun launch of two processes running every scenario of this module that runs in one job
    (tests/e2e/distributed_worker.py): the folder it worked in, what rank 0 found for each scenario."""
    folder = tmp_path_factory.mktemp("launch")
    scenarios = [
        {"name": "default_generator", "kind": "default_generator"},  # (first: as near a fresh process)
        {"name": "global_partners", "kind": "global_partners"},
        {"name": "fsdp", "kind": "fsdp"},
        {"name": "matrix", "kind": "matrix", "names": MATRIX, "modes": ["ddp", "fsdp"]},
        {"name": "matrix_late", "kind": "matrix", "names": ["AutoMix"], "modes": ["fsdp_late"]},
        {"name": "app", "kind": "app", "overrides": ARGS, "out_dir": str(folder / "run")},
        *(
            {"name": f"app_{n}", "kind": "app", "overrides": [*COMMON, *extra], "out_dir": str(folder / n)}
            for n, extra in STRATEGIES.items()
        ),
    ]
    plan = folder / "plan.json"
    plan.write_text(
        json.dumps({"out": str(folder / "found.json"), "folder": str(folder), "scenarios": scenarios})
    )
    worker = ROOT / "tests" / "e2e" / "distributed_worker.py"
    result = torchrun(worker, str(plan), cwd=folder, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    found = json.loads((folder / "found.json").read_text())
    assert sorted(found) == sorted(s["name"] for s in scenarios)  # each scenario ran and reported
    return folder, found


@pytest.mark.slow
def test_two_processes_on_cpu_write_one_summary_with_metrics_over_both_ranks(launch, tmp_path):
    folder, found = launch
    out = folder / "run"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["epochs"] == 1 and found["app"] == summary["test_acc"]
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert len(rows) == 1 and float(rows[0]["test_acc"]) == summary["test_acc"]
    # (that rank 0 alone reports and that train.py's ranks write nothing beside the run directory:
    # test_the_app_under_fsdp_trains_as_ddp..., on train.py's own launch)

    # the reduced test metrics are the whole test set's: evaluate the saved model on one process
    state = ckpt.load(out / "last.pt")
    model = PreActResNet18(in_channels=1, num_classes=10, width=0.25)
    model.load_state_dict(state["model"])
    data = build_data("digits", batch_size=32, seed=2, train_size=200, num_workers=0)
    found = evaluate(model, data.test, torch.device("cpu"))
    nll, acc, calibration = found.nll, found.acc, found.calibration
    assert acc == summary["test_acc"] and abs(nll - summary["test_nll"]) < 1e-6
    assert calibration.table()["count"] == summary["calibration"]["count"]  # the ranks' bins summed
    assert abs(calibration.ece() - summary["test_ece"]) < 1e-9
    assert list(found.per_class) == pytest.approx(summary["test_class_acc"])  # the ranks' classes summed
    assert found.balanced_acc == pytest.approx(summary["test_balanced_acc"])

    # each rank mixed with its own stream, and both are in the checkpoint
    ranks = state["random"]
    assert len(ranks) == 2 and not torch.equal(
        ranks[0]["hooks"]["0.generator"], ranks[1]["hooks"]["0.generator"]
    )

    # the same job through Hydra's submitit launcher with two tasks (the SLURM path, on submitit's local
    # executor) trains the same: same seed, same ranks, same metrics
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=submitit_local",
         "hydra.launcher.tasks_per_node=2", *ARGS, f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=ENV,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((sweep / "0" / "summary.json").read_text())["processes"] == 2
    assert metrics_without_time(out) == metrics_without_time(sweep / "0")


def interrupted(out, cwd, *args):
    """``torchrun_app`` stopped by SIGTERM a few steps after its first checkpoint (each rank finishes its
    step, rank 0 writes the checkpoint), then resumed in its directory; the checkpoint it stopped at, and the
    resumed launch (its stdout, stderr and status)."""
    proc = subprocess.Popen(
        command(ROOT / "train.py", *args, f"hydra.run.dir={out}"),
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    deadline = time.time() + 120
    while not (out / "last.pt").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert "stopped by SIGTERM" in stderr, stderr[-3000:]
    state = ckpt.load(out / "last.pt")
    resumed = torchrun_app(out, cwd, *args, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return state, resumed


@pytest.mark.slow
def test_the_app_under_fsdp_trains_as_ddp_resumes_exactly_and_refuses_another_world_size(launch, tmp_path):
    """trainer.strategy=fsdp (the residual stages sharded one by one, then the model) under torchrun (gloo,
    2 processes): the same metrics as DDP, bit for bit (both average the two ranks' gradients, and each
    forward starts from rank 0's batch-norm buffers); ``train.py`` under torchrun stopped by SIGTERM in the
    middle of an epoch and resumed from its checkpoint ends identical to the run that was not stopped (each
    rank's running sums of the part-done epoch kept as its own), rank 0 alone reporting and nothing written
    beside the run directory; the checkpoint holds the whole model (one process evaluating it gets the run's
    test metrics, over a test set whose ranks' shards differ by a batch: 180 and 179 samples, 179 per batch);
    resumed by 3 processes, refused in one line."""
    folder, _ = launch
    rows = metrics_without_time(folder / "fsdp")
    assert len(rows) == 2 and rows == metrics_without_time(folder / "ddp")
    # (the running sums are kept per rank by the code both strategies share: the sharded run stands for both)
    own = tmp_path / "user"  # train.py's own launch, in a directory of its own
    own.mkdir()
    state, resumed = interrupted(own / "stopped", own, *STOPPED, *STRATEGIES["fsdp"])
    assert state["epoch"] == 0 and state["step"] > 0, (state["epoch"], state["step"])  # mid-epoch
    assert metrics_without_time(own / "stopped") == rows
    assert (resumed.stdout + resumed.stderr).count("epoch 2/2  train_loss") == 1  # rank 0 reports
    assert [p.name for p in own.iterdir()] == ["stopped"]

    summary = json.loads((folder / "fsdp" / "summary.json").read_text())
    assert (
        summary["strategy"] == "fsdp"
        and json.loads((folder / "ddp" / "summary.json").read_text())["strategy"] == "ddp"
    )
    state = ckpt.load(folder / "fsdp" / "last.pt")
    model = PreActResNet18(in_channels=1, num_classes=10, width=0.25)
    model.load_state_dict(state["model"])
    data = build_data("digits", batch_size=8, seed=2, train_size=240, test_size=0.1997, num_workers=0)
    nll, acc = evaluate(model, data.test, torch.device("cpu"))[:2]
    assert (
        len(data.test.dataset) == 359 and acc == summary["test_acc"] and abs(nll - summary["test_nll"]) < 1e-6
    )

    resume = f"trainer.resume={folder / 'fsdp' / 'last.pt'}"
    wider = torchrun_app(tmp_path / "wider", tmp_path, *COMMON, *STRATEGIES["fsdp"], resume, processes=3)
    assert wider.returncode != 0
    assert "the checkpoint was written by 2 process(es), this run has 3" in wider.stderr


def test_under_torch_distributed_a_default_generator_draws_per_rank(launch):
    """(tests/core/test_state.py's per-rank streams, in a job of two processes: the launch's scenario
    ``default_generator``, tests/e2e/distributed_worker.py.)"""
    _, found = launch
    ((default_0, given_0), done_0), ((default_1, given_1), done_1) = found["default_generator"]
    assert default_0 != default_1  # per rank
    assert given_0 == given_1  # the generator the user gave: what it draws
    assert not done_0 and not done_1  # reseeded once, at the first training forward
    torch.manual_seed(0)
    single = ManifoldMixup("conv1")  # rank 0 draws what a single process draws
    with single.attach(SmallCNN().train()) as _:
        single.model(torch.randn(8, 3, 6, 6))
    assert default_0 == [float(single.last.lam), single.last.index.tolist()]  # (as JSON keeps it: a list)
    assert rank_seed(7, 0) == 7 and rank_seed(7, 1) != 7


def test_global_partners_in_ddp_equal_one_process_mixing_the_global_batch(launch):
    """ManifoldMixup(partners="global") under torchrun (gloo, 2 processes, DDP): over 12 steps with
    prob 0.7 at three layers, each rank with its own stream, the ranks follow rank 0's decisions, the
    partners are one permutation of the global batch, and logits, losses, targets and DDP gradients
    equal one process mixing the whole batch by hand (float64)."""
    found = launch[1]["global_partners"]  # (global_partners_worker.py)
    assert found["mixed_steps"] >= 5 and found["layers"] == ["1", "3", "input"]
    worst = found["worst"]
    assert all(value < 1e-12 for value in worst.values()), worst


def test_manifold_mixup_under_fsdp_equals_one_process_replaying_each_ranks_batch(launch):
    """FSDP2 (``fully_shard`` on each Linear, then on the root) under torchrun (gloo, 2 processes): over
    10 steps with prob 0.7 at three layers, with partners from each rank's batch and from the global
    batch, every rank's logits and loss and the gradients FSDP reduces equal one process replaying each
    rank's batch with the blend written by hand (float64); and so with the mix inside a block that
    activation checkpointing recomputes in backward (the replay of each rank's mix); and InputScale with
    per-sample factors, GradScale and GradClip (each rank clips its own gradient) on the sharded model; and
    NoisyFeatureMixup equal to itself on the unsharded model from each rank's generator state; and FSDP1
    (each Linear wrapped, then the root; ``use_orig_params`` True and False) for both partner modes; and the
    FSDP2 model under ``torch.compile`` (its graphs broken at FSDP2's hooks), while ``fullgraph=True`` is
    refused by torch itself at the first forward (FSDP2's hooks call ``torch._dynamo.disable``)."""
    found = launch[1]["fsdp"]  # (fsdp_worker.py)
    # a sharded checkpoint with each rank's mixer state under its own key resumes exactly on every rank; the
    # states under one key (one copy kept) are refused where a rank would get another's stream
    assert found["dcp"]["exact"] == [1, 1] and any(found["dcp"]["refused"]), found["dcp"]
    fsdp1 = [f"fsdp1_{params}_{partners}" for params in ("orig", "flat") for partners in ("local", "global")]
    assert "torch._dynamo.disable" in found["fullgraph"], found["fullgraph"]
    assert found["compiled"]["graphs"] >= 2, found["compiled"]  # (compiled, not run eagerly past a limit)
    for partners in ("local", "global", "compiled", "checkpointed", "scales", "clip", "nfm", *fsdp1):
        run = found[partners]  # (for clip, mixed_steps counts the samples whose gradient was clipped)
        assert run["mixed_steps"] >= 4 and len(run["layers"]) >= (1 if partners == "clip" else 2), run
        assert all(value < 1e-12 for value in run["worst"].values()), (partners, run["worst"])


@pytest.mark.slow
def test_ddp_and_fsdp_equal_one_process_replaying_each_ranks_batch(launch):
    """The matrix's DDP and FSDP2 cells (harness/matrix/distributed.py) of a sample of methods: each the
    methods that need what a data-parallel job must give them (a policy's gradient pass, the labels before
    the forward, a partner batch, a ViT's grid, the clean batch, a learned mixer, a language model's hook
    with a loss of its own: SFTMix's pairs and its mixed rows after the clean ones)."""
    cells = launch[1]["matrix"]
    assert {(n, m): cells[n][m][0] for n in MATRIX for m in ("ddp", "fsdp")} == {
        (n, m): "exact" for n in MATRIX for m in ("ddp", "fsdp")
    }, cells


@pytest.mark.slow
def test_a_momentum_copy_attached_before_fsdp_follows_the_shards(launch):
    """AutoMix attached before ``fully_shard`` of the root alone (the app's and Lightning's order): its
    copy, made whole at attach, follows the shards the optimizer steps, which the root's forward replaces
    by the gathered parameters while it runs; equal to one process replaying each rank's batch."""
    cells = launch[1]["matrix_late"]
    assert cells["AutoMix"]["fsdp_late"][0] == "exact", cells

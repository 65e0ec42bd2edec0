"""Nothing lost: exact resume after SIGKILL and SIGTERM, safe checkpoint loading, non-finite losses.

The runs are real `train.py` processes on a small digits problem, killed with real signals."""

import json
import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from harness.app_runs import config, results, run_app
from mixhook.app import run as app
from mixhook.app.training import checkpoint as ckpt
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # each trains through the app, most of them in train.py

COSINE = [  # the default schedule: cosine over trainer.epochs; the paper's network a quarter wide (what is
    # tested, exact resume and safe loading, does not depend on its width, and its runs take seconds)
    "data.train_size=200", "trainer.epochs=4", "trainer.batch_size=32", "trainer.checkpoint_every=1",
    "trainer.progress_bar=false", "seed=5", "+model.width=0.25",
]  # fmt: skip
SMALL = [*COSINE, "scheduler=multistep", "scheduler.milestones=[3]"]  # a schedule that does not follow epochs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run the interrupted ones must end identical to: ``train.py`` run in this process (each killed run
    is a process of its own, killed at a random step, and resumed here)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    result = run_app(*SMALL, f"hydra.run.dir={out}", cwd=out.parent)
    assert result.returncode == 0, result.stderr
    assert torch.load(out / "last.pt", weights_only=True)["epoch"] == 4
    return results(out)


STEPS = 4 * 7  # SMALL's run: 4 epochs of 7 steps (200 samples in batches of 32), a checkpoint after each


def at_random():
    """The step to interrupt a run at (or just after): a random one of its first half. A step, not a time:
    how long a run takes on a loaded machine says nothing of how long the next one will."""
    return random.Random(os.getpid()).randint(1, STEPS // 2)


def start(out, *extra):
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *SMALL, *extra, f"hydra.run.dir={out}"],
        cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for_checkpoint(out, proc, step=1):
    """Wait until the run's checkpoint is at ``step`` (counted over its epochs) or later; the run is then
    still running (it has the rest of its steps to go), to be interrupted there."""
    deadline, seen = time.time() + 120, None
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        path = out / "last.pt"
        if path.exists() and path.stat().st_mtime_ns != seen:  # (written whole: atomic_write)
            seen = path.stat().st_mtime_ns
            state = torch.load(path, weights_only=True)
            if state["epoch"] * 7 + state["step"] >= step:
                return
        time.sleep(0.01)


@pytest.mark.process
def test_sigkill_at_a_random_step_then_resume_by_path_or_auto_ends_identical(tmp_path, uninterrupted, caplog):
    out = tmp_path / "run"
    proc = start(out)
    wait_for_checkpoint(out, proc, at_random())
    proc.kill()
    proc.wait()
    state = torch.load(out / "last.pt", weights_only=True)
    assert not (out / "summary.json").exists() and state["epoch"] * 7 + state["step"] >= 1
    # the killed run's checkpoint, continued in another directory by path (in this process: the same
    # code as train.py's after Hydra composed the config, and a check that both give the same results) ...
    other = tmp_path / "other"
    app.main(config(*SMALL, f"trainer.resume={out / 'last.pt'}"), out_dir=str(other))
    assert results(other) == uninterrupted
    # ... and in its own directory with resume=auto
    with caplog.at_level(logging.INFO, logger="mixhook"):
        app.main(config(*SMALL, "trainer.resume=auto"), out_dir=str(out))
    assert "resuming after epoch" in caplog.text
    assert results(out) == uninterrupted


@pytest.mark.process
def test_sigterm_finishes_the_step_writes_the_checkpoint_and_exits_non_zero(tmp_path, uninterrupted):
    out = tmp_path / "run"
    proc = start(out)
    wait_for_checkpoint(out, proc, STEPS // 4)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    lines = stderr.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("stopped by SIGTERM ") and "trainer.resume=auto" in lines[0]
    )
    state = ckpt.load(out / "last.pt")
    assert not (out / "summary.json").exists()
    assert f"after step {state['step']}" in lines[0] or f"end of epoch {state['epoch']}" in lines[0]
    app.main(config(*SMALL, "trainer.resume=auto"), out_dir=str(out))
    assert results(out) == uninterrupted


class RunsCode:
    """Unpickling this runs code (what a crafted checkpoint does)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def refused(tmp_path, resume, capsys, run_dir=None, extra=()):
    out = run_dir or tmp_path / "run"
    cfg = config(*SMALL, *extra, f"trainer.resume={resume}")
    with pytest.raises(SystemExit) as info:
        app.main(cfg, out_dir=str(out))
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: trainer.resume: ")
    assert not (out / "metrics.csv").exists() and not (out / "summary.json").exists()
    return lines[0]


def test_a_crafted_checkpoint_is_refused_without_running_its_code(tmp_path, capsys):
    evil = tmp_path / "evil.pt"
    torch.save({"format": ckpt.FORMAT, "version": ckpt.VERSION, "model": RunsCode(tmp_path / "ran")}, evil)
    line = refused(tmp_path, evil, capsys)
    assert "is not a mixhook checkpoint: it holds objects that weights-only loading refuses" in line
    assert not (tmp_path / "ran").exists()
    torch.load(evil, weights_only=False)  # the file really is harmful when loaded unsafely
    assert (tmp_path / "ran").read_text() == "ran"


def test_foreign_truncated_and_missing_files_are_refused_in_one_line(tmp_path, capsys):
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    assert "is not a mixhook checkpoint (no 'mixhook-checkpoint' marker)" in refused(
        tmp_path, foreign, capsys
    )
    real = tmp_path / "real.pt"
    ckpt.save(real, {"model": {"w": torch.zeros(1000)}})
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(real.read_bytes()[: real.stat().st_size // 2])
    assert "cannot be read as a checkpoint (truncated or corrupt" in refused(tmp_path, truncated, capsys)
    assert "no checkpoint at" in refused(tmp_path, tmp_path / "nowhere.pt", capsys)


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path):
    path = tmp_path / "last.pt"
    ckpt.save(path, {"model": {"w": torch.zeros(3)}})
    before = path.read_bytes()
    with pytest.raises((pickle.PicklingError, AttributeError)):  # a local lambda cannot be pickled
        ckpt.save(path, {"model": {"w": torch.ones(3)}, "bad": lambda: None})
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    assert torch.equal(ckpt.load(path)["model"]["w"], torch.zeros(3))


def test_resume_auto_with_a_corrupt_checkpoint_leaves_it_untouched(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "last.pt").write_bytes(b"PK\x03\x04 not really a zip")
    refused(tmp_path, "auto", capsys, run_dir=out)
    assert (out / "last.pt").read_bytes() == b"PK\x03\x04 not really a zip"


def test_resuming_with_other_settings_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert app.main(config(*SMALL, "trainer.epochs=1"), out_dir=str(out)) > 0
    cfg = config(*SMALL, "trainer.epochs=1", "mixup.alpha=0.5", "trainer.resume=auto")
    with pytest.raises(SystemExit):
        app.main(cfg, out_dir=str(out))
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: trainer.resume: {out / 'last.pt'}: written with mixup.alpha=2.0, this run has "
        "mixup.alpha=0.5; resume with the checkpoint's settings"
    )


def test_extending_a_finished_run_equals_training_that_long_from_the_start(tmp_path, uninterrupted):
    extended = tmp_path / "extended"
    app.main(config(*SMALL, "trainer.epochs=2"), out_dir=str(extended))
    assert json.loads((extended / "summary.json").read_text())["epochs"] == 2
    app.main(config(*SMALL, "trainer.resume=auto"), out_dir=str(extended))  # 4 epochs
    assert results(extended) == uninterrupted
    assert [int(r["epoch"]) for r in results(extended)[0]] == [1, 2, 3, 4]


def test_extending_is_refused_where_the_schedule_would_change_or_epochs_shrink(tmp_path, capsys):
    out = tmp_path / "run"
    app.main(config(*COSINE, "trainer.epochs=2"), out_dir=str(out))  # cosine, T_max = 2
    before = (out / "last.pt").read_bytes(), (out / "summary.json").read_text()
    for epochs, line in (
        (4, "extending the run from 2 to 4 epochs would change scheduler.T_max from 2 to 4, a schedule "
            "the 2 epochs already trained did not follow: extend a run whose schedule does not follow "
            "trainer.epochs (scheduler=constant or multistep), or train 4 epochs from the start"),
        (1, "2 epochs trained, more than trainer.epochs=1"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            app.main(config(*COSINE, f"trainer.epochs={epochs}", "trainer.resume=auto"), out_dir=str(out))
        assert info.value.code == 2
        assert capsys.readouterr().err.strip() == f"error: trainer.resume: {out / 'last.pt'}: {line}"
    assert ((out / "last.pt").read_bytes(), (out / "summary.json").read_text()) == before


def test_a_fresh_run_does_not_overwrite_a_run_directory_with_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    app.main(config(*SMALL, "trainer.epochs=1"), out_dir=str(out))
    before = (out / "last.pt").read_bytes(), (out / "summary.json").read_text()
    with pytest.raises(SystemExit):
        app.main(config(*SMALL, "trainer.epochs=1"), out_dir=str(out))
    assert (
        "already holds a checkpoint (last.pt); continue it with trainer.resume=auto"
        in capsys.readouterr().err
    )
    assert ((out / "last.pt").read_bytes(), (out / "summary.json").read_text()) == before


def test_resume_auto_of_a_finished_run_rewrites_the_same_summary(tmp_path):
    out = tmp_path / "run"
    app.main(config(*SMALL, "trainer.epochs=1"), out_dir=str(out))
    first = results(out)
    app.main(config(*SMALL, "trainer.epochs=1", "trainer.resume=auto"), out_dir=str(out))
    assert results(out) == first


@pytest.mark.parametrize(
    "lazily",
    [[], ["trainer.check_finite_every=4", "+optim.fused=true"]],
    ids=["read every step", "read from the device before each checkpoint"],
)
def test_a_nan_names_the_step_and_the_first_non_finite_layer_and_keeps_the_last_checkpoint(
    tmp_path, capsys, lazily
):
    out = tmp_path / "run"
    hook = "hooks=[{_target_: tests.toy_models.NanAt, layer: layer1.0.conv2, step: 3}]"
    allow = "allow_targets=[tests.toy_models.*]"
    with pytest.raises(SystemExit) as info:
        app.main(config(*SMALL, hook, allow, *lazily), out_dir=str(out))
    assert info.value.code == 3
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: epoch 1, step 3: the loss became nan; first non-finite layer output: "
        f"layer1.0.conv2 (Conv2d); the last good checkpoint is {out / 'last.pt'}"
    )
    state = ckpt.load(out / "last.pt")
    assert (state["epoch"], state["step"]) == (0, 2) and not (out / "summary.json").exists()
    assert all(bool(torch.isfinite(t).all()) for t in state["model"].values() if t.is_floating_point())


def test_a_lazily_read_nan_is_named_at_the_next_read_and_nothing_is_saved(tmp_path, capsys):
    """Read every 4 steps, with no checkpoint inside the epoch: the NaN of step 3 is found at step 4,
    and the run stops there naming step 3, with no checkpoint written."""
    out = tmp_path / "run"
    hook = "hooks=[{_target_: tests.toy_models.NanAt, layer: layer1.0.conv2, step: 3}]"
    allow = "allow_targets=[tests.toy_models.*]"
    lazily = ["trainer.check_finite_every=4", "+optim.fused=true", "trainer.checkpoint_every=0"]
    with pytest.raises(SystemExit) as info:
        app.main(config(*SMALL, hook, allow, *lazily), out_dir=str(out))
    assert info.value.code == 3
    assert capsys.readouterr().err.strip() == (
        "error: epoch 1, step 3: the loss became nan; first non-finite layer output: "
        "layer1.0.conv2 (Conv2d); no checkpoint yet"
    )
    assert not (out / "last.pt").exists() and not (out / "summary.json").exists()


def test_every_random_stream_is_restored():
    import numpy as np

    from mixhook import ManifoldMixup, OneOf

    hooks = [OneOf([ManifoldMixup("input"), ManifoldMixup("input")])]
    states = ckpt.random_states(hooks)
    expected = (
        torch.rand(3),
        np.random.rand(3),
        random.random(),
        [torch.rand(2, generator=g) for g in ckpt.hook_generators(hooks).values()],
    )
    ckpt.restore_random_states(states, hooks)
    again = (
        torch.rand(3),
        np.random.rand(3),
        random.random(),
        [torch.rand(2, generator=g) for g in ckpt.hook_generators(hooks).values()],
    )
    assert sorted(ckpt.hook_generators(hooks)) == [
        "0.generator",
        "0.mixers.0.generator",
        "0.mixers.1.generator",
    ]
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).train()
    with hooks[0].attach(model):
        model(torch.randn(4, 3))  # OneOf.chosen now names one of its mixers: still each generator once
    assert sorted(ckpt.hook_generators(hooks)) == sorted(states["hooks"])
    assert (
        torch.equal(expected[0], again[0])
        and np.array_equal(expected[1], again[1])
        and expected[2] == again[2]
    )
    assert all(torch.equal(a, b) for a, b in zip(expected[3], again[3], strict=True))


def test_a_checkpoint_whose_weights_do_not_fit_the_model_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    app.main(config(*SMALL, "trainer.epochs=1"), out_dir=str(out))
    state = ckpt.load(out / "last.pt")
    state["model"].pop("linear.weight")
    ckpt.save(tmp_path / "edited.pt", {k: v for k, v in state.items() if k not in ("format", "version")})
    line = refused(tmp_path, tmp_path / "edited.pt", capsys, tmp_path / "other", ["trainer.epochs=1"])
    assert "the checkpoint's model or optimizer does not fit this run: " in line and "linear.weight" in line


def test_a_checkpoint_of_another_data_split_is_refused_and_summary_json_names_the_split(tmp_path, capsys):
    """summary.json records the split's digest and what the figures depend on (versions, CPU, threads);
    a checkpoint trained on another split (changed data files or split) is not continued."""
    out = tmp_path / "run"
    app.main(config(*SMALL, "trainer.epochs=1"), out_dir=str(out))
    summary = json.loads((out / "summary.json").read_text())
    environment = summary["environment"]
    assert summary["data_split"] == DIGITS_200
    assert {"torch", "torchvision", "numpy", "scikit-learn", "hydra-core"} <= set(environment["versions"])
    assert environment["python"] and environment["cpu"]["threads"] == torch.get_num_threads()
    assert environment["cpu"]["model"] and environment["cpu"]["torch_capability"]
    state = ckpt.load(out / "last.pt")
    assert state["data_split"] == DIGITS_200
    state["data_split"] = "0123456789abcdef"
    ckpt.save(tmp_path / "edited.pt", {k: v for k, v in state.items() if k not in ("format", "version")})
    line = refused(tmp_path, tmp_path / "edited.pt", capsys, tmp_path / "other", ["trainer.epochs=1"])
    assert f"trained on another data split (digest 0123456789abcdef; this run's is {DIGITS_200})" in line


DIGITS_200 = "bb1dcce0280df5f5"  # the digits split of data.train_size=200 (test_data pins the full one)


SCHEDULED = [
    "schedule.off_epoch=3", "schedule.prob={start:0.2,end:1.0,epochs:2}",
    "schedule.alpha={start:0.5,end:2.0,epochs:3,shape:cosine}", "schedule.layer_weights=[1,2,2]",
    "trainer.warmup_epochs=2", "trainer.warmup_start_factor=0.25",
]  # fmt: skip


@pytest.mark.process
def test_a_mix_schedule_and_a_warmup_resume_exactly_after_sigkill(tmp_path, uninterrupted):
    """Ramps move every step, mixing stops after epoch 3 (timm's mixup_off_epoch) and the learning rate
    warms up over two epochs, step by step: a run killed at a random step and resumed ends identical to
    the same schedules uninterrupted."""
    reference = tmp_path / "reference"
    app.main(config(*SMALL, *SCHEDULED), out_dir=str(reference))
    expected = results(reference)
    assert expected[0] != uninterrupted[0]  # the schedules changed the training
    assert expected[1]["schedule"].startswith("MixSchedule(prob=Ramp(start=0.2, end=1.0, epochs=2")
    assert expected[1]["warmup"] == {"epochs": 2, "start_factor": 0.25}
    lrs = [(float(a["lr"]), float(b["lr"])) for a, b in zip(expected[0], uninterrupted[0], strict=True)]
    assert lrs[0][0] == pytest.approx(0.25 * lrs[0][1]) and lrs[1][0] < lrs[1][1] and lrs[2][0] == lrs[2][1]
    out = tmp_path / "run"
    proc = start(out, *SCHEDULED)
    wait_for_checkpoint(out, proc, at_random())
    proc.kill()
    proc.wait()
    assert not (out / "summary.json").exists()
    app.main(config(*SMALL, *SCHEDULED, "trainer.resume=auto"), out_dir=str(out))
    assert results(out) == expected


ERASED = ["erasing=random", "erasing.layer=[input,layer1]", "trainer.eval_every=3"]


@pytest.mark.process
def test_erasing_and_a_test_every_third_epoch_resume_exactly_after_sigkill(tmp_path, uninterrupted):
    """Random Erasing's draws are in the checkpoint (its generator, as every hook's), and trainer.eval_every
    leaves the untested epochs' test columns empty, the best epoch the best of those tested: a run killed at
    a random step and resumed ends identical to the same run uninterrupted."""
    reference = tmp_path / "reference"
    app.main(config(*SMALL, *ERASED), out_dir=str(reference))
    rows, summary = expected = results(reference)
    assert [r["test_acc"] != "" for r in rows] == [False, False, True, True]  # epochs 3 and 4 (the last)
    assert summary["best_epoch"] in (3, 4) and summary["best_test_acc"] == max(
        float(r["test_acc"]) for r in rows[2:]
    )
    assert "RandomErasing(layer=['input', 'layer1'], p=0.5" in summary["hooks"]["erasing"]
    assert rows[0]["train_loss"] != uninterrupted[0][0]["train_loss"]  # (the erasing changed the training)
    out = tmp_path / "run"
    proc = start(out, *ERASED)
    wait_for_checkpoint(out, proc, at_random())
    proc.kill()
    proc.wait()
    assert not (out / "summary.json").exists()
    app.main(config(*SMALL, *ERASED, "trainer.resume=auto"), out_dir=str(out))
    assert results(out) == expected

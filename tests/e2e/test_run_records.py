"""What a run leaves in its run directory, through train.py as a user runs it (in the test's process, and
as a process of its own where a signal or a launcher is what is tested).

A run refused in a directory that holds another run leaves that directory byte for byte as it was
(Hydra itself would rewrite its ``.hydra/`` record with the rejected settings before the app could refuse);
in a directory of its own, a refused, non-finite or stopped run records its config and puts its last line
into ``train.log`` as on stderr. Every launcher gives the same numbers for the same config (the thread
count is the config's, not the launcher's ``OMP_NUM_THREADS``)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from harness.app_runs import not_log_lines, run_app
from tests.conftest import ROOT

QUICK = ("data.train_size=100", "trainer.epochs=1", "trainer.progress_bar=false", "+model.width=0.25")


def snapshot(directory):
    """Every file below ``directory`` (hidden ones too) and its bytes."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return {str(p.relative_to(directory)): p.read_bytes() for p in files}


def with_toy_hook(run, hook: str):
    """``train.py`` on the quick settings a quarter wide, with ``hook`` (a class of tests/toy_models.py)
    among its hooks, into ``run``."""
    return run_app(
        *QUICK, f"hooks=[{{_target_: tests.toy_models.{hook}}}]",
        "allow_targets=[tests.toy_models.*]", f"hydra.run.dir={run}", cwd=run.parent,
    )  # fmt: skip


def wait_for(path, proc, seconds=120, poll=0.05):
    """Until ``path`` exists, with ``proc`` still running (its output if it ended first)."""
    deadline = time.time() + seconds
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(poll)


def one_line(result, status):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == status and len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_a_refused_run_leaves_the_run_directory_it_names_byte_for_byte_as_it_was(tmp_path):
    run = tmp_path / "run"
    first = run_app(*QUICK, f"hydra.run.dir={run}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(run)
    records = {".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"}
    assert {*records, "last.pt", "summary.json", "train.log"} <= set(before)
    assert yaml.safe_load(before[".hydra/overrides.yaml"]) == list(QUICK)
    assert yaml.safe_load(before[".hydra/config.yaml"])["trainer"]["epochs"] == 1
    for overrides, line in (
        (  # resumed with another model
            ["model=torchvision", "model.name=resnet18", "~model.width", "trainer.resume=auto"],
            f"error: trainer.resume: {run / 'last.pt'}: written with model._target_=",
        ),
        (
            ["mixup.alpha=0.5", "trainer.resume=auto"],
            f"error: trainer.resume: {run / 'last.pt'}: written with mixup.alpha=2.0",
        ),
        ([], f"error: the run directory {run} already holds a checkpoint (last.pt)"),  # started afresh
        (["mixup.alpha=0"], "error: mixup: alpha must be a finite number > 0, got 0"),  # bad input
    ):
        result = run_app(*QUICK, *overrides, f"hydra.run.dir={run}", cwd=tmp_path)
        assert one_line(result, 2).startswith(line), result.stderr
        assert snapshot(run) == before, overrides


@pytest.mark.slow
def test_a_run_refused_in_its_own_directory_records_what_was_refused_and_why(tmp_path):
    run = tmp_path / "run"
    result = run_app(*QUICK, "mixup.alpha=0", f"hydra.run.dir={run}", cwd=tmp_path)
    line = one_line(result, 2)
    assert line == "error: mixup: alpha must be a finite number > 0, got 0"
    assert (run / "train.log").read_text().strip().endswith(f"[mixhook][ERROR] - {line}")
    assert yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) == [*QUICK, "mixup.alpha=0"]
    assert yaml.safe_load((run / ".hydra" / "config.yaml").read_text())["mixup"]["alpha"] == 0
    assert not any((run / name).exists() for name in ("last.pt", "metrics.csv", "summary.json"))


@pytest.mark.slow
def test_a_non_finite_loss_is_said_in_train_log_as_on_stderr(tmp_path):
    run = tmp_path / "run"
    line = one_line(with_toy_hook(run, "NanAt, layer: layer1.0.conv2, step: 2"), 3)
    assert line.startswith("error: epoch 1, step 2: the loss became nan; first non-finite layer output: ")
    log = (run / "train.log").read_text()
    assert "epoch 1/1" not in log and log.strip().endswith(f"[mixhook][ERROR] - {line}")


@pytest.mark.process
@pytest.mark.slow  # a process, stopped by a signal or started by a launcher
def test_ctrl_c_is_said_in_train_log_as_on_stderr(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "data.train_size=300", "trainer.epochs=50",
         "trainer.progress_bar=false", "+model.width=0.25", f"hydra.run.dir={run}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(run / "last.pt", proc)  # past start-up: the first epoch is written
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    lines = stderr.strip().splitlines()
    assert proc.returncode == 128 + signal.SIGINT and len(lines) == 1, stderr
    assert lines[0].startswith("stopped by SIGINT ") and "trainer.resume=auto" in lines[0]
    assert (run / "train.log").read_text().strip().endswith(f"[mixhook][ERROR] - {lines[0]}")


@pytest.mark.process
@pytest.mark.slow  # a process, stopped by a signal or started by a launcher
def test_the_basic_and_the_joblib_launcher_give_the_same_numbers(tmp_path):
    # joblib's workers start with OMP_NUM_THREADS=1, and CPU results depend on the thread count: the run
    # sets its own (trainer.threads, null: the cores it may use) and records it in summary.json. Run as a
    # user runs it, without the suite's thread settings (tests/conftest.py)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MIXHOOK_THREADS")}
    summaries = {}
    for launcher in ("basic", "joblib"):
        sweep = tmp_path / launcher
        result = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), "-m", f"hydra/launcher={launcher}", *QUICK,
             "seed=3", f"hydra.sweep.dir={sweep}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        summaries[launcher] = json.loads((sweep / "0" / "summary.json").read_text())
    basic, joblib = summaries["basic"], summaries["joblib"]
    assert basic["environment"]["cpu"]["threads"] == joblib["environment"]["cpu"]["threads"]
    for key in ("train_loss", "test_nll", "test_acc", "test_ece"):
        assert basic[key] == joblib[key], key


@pytest.mark.process
@pytest.mark.slow  # a process, stopped by a signal or started by a launcher
@pytest.mark.parametrize("when", ["while torch loads", "while the run is built"])
def test_ctrl_c_during_start_up_is_one_line(tmp_path, when):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # as from a terminal: a process started in the background (a shell's &, some CI runners) inherits
        # SIGINT ignored, and Python then installs no KeyboardInterrupt handler
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    if when == "while torch loads":
        time.sleep(0.5)  # the interpreter is up: importing torch takes a second or more
    else:  # Hydra has opened the job's log: the app imports scikit-learn, loads the data, builds the model
        wait_for(run / "train.log", proc, seconds=60, poll=0.01)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert stderr == "stopped by SIGINT before training began: no step was taken\n"
    assert not (run / "last.pt").exists()


@pytest.mark.slow
def test_what_torch_and_python_warn_during_training_goes_to_train_log_not_the_terminal(tmp_path):
    # as dynamo's graph-break warnings under trainer.compile=true: the terminal keeps the run's own lines
    run = tmp_path / "run"
    result = with_toy_hook(run, "Warns, layer: layer1")
    assert result.returncode == 0, result.stderr[-3000:]
    terminal = result.stdout + result.stderr
    assert "a graph break" not in terminal and "a library's warning" not in terminal
    # 100 training images, batches of 64: 2 steps, 2 graph breaks; Python shows a warning once per place
    assert "3 warning(s) from torch or Python during the run went to train.log only" in terminal
    log = (run / "train.log").read_text()
    assert log.count("a graph break") == 2 and log.count("UserWarning: a library's warning") == 1


@pytest.mark.process
@pytest.mark.slow  # a process, stopped by a signal or started by a launcher
def test_ctrl_c_stops_a_sweep_not_only_its_current_run_and_the_report_says_where_it_stopped(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "-m", "seed=0,1", "data.train_size=300", "trainer.epochs=50",
         "trainer.progress_bar=false", "+model.width=0.25", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(sweep / "0" / "last.pt", proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    lines = not_log_lines(stderr)
    assert proc.returncode == 128 + signal.SIGINT and len(lines) == 1, stderr
    assert (
        lines[0].startswith("stopped by SIGINT ") and not (sweep / "1").exists()
    )  # the next run never began
    assert "| failed | Interrupted: stopped by SIGINT" in (sweep / "summary.md").read_text()


@pytest.mark.slow
def test_a_sweep_run_again_into_its_own_directory_is_refused_per_job_and_counted_as_failed(tmp_path):
    # each job's directory holds the first sweep's run: refused and left as it was, yet the sweep must not
    # end as a success (its report still shows the earlier runs)
    sweep = tmp_path / "sweep"
    argv = ["-m", "seed=0", *QUICK, f"hydra.sweep.dir={sweep}"]
    first = run_app(*argv, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(sweep / "0")
    again = run_app(*argv, cwd=tmp_path)
    lines = not_log_lines(again.stderr)
    assert again.returncode == 1 and lines == [
        f"error: the run directory {sweep / '0'} already holds a checkpoint (last.pt); continue it with "
        "trainer.resume=auto, or choose another hydra.sweep.dir",
        f"error: 1 of 1 runs failed; their errors are listed in {sweep}/summary.md (1 refused in a directory "
        "that holds an earlier run, left as it was: see above)",
    ]
    assert snapshot(sweep / "0") == before

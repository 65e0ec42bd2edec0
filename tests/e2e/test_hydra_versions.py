"""The app under the Hydra it finds: 1.3.x (the README's install) or 1.4 (``.ci/run`` runs this file again
in a venv with hydra-core 1.4.0rc3 and omegaconf 2.4.1rc1). A run prints no deprecation or whitelist
warning; bad input stays one line and exit 2; a ``_target_`` outside the app's execution whitelist is
refused in one line saying how to allow it; the Optuna sweep runs (under 1.4 an expected failure: the
sweeper plugin breaks there, so ``pyproject.toml`` caps Hydra below 1.4 in the ``sweep`` extra)."""

import hydra
import pytest

from harness.app_runs import not_log_lines, run_app, run_cli
from mixhook.app.hydra_compat import HYDRA_14

pytestmark = pytest.mark.slow  # each runs train.py

QUICK = ("trainer.epochs=1", "data.train_size=100", "+model.width=0.25", "trainer.progress_bar=false")


@pytest.mark.process
def test_a_run_prints_nothing_but_its_log(tmp_path):
    result = run_cli(*QUICK, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not_log_lines(result.stderr) == [], f"hydra {hydra.__version__}"
    assert (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["optim.momentum=-1"], "error: optim: Invalid momentum value: -1"),
        (["optim.weight_decay=-1"], "error: optim: Invalid weight_decay value: -1"),
        (
            ["hooks=[{_target_: os.system, command: ls}]"],
            "error: hooks[0]._target_=os.system is not among the targets this app builds (mixhook.*, "
            "torch.optim.*, torchvision.models.*, timm.models.*); allow it with allow_targets=[os.*] (or "
            "allow_targets=[os.system])",
        ),
        (["allow_targets=['*']"], "error: allow_targets: '*' is not a target"),
        (["mixup.layer=nosuch"], "error: mixup.layer: unknown layer 'nosuch'"),
    ],
)
@pytest.mark.process
def test_bad_input_is_one_line_and_exit_2(tmp_path, overrides, line):
    result = run_cli(*overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(line), result.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.process
def test_a_checkpoint_that_is_not_one_is_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "last.pt").write_text("not a checkpoint\n")
    result = run_cli("trainer.resume=auto", f"hydra.run.dir={run}", cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: trainer.resume:"), lines


@pytest.mark.xfail(
    HYDRA_14,
    strict=True,
    reason="hydra-optuna-sweeper 1.3.0 under Hydra 1.4: the sampler config reaches Optuna uninstantiated; "
    "when this passes, drop the cap hydra-core<1.4 in pyproject.toml's sweep extra",
)
def test_an_optuna_sweep_runs(tmp_path):
    result = run_app(
        "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2", *QUICK,
        f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "sweep" / "optimization_results.yaml").exists()

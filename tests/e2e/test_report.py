"""Sweep reports: on fabricated run directories (the arithmetic), and on real Hydra multiruns (the
callback, a failed run, Optuna, the submitit local launcher)."""

import csv
import json
import math
import statistics
import subprocess
import sys

import matplotlib.image
import pytest
import yaml

from harness.app_runs import not_log_lines, run_app
from mixhook.app import CONF_DIR
from mixhook.app.hydra_compat import VERSION_BASE
from mixhook.app.report import main as report_main
from mixhook.app.report import write_report
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # real sweeps

FAST = ["trainer.epochs=1", "data.train_size=100", "trainer.progress_bar=false", "+model.width=0.25"]


def fake_run(sweep, job, overrides, acc=None, nll=None, error=None, paper=None, best=None, ece=None):
    run = sweep / str(job)
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if acc is not None:
        best = acc if best is None else best
        summary = {"test_acc": acc, "test_nll": nll, "best_test_acc": best, "epochs": 3, "seconds": 1.0}
        summary["paper"] = paper
        if ece is not None:
            summary["test_ece"] = ece
        (run / "summary.json").write_text(json.dumps(summary))
    if error is not None:
        (run / "error.txt").write_text(f"Traceback...\n{error}\n")


def test_report_groups_by_overrides_other_than_seed(tmp_path):
    paper = {"metric": "test_error", "value": 2.95, "std": 0.05, "source": "Verma et al. 2019"}
    fake_run(tmp_path, 0, ["mixup.alpha=0.2", "seed=0"], acc=0.90, nll=0.30, best=0.92, ece=0.05)
    fake_run(tmp_path, 1, ["mixup.alpha=0.2", "seed=1"], acc=0.80, nll=0.50, best=0.86, ece=0.07)
    fake_run(tmp_path, 2, ["mixup.alpha=2", "seed=0"], acc=0.96, nll=0.10, paper=paper, ece=0.02)
    fake_run(tmp_path, 3, ["mixup.alpha=2", "seed=1"], error="ValueError: boom")
    fake_run(tmp_path, 10, ["mixup.alpha=2", "seed=2"])  # still running: no summary, no error
    fake_run(tmp_path, 11, ["mixup.alpha=8", "seed=0"], error="RuntimeError: diverged")
    data = write_report(tmp_path)
    first, second, never = data["groups"]
    assert never["group"] == "mixup.alpha=8" and never["n"] == 0 and never["failed"] == 1  # last, shown
    assert first["failed"] == 1 and first["incomplete"] == 1 and first["errors"] == [pytest.approx(4.0)]
    assert first["group"] == "mixup.alpha=2" and first["n"] == 1
    assert math.isclose(first["test_error_mean"], 4.0)
    assert second["group"] == "mixup.alpha=0.2" and second["n"] == 2
    assert math.isclose(second["test_error_mean"], 15.0)
    assert math.isclose(second["test_error_std"], 7.0710678, rel_tol=1e-6)
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert [r["job"] for r in rows] == ["0", "1", "2", "3", "10", "11"]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "failed", "incomplete", "failed"]
    assert float(rows[0]["test_ece"]) == pytest.approx(0.05)  # a fraction, as summary.json has it
    assert first["test_ece_mean"] == pytest.approx(2.0)  # the report's table and picture: in %
    assert rows[3]["error"] == "ValueError: boom" and rows[0]["mixup.alpha"] == "0.2"
    assert rows[2]["paper_value"] == "2.95"
    md = (tmp_path / "summary.md").read_text()
    assert "6 runs: 3 ok, 2 failed, 1 incomplete" in md
    assert (
        "| group | n | test error %, last epoch | test error %, best epoch | test NLL, last epoch "
        "| test ECE %, last epoch | paper |" in md
    )
    assert "| mixup.alpha=8 |" not in md.split("## Runs without a result")[0]  # no figure to show
    best, worse = (
        "| mixup.alpha=2 | 1 | 4.00 | 4.00 |",
        "| mixup.alpha=0.2 | 2 | 15.00 ± 7.07 | 11.00 ± 4.24 |",
    )
    assert md.index(best) < md.index(worse) and "11.00 ± 4.24 | 0.4000 ± 0.1414 | 6.00 ± 1.41 |" in md
    assert math.isclose(second["best_error_mean"], 11.0) and math.isclose(
        float(rows[0]["best_test_error"]), 8.0
    )
    assert "2.95 ± 0.05 (Verma et al. 2019)" in md
    assert "| 3 | mixup.alpha=2 seed=1 | failed | ValueError: boom |" in md
    assert matplotlib.image.imread(tmp_path / "summary.png").shape[2] in (3, 4)


def test_groups_are_compared_with_the_baseline_seed_by_seed(tmp_path):
    """Two sweeps in one directory (a mixup sweep and an erasing one, as the Fashion-MNIST study runs them):
    each group's mean and 95% interval, and its paired difference from mixup=none over the seeds both
    finished, with its interval and whether it excludes 0."""
    accs = {
        "mixup=none": [0.90, 0.91, 0.92],
        "mixup=input": [0.92, 0.925, 0.935],
        "erasing=random": [0.91, 0.90, 0.93],
    }
    job = 0
    for group, values in accs.items():
        for seed, acc in enumerate(values):
            fake_run(
                tmp_path / group.split("=")[0],
                job,
                [group, f"seed={seed}"],
                acc=acc,
                nll=1 - acc,
                ece=0.05 + seed / 100,
            )
            job += 1
    fake_run(
        tmp_path / "mixup", 99, ["mixup=input", "seed=7"], acc=0.5, nll=0.5, ece=0.1
    )  # (no partner seed)
    fake_run(tmp_path / "rerun", 0, ["mixup=input", "seed=0"], acc=0.92, nll=0.08, ece=0.05)  # (seed 0 again)
    data = write_report(tmp_path)
    compared = data["paired"]
    assert compared["baseline"] == "mixup=none"
    by = {e["group"]: e for e in compared["groups"]}
    t = 4.302652729911275  # scipy.stats.t.ppf(0.975, 2)
    diffs = [-2.0, -1.5, -1.5]  # input's error minus none's, per seed, in points: 8-10, 7.5-9, 6.5-8
    mean, half = by["mixup=input"]["test_error_diff"]
    assert mean == pytest.approx(-5 / 3) and half == pytest.approx(t * statistics.stdev(diffs) / math.sqrt(3))
    assert by["mixup=input"]["pairs"] == 3 and by["mixup=input"]["n"] == 5
    assert compared["twice"] == ["`mixup=input` seed 0"]
    assert by["erasing=random"]["test_error_diff"][0] == pytest.approx(-1 / 3)  # 9-10, 10-9, 7-8
    assert by["mixup=none"]["baseline"] and by["mixup=none"]["pairs"] == 3
    md = (tmp_path / "summary.md").read_text()
    assert "## Paired differences from `mixup=none`" in md
    assert "| `erasing=random` | 3 | 3 | 8.67 ± " in md and "| -0.33 ± 2.87 | no |" in md
    assert "| `mixup=input` | 5 | 3 |" in md and "| -1.67 ± 0.72 | lower |" in md
    assert "the pairs take the last): `mixup=input` seed 0." in md
    assert matplotlib.image.imread(tmp_path / "paired.png").shape[2] in (3, 4)
    # no baseline (nothing swept is none): no section, no picture
    other = tmp_path / "other"
    fake_run(other, 0, ["mixup=input", "seed=0"], acc=0.9, nll=0.1)
    fake_run(other, 1, ["mixup=cutmix", "seed=0"], acc=0.9, nll=0.1)
    assert write_report(other)["paired"] is None and not (other / "paired.png").exists()


def test_report_cli_refuses_a_directory_without_runs(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    assert "is not a sweep directory" in capsys.readouterr().err


def multirun(*overrides, cwd):
    """``python train.py -m *overrides``, in this process (a launcher that starts processes of its own,
    submitit's, is run as a process: :func:`multirun_process`)."""
    return run_app("-m", *overrides, cwd=cwd)


def multirun_process(*overrides, cwd):
    """``python train.py -m *overrides`` as a process of its own."""
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.process
@pytest.mark.slow
def test_a_real_2x2_sweep_reports_itself_and_on_demand(tmp_path):
    sweep = tmp_path / "sweep"
    result = multirun("mixup.alpha=0.5,2", "seed=0,1", *FAST, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert len(rows) == 4 and {r["status"] for r in rows} == {"ok"}
    md = (sweep / "summary.md").read_text()
    assert "| mixup.alpha=0.5 | 2 |" in md and "| mixup.alpha=2 | 2 |" in md
    assert matplotlib.image.imread(sweep / "summary.png").ndim == 3
    for name in ("summary.csv", "summary.md", "summary.png"):
        (sweep / name).unlink()
    command = [sys.executable, "-m", "mixhook.app.report", str(sweep)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0 and "4 runs, 2 groups" in result.stdout
    assert len(list(csv.DictReader(open(sweep / "summary.csv")))) == 4


@pytest.mark.slow
def test_one_sweep_of_portable_specs_crosses_three_architectures_and_reports_spec_by_model(tmp_path):
    sweep = tmp_path / "sweep"
    result = multirun(
        "model=preact_resnet18,resnet32,timm", "mixup.layer=stage:1,depth:0.5", "trainer.epochs=1",
        "data.train_size=64", "trainer.progress_bar=false", f"hydra.sweep.dir={sweep}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mixup layers on this model: depth:0.5 -> layer2.2" in result.stdout  # ResNet-32: 15 blocks
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert [s["layers"]["mixup"] for s in summaries] == [
        {"stage:1": ["layer1"]}, {"depth:0.5": ["layer3.0"]}, {"stage:1": ["layer1"]},
        {"depth:0.5": ["layer2.2"]}, {"stage:1": ["layer1"]}, {"depth:0.5": ["layer3.0"]},
    ]  # fmt: skip
    md = (sweep / "summary.md").read_text()
    table = md.split("## mixup.layer by model")[1].split("\n\n")[2].splitlines()
    assert table[0] == "| mixup.layer | model=preact_resnet18 | model=resnet32 | model=timm |"
    assert table[2].startswith("| stage:1 |") and table[2].count("(n=1) `layer1`") == 3
    assert (
        table[3].startswith("| depth:0.5 |")
        and "`layer2.2`" in table[3]
        and table[3].count("`layer3.0`") == 2
    )


@pytest.mark.slow
def test_a_sweep_with_a_failing_run_still_reports_the_others(tmp_path):
    sweep = tmp_path / "sweep"
    result = multirun("mixup.alpha=1,-1", *FAST, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 1
    assert not_log_lines(result.stderr) == [  # the job's own line, then the sweep's: no traceback
        "error: mixup: alpha must be a finite number > 0, got -1",
        f"error: 1 of 2 runs failed; their errors are listed in {sweep}/summary.md",
    ]
    rows = {r["mixup.alpha"]: r for r in csv.DictReader(open(sweep / "summary.csv"))}
    assert rows["1"]["status"] == "ok"
    assert rows["-1"]["status"] == "failed"
    assert rows["-1"]["error"] == "ConfigError: mixup: alpha must be a finite number > 0, got -1"
    assert "| 1 | mixup.alpha=-1" in (sweep / "summary.md").read_text()


def test_a_sweep_in_which_every_run_fails_ends_in_one_line_and_says_so_in_its_picture(tmp_path):
    sweep = tmp_path / "sweep"
    result = multirun("mixup.alpha=0,-1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 1
    assert not_log_lines(result.stderr) == [
        "error: mixup: alpha must be a finite number > 0, got 0",
        "error: mixup: alpha must be a finite number > 0, got -1",
        f"error: 2 of 2 runs failed; their errors are listed in {sweep}/summary.md",
    ]
    text = (sweep / "summary.md").read_text()
    assert "| test error %" not in text and text.count("| failed | ConfigError: mixup: alpha must be") == 2
    image = matplotlib.image.imread(sweep / "summary.png")
    assert image.std() > 0.01  # drawn: the title and the line saying no run finished


@pytest.mark.slow
def test_optuna_search_completes_and_reports(tmp_path):
    sweep = tmp_path / "sweep"
    result = multirun(
        "hparams_search=optuna", "hydra.sweeper.n_trials=3", *FAST, f"hydra.sweep.dir={sweep}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert len(rows) == 3 and all(r["status"] == "ok" for r in rows)
    assert all(0.1 <= float(r["mixup.alpha"]) <= 4.0 for r in rows)
    assert all(r["mixup.layer"] in ("input", "layer1", "layer2") for r in rows)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == max(float(r["test_acc"]) for r in rows)


@pytest.mark.process
@pytest.mark.slow
def test_submitit_local_launcher_runs_and_reports(tmp_path):
    sweep = tmp_path / "sweep"
    launcher = "hydra/launcher=submitit_local"
    result = multirun_process(launcher, "seed=0,1", *FAST, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [r["seed"] for r in rows] == ["0", "1"] and all(r["status"] == "ok" for r in rows)
    assert (sweep / ".submitit").is_dir()


@pytest.mark.parametrize(
    ("launcher", "setting", "target"),
    [("joblib", "n_jobs=2", "JoblibLauncher"), ("submitit_slurm", "partition=gpu", "SlurmLauncher")],
)
def test_launcher_configs_compose(launcher, setting, target):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), **VERSION_BASE):
        cfg = compose(
            config_name="config",
            overrides=[f"hydra/launcher={launcher}", f"hydra.launcher.{setting}"],
            return_hydra_config=True,
        )
    key, _, value = setting.partition("=")
    assert cfg.hydra.launcher._target_.endswith(target) and str(cfg.hydra.launcher[key]) == value


def test_the_reports_committed_under_docs_are_what_the_report_code_writes_now(capsys):
    # each is rebuilt from its own summary.csv (docs/regenerate_reports.py): a change to the report's
    # layout or units fails here until the committed reports are regenerated
    from docs.regenerate_reports import main, reports

    assert main(["--check"]) == 0, capsys.readouterr().err
    assert len(reports()) >= 8  # the mini study's five and the calibration study's three

"""Paper experiment configs: each composes to exactly the paper's recipe and figure, builds on real
CIFAR-format files, and a real multirun over two of them reports paper beside measured."""

import csv
import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from mixhook import CutMix, ManifoldMixup
from mixhook.app import CONF_DIR
from mixhook.app import run as app
from tests.app_helpers import config, run_cli
from tests.conftest import ROOT, write_cifar

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))

VERMA = {  # Verma et al. 2019, Appendix C, and the authors' code where the paper is silent
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4,
              "nesterov": True},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [400, 800], "gamma": 0.1},
    "trainer": {"epochs": 1200, "batch_size": 100, "loss": "bce_softmax"},
}  # fmt: skip
ZHANG = {  # Zhang et al. 2018, Section 3.2, and the authors' code
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4,
              "nesterov": False},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [100, 150], "gamma": 0.1},
    "trainer": {"epochs": 200, "batch_size": 128, "loss": "ce"},
}  # fmt: skip
YUN = {  # Yun et al. 2019: the authors' CIFAR-100 command and code
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.25, "momentum": 0.9, "weight_decay": 1e-4,
              "nesterov": True},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [150, 225], "gamma": 0.1},
    "trainer": {"epochs": 300, "batch_size": 64, "loss": "ce"},
}  # fmt: skip
CUTMIX = {"_target_": "mixhook.CutMix", "layer": "input", "alpha": 1.0, "prob": 0.5}
MANIFOLD = {"_target_": "mixhook.ManifoldMixup", "layer": ["input", "layer1", "layer2"], "alpha": 2.0}
INPUT = {"_target_": "mixhook.ManifoldMixup", "layer": "input", "alpha": 1.0}

# name: (recipe, data, mixup keys, paper test error, its std)
EXPECTED = {
    "verma2019_cifar10_none": (VERMA, "cifar10", {}, 4.83, 0.066),
    "verma2019_cifar10_input": (VERMA, "cifar10", INPUT, 3.82, 0.048),
    "verma2019_cifar10_manifold": (VERMA, "cifar10", MANIFOLD, 2.95, 0.046),
    "verma2019_cifar100_none": (VERMA, "cifar100", {}, 24.01, 0.376),
    "verma2019_cifar100_input": (VERMA, "cifar100", INPUT, 22.11, 0.424),
    "verma2019_cifar100_manifold": (VERMA, "cifar100", MANIFOLD, 20.34, 0.525),
    "zhang2018_cifar10_erm": (ZHANG, "cifar10", {}, 5.6, None),
    "zhang2018_cifar10_mixup": (ZHANG, "cifar10", INPUT, 4.2, None),
    "zhang2018_cifar100_mixup": (ZHANG, "cifar100", INPUT, 21.1, None),
    "yun2019_cifar100_cutmix": (YUN, "cifar100", CUTMIX, None, None),
}  # fmt: skip


def test_every_experiment_config_is_checked_here():
    assert EXPERIMENTS == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_experiment_sets_the_papers_hyperparameters_and_figure(name):
    recipe, data, mixup, value, std = EXPECTED[name]
    cfg = OmegaConf.to_container(config(f"experiment={name}"), resolve=True)
    assert cfg["data"]["name"] == data and cfg["data"]["augment"] is True
    assert cfg["model"] == {"_target_": "mixhook.app.models.PreActResNet18"}
    for group in ("optim", "scheduler", "trainer"):
        assert {k: cfg[group][k] for k in recipe[group]} == recipe[group]
    assert {k: cfg["mixup"][k] for k in mixup} == mixup and (mixup or cfg["mixup"] == {})
    assert cfg["paper"]["metric"] == "test_error"
    assert cfg["paper"].get("value") == value and cfg["paper"].get("std") == std
    assert cfg["paper"]["source"].startswith(("Verma et al. 2019", "Zhang et al. 2018", "Yun et al. 2019"))


def test_the_cutmix_experiment_says_its_model_is_a_substitute_and_carries_no_figure():
    paper = config("experiment=yun2019_cifar100_cutmix").paper
    assert "value" not in paper and "PyramidNet-200" in paper.substitute


def test_command_line_overrides_win_over_the_experiment():
    cfg = config("experiment=verma2019_cifar10_manifold", "trainer.epochs=3", "trainer.loss=ce")
    assert cfg.trainer.epochs == 3 and cfg.trainer.loss == "ce" and cfg.scheduler.milestones == [400, 800]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_experiment_builds_on_cifar_format_files(tmp_path, name):
    recipe, data, mixup = EXPECTED[name][:3]
    write_cifar(tmp_path, data, per_file=4)
    run = app.build(config(f"experiment={name}", f"data.root={tmp_path}", "data.num_workers=0"))
    try:
        classes = 10 if data == "cifar10" else 100
        assert run.model.linear.out_features == classes and run.settings.epochs == recipe["trainer"]["epochs"]
        assert run.optimizer.param_groups[0]["nesterov"] == recipe["optim"]["nesterov"]
        assert run.scheduler.milestones == dict.fromkeys(recipe["scheduler"]["milestones"], 1)
        kind = {"mixhook.ManifoldMixup": ManifoldMixup, "mixhook.CutMix": CutMix}
        expected = kind.get(mixup.get("_target_"))
        assert (run.mixup is None) if expected is None else isinstance(run.mixup, expected)
        assert run.summary["paper"] == OmegaConf.to_container(config(f"experiment={name}").paper)
    finally:
        if run.mixup is not None:
            run.mixup.remove()


def test_cfg_job_prints_the_papers_hyperparameters(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "experiment=verma2019_cifar100_manifold", "--cfg", "job"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.to_container(OmegaConf.create(result.stdout))
    assert printed["scheduler"]["milestones"] == [400, 800] and printed["trainer"]["epochs"] == 1200
    assert printed["paper"]["value"] == 20.34 and printed["data"]["name"] == "cifar100"


def test_a_multirun_over_paper_experiments_reports_paper_beside_measured(tmp_path):
    write_cifar(tmp_path / "cifar", "cifar10", per_file=8)
    sweep = tmp_path / "sweep"
    # data=cifar10 too: Hydra composes the sweep's base config without the swept experiment, where
    # data is digits and has no data.root
    result = run_cli(
        "-m", "experiment=verma2019_cifar10_none,verma2019_cifar10_manifold", "data=cifar10",
        f"data.root={tmp_path / 'cifar'}", "data.num_workers=0", "trainer.epochs=1",
        "trainer.batch_size=8", "trainer.progress_bar=false", f"hydra.sweep.dir={sweep}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for job in ("0", "1"):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["loss"] == "bce_softmax" and summary["epochs"] == 1
    rows = {r["overrides"].split()[0]: r for r in csv.DictReader(open(sweep / "summary.csv"))}
    assert rows["experiment=verma2019_cifar10_none"]["paper_value"] == "4.83"
    assert rows["experiment=verma2019_cifar10_manifold"]["paper_value"] == "2.95"
    table = (sweep / "summary.md").read_text()
    assert "| experiment=verma2019_cifar10_manifold | 1 |" in table
    assert "2.95 ± 0.046 (Verma et al. 2019, Table 1a" in table

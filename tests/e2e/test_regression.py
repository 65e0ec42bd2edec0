"""The app's regression task: scikit-learn's diabetes data with an MLP, trained with the squared error
(mixed by the mixer's loss), tested by RMSE in the target's own units; C-Mixup runs there, the
classification-only settings are refused in one line; a sweep of regression runs is reported by RMSE."""

import csv
import json
import math

import numpy as np
import pytest
import torch
import yaml

from harness.app_runs import config
from mixhook.app import run as app
from mixhook.app.models import MLP
from mixhook.app.report import write_report
from tests.helpers import Lazy

sklearn_data = Lazy("sklearn.datasets")  # imported by the test that uses it, not at collection
sklearn_split = Lazy("sklearn.model_selection")

COMMON = ("data=diabetes", "model=mlp", "trainer.progress_bar=false")


def test_a_cmixup_run_reports_the_rmse_of_its_model_in_the_targets_units(tmp_path):
    acc = app.main(config(*COMMON, "mixup=cmixup", "trainer.epochs=3"), out_dir=str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert list(rows[0]) == ["epoch", "train_loss", "test_loss", "test_rmse", "lr", "seconds"]
    assert summary["task"] == "regression" and acc == -summary["test_rmse"]
    assert summary["test_rmse"] == pytest.approx(float(rows[-1]["test_rmse"]))
    assert summary["best_test_rmse"] == min(float(r["test_rmse"]) for r in rows)
    assert "test_acc" not in summary and not (tmp_path / "reliability.png").exists()
    assert summary["mixup"]["_target_"] == "mixhook.CMixup"
    # the RMSE of the saved model, by hand from scikit-learn's data and the same split
    x, y = sklearn_data.load_diabetes(return_X_y=True, scaled=False)
    x_train, x_test, y_train, y_test = sklearn_split.train_test_split(
        x.astype(np.float32), y.astype(np.float32), test_size=0.2, random_state=0
    )
    model = MLP(10, 1)
    model.load_state_dict(torch.load(tmp_path / "last.pt", weights_only=False)["model"])
    features = torch.from_numpy((x_test - x_train.mean(0)) / x_train.std(0))
    with torch.no_grad():
        pred = model.eval()(features).squeeze(1).double() * float(y_train.std()) + float(y_train.mean())
    rmse = math.sqrt(float(((pred - torch.from_numpy(y_test).double()) ** 2).mean()))
    assert summary["test_rmse"] == pytest.approx(rmse, rel=1e-5)
    assert 40 < rmse < 90  # the scale of the target (25-346), not of the standardised one


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("mixup=rankmixup",), "mixup: RankMixup compares class confidences, so its labels must be"),
        (("mixup=mixupe",), "mixup: MixupE compares class confidences"),
        (("trainer.loss=bce_softmax",), "trainer.loss=bce_softmax trains on class probabilities, but"),
        (
            ("model=preact_resnet18",),
            r"^model: data=diabetes is tabular \(10 features, a regression target\): train it with "
            r"model=mlp$",
        ),
    ],
)
def test_classification_only_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(app.ConfigError, match=message):
        app.build(config(*COMMON, *overrides))


@pytest.mark.slow
def test_a_sweep_of_regression_runs_is_reported_by_rmse(tmp_path):
    for mixup in ("none", "input"):
        for seed in (0, 1):
            run = tmp_path / f"{mixup}{seed}"
            overrides = [f"mixup={mixup}", f"seed={seed}"]
            app.main(config(*COMMON, "trainer.epochs=1", *overrides), out_dir=str(run))
            (run / ".hydra").mkdir()
            (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    report = write_report(tmp_path)
    groups = {g["group"]: g for g in report["groups"]}
    rmse = [json.loads((tmp_path / f"none{s}" / "summary.json").read_text())["test_rmse"] for s in (0, 1)]
    assert groups["mixup=none"]["test_error_mean"] == pytest.approx(sum(rmse) / 2)
    text = (tmp_path / "summary.md").read_text()
    assert (
        "| group | n | test RMSE, last epoch | test RMSE, best epoch |" in text
        and "ECE" not in text.split("|")[0]
    )

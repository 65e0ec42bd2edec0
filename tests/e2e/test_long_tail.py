"""The app's long-tail task: data.imbalance_ratio, the class-balanced sampler and partner batches, balanced
and per-class accuracy in metrics.csv, summary.json and the sweep report, and the policy configs
(mixup=remix, balanced, decouplemix, skmixup, localmixup, guided_pairing) trained for real."""

import csv
import json
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness.app_runs import config, run_app
from mixhook.app import run as app
from mixhook.app.data import build_data
from mixhook.app.training.evaluation import evaluate
from mixhook.policies import BalancedMixup, Remix
from tests.helpers import Lazy

metrics = Lazy("sklearn.metrics")  # imported by the test that uses it, not at collection

POLICY_CONFIGS = ["remix", "balanced", "decouplemix", "skmixup", "localmixup", "guided_pairing"]


@pytest.mark.filterwarnings("ignore:y_pred contains classes not in y_true")
def test_evaluate_gives_each_class_its_accuracy_and_their_mean_as_scikit_learn_does():
    torch.manual_seed(0)
    model = nn.Linear(6, 5)
    x = torch.randn(97, 6)
    y = torch.cat([torch.randint(0, 4, (96,)), torch.tensor([0])])  # class 4 is not in the test set
    found = evaluate(model, DataLoader(TensorDataset(x, y), batch_size=10), torch.device("cpu"))
    predicted = model(x).argmax(1)  # (it may predict class 4, which scikit-learn warns of)
    recall = metrics.recall_score(y, predicted, labels=[0, 1, 2, 3], average=None, zero_division=0)
    assert found.per_class[:4] == pytest.approx(recall.tolist()) and math.isnan(found.per_class[4])
    assert found.balanced_acc == pytest.approx(metrics.balanced_accuracy_score(y, predicted))


@pytest.mark.slow
def test_remix_gets_the_long_tails_class_counts_and_balanced_mixup_a_partner_batch_per_step(tmp_path):
    run = app.build(config("mixup=remix", "data.imbalance_ratio=10"))
    try:
        (remix,) = run.mixup.policies
        assert isinstance(remix, Remix) and remix.counts.tolist() == run.data.class_counts
        assert (
            run.data.class_counts == [142, 111, 86, 66, 51, 39, 30, 23, 18, 14] and run.data.partners is None
        )
    finally:
        run.mixup.remove()
    run = app.build(config("mixup=balanced", "data.imbalance_ratio=10", "mixup.layer=layer2"))
    try:
        assert isinstance(run.mixup.policies[0], BalancedMixup) and len(run.data.partners) == len(
            run.data.train
        )
    finally:
        run.mixup.remove()
    given = Remix(counts=[5] * 10)  # counts given in the config are kept
    run = app.build(config("mixup=remix", "+mixup.policies.target.counts=[5,5,5,5,5,5,5,5,5,5]"))
    try:
        assert run.mixup.policies[0].counts.tolist() == given.counts.tolist()
    finally:
        run.mixup.remove()


@pytest.mark.slow
def test_a_long_tail_sweep_over_the_policy_configs_trains_and_reports_balanced_accuracy(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_app(
        "-m", f"mixup={','.join(POLICY_CONFIGS)}", "data.imbalance_ratio=10", "data.sampler=random",
        "trainer.epochs=2", "trainer.progress_bar=false", "model=resnet32", f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p.parent for p in sweep.glob("*/summary.json"))
    assert len(runs) == len(POLICY_CONFIGS)
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        per_class = summary["test_class_acc"]
        assert len(per_class) == 10 and summary["test_balanced_acc"] == pytest.approx(sum(per_class) / 10)
        sizes = torch.bincount(
            torch.cat([y for _, y in build_data("digits", 64).test])
        ).tolist()  # (balanced)
        assert summary["test_acc"] == pytest.approx(
            sum(a * n for a, n in zip(per_class, sizes, strict=True)) / 360
        )
        with open(run / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 2 and float(rows[-1]["test_balanced_acc"]) == summary["test_balanced_acc"]
        assert [float(rows[-1][f"test_acc_c{c}"]) for c in range(10)] == per_class
        assert all(math.isfinite(float(r["train_loss"])) for r in rows)
        shown = [line for line in (run / "train.log").read_text().splitlines() if "  train_loss " in line]
        assert len(shown) == 2 and all(  # the README's "(balanced accuracy too)": on screen, each epoch
            f"test_balanced_acc {100 * float(r['test_balanced_acc']):.2f}%  test_ece" in line
            for r, line in zip(rows, shown, strict=True)
        )
    report = (sweep / "summary.md").read_text()
    assert "balanced accuracy %, last epoch" in report
    for name in POLICY_CONFIGS:
        assert f"mixup={name} |" in report

"""Expected calibration error and the reliability diagram's numbers, against Guo et al.'s code."""

import matplotlib.image
import pytest
import torch
import torch.nn.functional as F

from mixhook.app.training.calibration import Calibration


def reference_ece(logits, labels, n_bins=15):
    """gpleiss/temperature_scaling, temperature_scaling.py, ``_ECELoss.forward`` (Guo et al. 2017's
    code), the lines the figure needs."""
    bin_boundaries = torch.linspace(0, 1, n_bins + 1)
    bin_lowers = bin_boundaries[:-1]
    bin_uppers = bin_boundaries[1:]
    softmaxes = F.softmax(logits, dim=1)
    confidences, predictions = torch.max(softmaxes, 1)
    accuracies = predictions.eq(labels)
    ece = torch.zeros(1, device=logits.device, dtype=logits.dtype)
    for bin_lower, bin_upper in zip(bin_lowers, bin_uppers, strict=True):
        in_bin = confidences.gt(bin_lower.item()) * confidences.le(bin_upper.item())
        prop_in_bin = in_bin.to(logits.dtype).mean()
        if prop_in_bin.item() > 0:
            accuracy_in_bin = accuracies[in_bin].to(logits.dtype).mean()
            avg_confidence_in_bin = confidences[in_bin].mean()
            ece += torch.abs(avg_confidence_in_bin - accuracy_in_bin) * prop_in_bin
    return float(ece)


@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0])
def test_ece_equals_guo_et_al_over_batches(scale):
    g = torch.Generator().manual_seed(int(10 * scale))
    logits = scale * torch.randn(1000, 10, generator=g, dtype=torch.float64)
    labels = torch.where(
        torch.rand(1000, generator=g) < 0.6, logits.argmax(1), torch.randint(0, 10, (1000,), generator=g)
    )
    calibration = Calibration()
    for chunk in range(0, 1000, 128):  # batch by batch, as the evaluation loop adds them
        calibration.update(logits[chunk : chunk + 128], labels[chunk : chunk + 128])
    assert calibration.ece() == pytest.approx(reference_ece(logits, labels), abs=1e-12)
    table = calibration.table()
    confidence = logits.softmax(1).max(1).values
    assert sum(table["count"]) == 1000 and table["ece"] == calibration.ece()
    for k in range(15):  # bin k holds (k/15, (k+1)/15]
        inside = (confidence > k / 15) & (confidence <= (k + 1) / 15)
        assert table["count"][k] == int(inside.sum())
        if inside.any():
            assert table["confidence"][k] == pytest.approx(float(confidence[inside].mean()))
            right = (logits.argmax(1) == labels)[inside].double().mean()
            assert table["accuracy"][k] == pytest.approx(float(right))
        else:
            assert table["confidence"][k] is None and table["accuracy"][k] is None


def test_a_perfectly_calibrated_and_an_overconfident_model():
    labels = torch.zeros(100, dtype=torch.int64)
    sure = torch.tensor([[20.0, 0.0]]).repeat(100, 1)  # confidence ~1, always right: ECE ~0
    calibration = Calibration()
    calibration.update(sure, labels)
    assert calibration.ece() < 1e-8
    wrong = Calibration()
    wrong.update(sure, torch.ones(100, dtype=torch.int64))  # confidence ~1, always wrong: ECE ~1
    assert wrong.ece() == pytest.approx(1.0, abs=1e-8)
    assert wrong.table()["count"][14] == 100


def test_reliability_diagram_is_drawn(tmp_path):
    g = torch.Generator().manual_seed(0)
    calibration = Calibration()
    calibration.update(3 * torch.randn(500, 10, generator=g), torch.randint(0, 10, (500,), generator=g))
    calibration.plot(tmp_path / "reliability.png", "a test")
    image = matplotlib.image.imread(tmp_path / "reliability.png")
    assert image.shape[0] > 500 and image.shape[1] > 400 and image.std() > 0.05


def test_bad_bins_and_an_empty_reduce_are_refused():
    with pytest.raises(ValueError, match="bins must be an integer >= 1, got 0"):
        Calibration(0)
    with pytest.raises(ValueError, match="no batch was added"):
        Calibration().reduce(None)


def test_evaluate_reads_accuracy_and_nll_off_the_same_pass():
    from torch import nn

    from mixhook.app.training.evaluation import evaluate

    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(50, 6, generator=g), torch.randint(0, 3, (50,), generator=g)
    model = nn.Linear(6, 3)
    loader = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 50, 16)]
    nll, acc, calibration, _ = evaluate(model, loader, torch.device("cpu"))
    with torch.no_grad():
        logits = model(x)
    assert acc == float((logits.argmax(1) == y).double().mean())
    assert nll == pytest.approx(float(F.cross_entropy(logits.double(), y)), rel=1e-6)
    assert sum(calibration.table()["count"]) == 50

"""Probes look and never touch: outputs and gradients bit for bit unchanged, recorded values equal to
hand computations, nothing left behind once removed."""

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from mixhook import ActivationStats, FeatureRecorder, GradStats, ManifoldMixup, ShapeTrace, attach
from tests.helpers import hook_count

LAYERS = ["input", "conv1", "layer1", "layer2.0.bn1", "layer2", "fc"]


def run(model, probes, seed=0):
    """One pinned mixed training step; the logits and every parameter's gradient."""
    torch.manual_seed(seed)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    model.zero_grad(set_to_none=True)
    mixer = ManifoldMixup(["layer1", "layer2"])
    with attach(model, mixer, *probes):
        mixer.pin(layer="layer2", lam=0.3, index=[1, 0, 3, 2])
        logits = model(x)
        mixer.loss(F.cross_entropy, logits, y).backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_probes_leave_outputs_and_gradients_bit_identical():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plain_logits, plain_grads = run(model, [])
    model.load_state_dict(state)  # BN running stats back
    probes = [
        FeatureRecorder(LAYERS, where="before"), FeatureRecorder(LAYERS), ActivationStats(LAYERS),
        GradStats([n for n in LAYERS if n != "input"]), ShapeTrace(),
    ]  # fmt: skip
    logits, grads = run(model, probes)
    assert torch.equal(logits, plain_logits)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    assert hook_count(model) == 0  # and nothing stays registered
    assert all(p.model is None for p in probes)


def test_feature_recorder_before_and_after_the_mix():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).train()
    mixer = ManifoldMixup("layer2")
    before, after = (
        FeatureRecorder(["input", "layer2"], where="before", to_cpu=True),
        FeatureRecorder("layer2"),
    )
    with attach(model, mixer, before, after):
        mixer.pin(lam=0.25, index=[2, 3, 0, 1])
        x = torch.randn(4, 3, 32, 32)
        model(x)
    h = before.features["layer2"]
    assert torch.equal(before.features["input"], x) and h.device.type == "cpu" and not h.requires_grad
    torch.testing.assert_close(after.features["layer2"], 0.25 * h + 0.75 * h[[2, 3, 0, 1]])
    keep = FeatureRecorder("fc", detach=False)
    with keep.attach(model):
        model.eval()
        out = model(torch.randn(2, 3, 32, 32))
    assert keep.features["fc"].requires_grad and torch.equal(keep.features["fc"], out)


def test_activation_stats_match_hand_computations_every_k_training_steps():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).train()
    stats = ActivationStats(["1", "2"], every=2)
    inputs = [torch.randn(5, 3) for _ in range(4)]
    inputs[2][0, 0] = float("nan")  # step 3: a NaN reaches the outputs
    with stats.attach(model):
        for x in inputs:
            model(x)
        model.eval()
        model(torch.randn(5, 3))  # eval forwards are not training steps
    rows = stats.rows()
    assert [(r["step"], r["layer"]) for r in rows] == [(1, "1"), (1, "2"), (3, "1"), (3, "2")]
    with torch.no_grad():
        for row, x in zip(rows[::2], (inputs[0], inputs[2]), strict=True):
            h = model[1](model[0](x))
            finite = torch.isfinite(h)
            values = h[finite]
            assert row["nonfinite"] == float((~finite).sum())
            assert row["zeros"] == pytest.approx(float((h == 0).float().mean()))
            assert row["max_abs"] == pytest.approx(float(values.abs().max()))
            expected_mean = float(torch.where(finite, h, 0).mean())
            assert row["mean"] == pytest.approx(expected_mean, abs=1e-6)
    assert rows[2]["nonfinite"] > 0 and stats.rows() == []  # rows() hands them over once


def test_grad_stats_match_a_hand_split_backward():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2)
    )
    x = torch.randn(6, 3)
    # by hand: retain the gradient at the outputs of "0" and "2"
    h0 = model[0](x)
    h0.retain_grad()
    h2 = model[2](model[1](h0))
    h2.retain_grad()
    model[3](h2).pow(2).sum().backward()
    expected = {
        "0": (h0.grad.norm(), torch.cat([p.grad.flatten() for p in model[0].parameters()]).norm()),
        "2": (h2.grad.norm(), torch.cat([p.grad.flatten() for p in model[2].parameters()]).norm()),
    }
    model.zero_grad(set_to_none=True)
    stats = GradStats(["0", "2"])
    with stats.attach(model):
        model(x).pow(2).sum().backward()
    rows = {r["layer"]: r for r in stats.rows()}
    for name, (grad_norm, param_norm) in expected.items():
        assert rows[name]["step"] == 1
        assert rows[name]["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-5)
        assert rows[name]["param_grad_norm"] == pytest.approx(float(param_norm), rel=1e-5)
    with pytest.raises(ValueError, match="'input' has neither"):
        GradStats("input")


def test_shape_trace_lists_every_call_of_the_first_forward_in_order():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 6 * 6, 3))
    trace = ShapeTrace()
    with trace.attach(model):
        model(torch.randn(5, 1, 8, 8))
        model(torch.randn(7, 1, 8, 8))  # only the first forward is traced
    assert [c[:2] for c in trace.calls] == [
        ("0", "Conv2d"),
        ("1", "Flatten"),
        ("2", "Linear"),
        ("(model)", "Sequential"),
    ]
    assert trace.calls[0][2:] == ("(5, 1, 8, 8) float32", "(5, 2, 6, 6) float32")
    lines = str(trace).splitlines()
    assert lines[0].split() == ["module", "type", "input", "output"] and len(lines) == 5

"""Probes in the app: probes.csv with per-layer rows, TensorBoard event files with those series and the
epoch metrics, feature-map pictures, and training unchanged by all of it."""

import csv
import json

import matplotlib.image
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from harness.app_runs import config, run_app
from mixhook import ActivationStats, CutMix, ManifoldMixup, OneOf
from mixhook.app import run as app
from mixhook.app.models import PreActResNet18
from mixhook.app.training import checkpoint as ckpt
from mixhook.app.training.logging import RunLogger, save_feature_maps

SMALL = [
    "data.train_size=200", "trainer.epochs=1", "trainer.batch_size=32", "trainer.progress_bar=false",
    "+model.width=0.25",
]  # fmt: skip


@pytest.mark.slow
def test_probes_and_tensorboard_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    result = run_app(
        *SMALL, "probes.layers=[layer1,stage:2]", "probes.every=3", "trainer.logger=tensorboard",
        "probes.feature_maps=true", f"hydra.run.dir={out}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(open(out / "probes.csv")))  # 7 steps: steps 1, 4 and 7 recorded
    assert [(r["step"], r["layer"]) for r in rows] == [
        (s, layer) for s in ("1", "4", "7") for layer in ("layer1", "layer2")
    ]
    assert all(
        float(r["std"]) > 0 and float(r["grad_norm"]) > 0 and float(r["param_grad_norm"]) > 0 for r in rows
    )

    events = EventAccumulator(str(out))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"epoch/test_acc", "epoch/train_loss", "probes/layer1/mean", "probes/layer2/grad_norm"} <= set(
        tags
    )
    assert [e.step for e in events.Scalars("probes/layer2/max_abs")] == [1, 4, 7]
    summary = json.loads((out / "summary.json").read_text())
    assert abs(events.Scalars("epoch/test_acc")[0].value - summary["test_acc"]) < 1e-6
    assert summary["hooks"] == {
        "probes": "ActivationStats(layer=['layer1', 'stage:2'], every=3)",
        "probes.grad": "GradStats(layer=['layer1', 'stage:2'], every=3)",
    }
    # a portable spec is recorded, logged and drawn under the layer it named (stage:2: layer2)
    assert summary["layers"]["probes"] == {"layer1": ["layer1"], "stage:2": ["layer2"]}

    for layer in ("layer1", "layer2"):
        image = matplotlib.image.imread(out / "feature_maps" / f"epoch001_{layer}.png")
        assert image.shape[0] > 100 and image.shape[1] > 400 and image.std() > 0.05

    # the same run without probes trains identically
    plain = tmp_path / "plain"
    app.main(config(*SMALL), out_dir=str(plain))  # in this process: the same code after Hydra's composition
    strip = [[v for k, v in r.items() if k != "seconds"] for r in csv.DictReader(open(out / "metrics.csv"))]
    plain_rows = [
        [v for k, v in r.items() if k != "seconds"] for r in csv.DictReader(open(plain / "metrics.csv"))
    ]
    assert strip == plain_rows


@pytest.mark.slow
def test_feature_maps_show_the_mix_and_leave_training_untouched(tmp_path):
    torch.manual_seed(0)
    model = PreActResNet18(in_channels=1, num_classes=10).eval()
    mixer, stats = ManifoldMixup(["layer1", "layer2"]), ActivationStats("layer1")
    mixer.attach(model)
    stats.attach(model)
    x = torch.randn(4, 1, 8, 8)
    streams, buffers = ckpt.random_states([mixer]), {k: v.clone() for k, v in model.named_buffers()}
    layers = ["layer1", "layer2", "linear"]
    drawn = save_feature_maps(
        model, mixer, layers, x, tmp_path / "e1", pause=[stats], targets=torch.arange(4)
    )
    assert list(drawn) == ["layer1", "layer2"]  # linear is not (B, C, H, W)
    for layer in ("layer1", "layer2"):  # each probed layer mixed at itself: not one mix for all of them
        assert (tmp_path / f"e1_{layer}.png").exists()
        maps = drawn[layer]
        assert maps.at == layer and maps.index.tolist() == [3, 2, 1, 0] and maps.lam.tolist() == [0.5] * 4
        torch.testing.assert_close(maps.mixed, 0.5 * maps.plain + 0.5 * maps.plain.flip(0))
    assert not model.training and stats.step == 0 and stats.rows() == []
    after = ckpt.random_states([mixer])
    assert all(
        torch.equal(a, b) for a, b in zip(after["hooks"].values(), streams["hooks"].values(), strict=True)
    )
    assert torch.equal(after["torch"], streams["torch"])
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())


@pytest.mark.slow
def test_feature_maps_of_a_layer_the_mixer_does_not_own_show_the_upstream_mix(tmp_path):
    torch.manual_seed(0)
    model = PreActResNet18(in_channels=1, num_classes=10)
    mixer = ManifoldMixup("layer1")
    mixer.attach(model)
    x = torch.randn(4, 1, 8, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    drawn = save_feature_maps(model, mixer, ["conv1", "layer1", "layer2"], x, tmp_path / "e")
    assert drawn["conv1"].at is None and torch.equal(drawn["conv1"].plain, drawn["conv1"].mixed)  # before it
    assert drawn["layer2"].at == "layer1"
    with torch.no_grad():  # by hand: layer2 of the mixed layer1 maps, from the same statistics
        mixed1 = 0.5 * drawn["layer1"].plain + 0.5 * drawn["layer1"].plain.flip(0)
        expected = model.layer2(mixed1)
    model.load_state_dict(state)
    torch.testing.assert_close(drawn["layer2"].mixed, expected)
    assert not torch.allclose(drawn["layer2"].mixed, drawn["layer2"].plain)
    image = matplotlib.image.imread(tmp_path / "e_layer2.png")
    assert image.shape[0] > 500 and image.shape[1] > 1000 and image.std() > 0.05


@pytest.mark.slow
def test_feature_maps_pin_a_oneof_through_the_mixer_that_owns_the_layer(tmp_path):
    torch.manual_seed(0)
    model = PreActResNet18(in_channels=1, num_classes=10)
    both = OneOf([ManifoldMixup("layer1"), CutMix("layer2")])
    both.attach(model)
    x = torch.randn(4, 1, 8, 8)
    drawn = save_feature_maps(model, both, ["conv1", "layer1", "layer2"], x, tmp_path / "a")
    plain, mixed = drawn["layer1"].plain, drawn["layer1"].mixed
    torch.testing.assert_close(mixed, 0.5 * plain + 0.5 * plain.flip(0))  # pinned through ManifoldMixup
    cut = drawn["layer2"]  # pinned through CutMix: its box, the rest unmixed
    assert cut.at == "layer2" and ((cut.mixed == cut.plain) | (cut.mixed == cut.plain.flip(0))).all()
    assert drawn["conv1"].at is None and (tmp_path / "a_conv1.png").exists()


def test_a_resumed_run_cuts_probes_csv_back_to_the_checkpoint(tmp_path):
    stats = ActivationStats("x")
    path = tmp_path / "probes.csv"
    path.write_text("step,epoch,layer,mean\n1,1,x,0.1\n5,1,x,0.2\n9,2,x,0.3\n")
    RunLogger(tmp_path, "csv", [stats], resume_step=5).close()
    assert [r["step"] for r in csv.DictReader(open(path))] == ["1", "5"]


def test_bad_probe_settings_are_refused():
    from mixhook.app import run as app

    for overrides, message in (
        (["probes.layers=[layr1]"], "probes.layer: unknown layer 'layr1'"),
        (["probes.layers=[layer1]", "probes.every=0"], "probes.every must be an integer >= 1, got 0"),
    ):
        try:
            app.build(config(*overrides))
        except app.ConfigError as err:
            assert message in str(err), str(err)
        else:
            raise AssertionError(overrides)

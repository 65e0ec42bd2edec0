"""The Hydra app: configs composed for real, bad settings caught before training, and `train.py` run the
way a user runs it (in this process, and as a process of its own where its exit status is tested)."""

import csv
import json
import multiprocessing

import pytest
import torch
from omegaconf import OmegaConf

from harness.app_runs import config, run_app, run_cli
from harness.readme import problems, quoted_block, shape
from mixhook import ManifoldMixup
from mixhook.app import run as app
from tests.conftest import write_cifar
from tests.helpers import Lazy

images = Lazy("matplotlib.image")  # imported by the test that uses it, not at collection


def test_default_config_is_the_papers_manifold_mixup_on_digits():
    cfg = config()
    assert cfg.data.name == "digits" and cfg.model._target_ == "mixhook.app.models.PreActResNet18"
    assert list(cfg.mixup.layer) == ["input", "layer1", "layer2"] and cfg.mixup.alpha == 2.0
    run = app.build(cfg)
    assert isinstance(run.mixup, ManifoldMixup) and run.mixup.model is run.model
    assert run.mixup.layers == ("input", "layer1", "layer2") and run.settings.epochs == cfg.trainer.epochs
    assert run.model.conv1.in_channels == 1 and run.model.linear.out_features == 10
    run.mixup.remove()


def test_mixup_layer_fastai_names_fastais_default_candidates_in_the_summary():
    from mixhook import fastai_layers

    run = app.build(config("mixup.layer=fastai", "mixup.mode=pair"))
    try:
        blocks = [f"layer{i}.{j}" for i in (1, 2, 3, 4) for j in (0, 1)]
        assert list(run.mixup.layers) == ["input", *blocks] == fastai_layers(run.model)
        assert run.summary["mixup"]["layer"] == ["input", *blocks] and run.mixup.mode == "pair"
    finally:
        run.mixup.remove()


def test_mixup_none_builds_without_a_regularizer():
    run = app.build(config("mixup=none"))
    assert run.mixup is None and run.summary["mixup"] == {}


TOYS = "allow_targets=[tests.toy_models.*]"  # the toy models the tests build (hydra_compat)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["mixup.layer=nosuch"], "mixup.layer: unknown layer 'nosuch' in PreActResNet."),
        (["mixup.layer=[input,layr2]"], "did you mean 'layer2'"),
        (["mixup.alpha=0"], "mixup: alpha must be a finite number > 0"),
        (["mixup.prob=1.5"], "mixup: prob must be in [0, 1], got 1.5"),
        (["trainer.epochs=0"], "trainer.epochs must be an integer >= 1, got 0"),  # before T_max's
        (["trainer.batch_size=0"], "trainer.batch_size must be an integer >= 1, got 0"),
        (["trainer.device=tpu"], "trainer.device='tpu'"),
        (["optim.lr=-1"], "optim.lr must be > 0, got -1"),
        (["optim.lr=0"], "optim.lr must be > 0, got 0"),  # torch accepts it: a run that learns nothing
        (["optim=adamw", "optim.lr=0"], "optim.lr must be > 0, got 0"),
        (["optim.lr=abc"], "optim.lr must be a number, got 'abc'"),  # the signature's default is one
        (["optim.nesterov=maybe"], "optim.nesterov must be true or false, got 'maybe'"),
        (["optim.momentum=-1"], "optim: Invalid momentum value: -1"),  # torch's own check
        (
            ["scheduler=multistep", "scheduler.milestones=[150,100]"],
            "scheduler.milestones must be increasing numbers >= 1, got [150, 100]",
        ),
        (["scheduler=multistep", "scheduler.milestones=[0,3]"], "got [0, 3]"),
        (["scheduler=multistep", "scheduler.gamma=0"], "scheduler.gamma must be > 0, got 0"),
        (["scheduler.T_max=0"], "scheduler.T_max must be an integer >= 1, got 0"),
        (
            ["optim._target_=torch.nn.Identity", "allow_targets=[torch.nn.Identity]"],
            "optim: torch.nn.Identity built a Identity, not a torch.optim",
        ),
        (
            ["scheduler=constant", "+scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau"],
            "scheduler: ReduceLROnPlateau steps on a validation metric",
        ),
        (["mixup=mixup_cutmix", "mixup.mixers.0.alpha=abc"], "mixup.mixers[0].alpha must be a number"),
        (["model=torchvision", "model.name=resnet"], "model: model.name='resnet' is not a torchvision"),
        (["data=cifar10", "data.root=/nonexistent"], "CIFAR-10 not found: /nonexistent/cifar-10-batches-py"),
    ],
)
def test_bad_settings_fail_in_build_with_one_line(overrides, message):
    with pytest.raises(app.ConfigError) as info:
        app.build(config(*overrides))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.compile=true"],
            "trainer.compile=true with trainer.strategy=fsdp: compiling a sharded model",
        ),
        (
            ["trainer.precision=fp16"],
            "trainer.precision=fp16 with trainer.strategy=fsdp: the fp16 grad scaler",
        ),
        (
            ["trainer.channels_last=true"],
            "trainer.channels_last=true with trainer.strategy=fsdp: FSDP2 shards contiguous parameters only",
        ),
        (
            ["probes.feature_maps=true", "probes.layers=[layer1]"],
            "probes.feature_maps=true with trainer.strategy=fsdp: the pictures are drawn by rank 0 alone",
        ),
    ],
)
def test_what_fsdp_cannot_train_with_is_refused_in_one_line(overrides, message):
    """As rank 0 of a job of two processes builds it (refused before anything joins the ranks)."""
    from mixhook.app.training.distributed import Dist

    with pytest.raises(app.ConfigError) as info:
        app.build(config("trainer.strategy=fsdp", *overrides), Dist(rank=0, world=2))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cuda_requested_without_cuda_is_refused():
    with pytest.raises(app.ConfigError, match="trainer.device='cuda' but no CUDA device is available"):
        app.build(config("trainer.device=cuda"))


def test_a_layer_with_a_tuple_output_is_mixed_and_a_selector_without_the_batch_is_refused():
    run = app.build(config("model._target_=tests.toy_models.TupleBlockNet", "mixup.layer=[stem,block]", TOYS))
    run.model.train()(next(iter(run.data.train))[0])  # mixes whichever layer is drawn
    for handle in run.handles:
        handle.remove()
    cutmix = app.build(
        config("model._target_=tests.toy_models.OddOutputsNet", "mixup=cutmix", "mixup.layer=named", TOYS)
    )
    for handle in cutmix.handles:  # a dict holding one (B, C, H, W) map: CutMix cuts it
        handle.remove()
    cfg = config("model._target_=tests.toy_models.TupleBlockNet", 'mixup.layer="block[1]"', TOYS)
    with pytest.raises(
        app.ConfigError, match=r"mixup.layer: ManifoldMixup at 'block\[1\]'.*no batch dimension"
    ):
        app.build(cfg)


def test_a_model_that_cannot_run_on_the_data_is_refused_before_training():
    cfg = config("model=torchvision", "model.name=vit_b_16", "mixup=none")
    with pytest.raises(
        app.ConfigError,
        match=r"model: VisionTransformer fails on a digits batch of shape \(2, 1, 8, 8\): "
        r"AssertionError: Wrong image height",
    ):
        app.build(cfg)


@pytest.mark.slow
def test_main_returns_the_final_test_accuracy_it_writes(tmp_path):
    cfg = config(
        "trainer.epochs=1", "mixup.layer=layer2", "data.test_size=0.5", "trainer.progress_bar=false",
        "+model.width=0.25",
    )  # fmt: skip
    acc = app.main(cfg, out_dir=str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert acc == summary["test_acc"] and 0.0 <= acc <= 1.0
    assert summary["mixup"]["layer"] == "layer2" and summary["mixup"]["alpha"] == 2.0


SHORT = ["trainer.epochs=2", "+model.width=0.25"]  # the default run, shorter and a quarter wide


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """``python train.py`` with nothing else changed than two epochs of the network a quarter wide, run in
    this process once for the tests that check what it writes and prints. The README's own run (15 epochs,
    as on a fresh machine: matplotlib without a font cache) is a step of .ci/run of its own,
    tools/readme_run.py, which checks it against the output the README shows."""
    out = tmp_path_factory.mktemp("default") / "run"
    result = run_app(*SHORT, f"hydra.run.dir={out}", cwd=out.parent)
    assert result.returncode == 0, result.stderr
    return out, result


def summary_train_acc(out):
    return json.loads((out / "summary.json").read_text())["train_acc"]


@pytest.mark.slow
def test_cli_trains_and_writes_metrics_and_summary(default_run):
    out, result = default_run
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [r["epoch"] for r in rows] == [str(e) for e in range(1, 3)]
    assert list(rows[0]) == [
        "epoch", "train_loss", "train_acc", "test_loss", "test_acc", "test_ece", "lr", "seconds",
        "test_balanced_acc", *(f"test_acc_c{c}" for c in range(10)),
    ]  # fmt: skip
    per_class = [float(rows[-1][f"test_acc_c{c}"]) for c in range(10)]
    assert float(rows[-1]["test_balanced_acc"]) == pytest.approx(sum(per_class) / 10)
    assert all(
        0.0 < float(r["train_acc"]) < 1.0 for r in rows
    )  # lam-weighted: Manifold Mixup mixes every batch
    assert summary_train_acc(out) == pytest.approx(float(rows[-1]["train_acc"]))
    assert float(rows[1]["lr"]) < float(rows[0]["lr"])  # the cosine schedule moved
    summary = json.loads((out / "summary.json").read_text())
    for key in ("test_acc", "test_nll", "best_test_acc", "epochs", "seconds", "mixup"):
        assert key in summary
    assert summary["test_acc"] == pytest.approx(float(rows[-1]["test_acc"]))
    assert summary["test_nll"] == pytest.approx(float(rows[-1]["test_loss"]))
    assert summary["best_test_acc"] == max(float(r["test_acc"]) for r in rows)
    calibration = summary["calibration"]  # the last epoch's reliability diagram, 15 bins
    assert calibration["bins"] == 15 and summary["test_ece"] == pytest.approx(float(rows[-1]["test_ece"]))
    assert calibration["ece"] == summary["test_ece"] and 0 < summary["test_ece"] < 1
    n = sum(calibration["count"])
    assert n == 360  # the digits test split, every sample in one bin
    correct = sum(c * a for c, a in zip(calibration["count"], calibration["accuracy"], strict=True) if c)
    assert round(correct) / n == pytest.approx(summary["test_acc"])
    image = images.imread(out / "reliability.png")
    assert image.shape[0] > 500 and image.std() > 0.05
    log = result.stdout + result.stderr
    assert log.count("epoch 1/2  train_loss") == 1 and "epoch 2/2  train_loss" in log
    assert "test_balanced_acc" not in log  # (digits' classes are as large as each other: the accuracy alone)
    # only the app's lines (tools/readme_run.py checks so on a fresh machine, where matplotlib builds its font
    # cache)
    assert [line for line in log.splitlines() if "[mixhook]" not in line] == []
    assert not list(out.glob(".*.tmp"))


@pytest.mark.slow
def test_the_readmes_sample_output_is_what_the_default_run_prints(default_run, tmp_path):
    # the numbers differ across CPUs and thread counts (the README says by how much), the lines do not
    out, result = default_run
    printed = [shape(line) for line in (result.stdout + result.stderr).splitlines() if "[mixhook]" in line]
    quoted = quoted_block("It prints one line per epoch")
    assert quoted[2] == "..." and len(printed) == 4  # the start, 2 epochs, done
    assert [shape(line) for line in quoted[:2] + quoted[3:]] == printed[:2] + printed[-2:]
    # the README's 15-epoch run, its range of test_acc and test_ece: tools/readme_run.py, a step of .ci/run,
    # whose check finds what this shorter run does not show as the README does, and nothing else
    assert problems(out, result.stdout + result.stderr, fonts=tmp_path) == [
        "printed 4 [mixhook] lines, the README shows the start, 15 epochs and done",
        "matplotlib built no font cache: the run was not as on a fresh machine",
    ]


@pytest.mark.process
@pytest.mark.slow
def test_cli_unknown_layer_exits_non_zero_with_one_line_and_no_summary(tmp_path):
    out = tmp_path / "run"
    result = run_cli("mixup.layer=nosuch", f"hydra.run.dir={out}", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: mixup.layer: unknown layer 'nosuch'")
    assert "layer2" in lines[0].split("Valid layers:")[1]
    assert not (out / "summary.json").exists() and not (out / "metrics.csv").exists()
    assert quoted_block("A configuration error stops the run", "docs/training-app.md") == [
        "$ python train.py mixup.layer=nosuch",
        lines[0],
    ]


@pytest.mark.process
@pytest.mark.slow
def test_cli_mixup_none_and_an_unknown_group_option(tmp_path):
    result = run_cli("mixup=nosuch", f"hydra.run.dir={tmp_path / 'x'}", cwd=tmp_path)
    assert result.returncode != 0 and "nosuch" in result.stderr and "none" in result.stderr


@pytest.mark.slow
def test_cli_trains_on_cifar_format_files(tmp_path):
    write_cifar(tmp_path / "cifar", "cifar10", per_file=16)
    out = tmp_path / "run"
    result = run_app(
        "data=cifar10", f"data.root={tmp_path / 'cifar'}", "data.num_workers=0", "trainer.epochs=1",
        "trainer.batch_size=16", "mixup.layer=[input,layer1]", "+model.width=0.25", f"hydra.run.dir={out}",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"] == "cifar10" and summary["epochs"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("data", ["svhn", "imagefolder"])
def test_cli_trains_on_svhn_files_and_on_an_image_folder(tmp_path, data):
    from tests.app.test_data_folders import jpeg_tree, svhn_files

    if data == "svhn":
        svhn_files(tmp_path / "files", n_train=32, n_test=16)
        options = ["data.num_workers=0", "data.augment=true"]
    else:
        jpeg_tree(tmp_path / "files" / "train", per_class=8)
        jpeg_tree(tmp_path / "files" / "val", per_class=4, seed=1)
        options = ["data.num_workers=2", "data.size=32", "data.resize=36", "data.normalize=device"]
    out = tmp_path / "run"
    result = run_app(
        f"data={data}", f"data.root={tmp_path / 'files'}", *options, "trainer.epochs=1",
        "trainer.batch_size=8", "mixup.layer=[input,layer1]", "+model.width=0.25", f"hydra.run.dir={out}",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"] == data and summary["epochs"] == 1 and 0 <= summary["test_acc"] <= 1
    # the image folder's two persistent workers were told to stop with the run (a garbage collection that
    # found them in the run's reference cycle stopped them in a later test, 20 s); on a loaded machine a
    # worker told to stop may take a moment to exit, so each is given that (nothing else stops them)
    for child in multiprocessing.active_children():
        child.join(timeout=60)
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_cli_default_experiment_is_the_papers_manifold_mixup(default_run):
    summary = json.loads((default_run[0] / "summary.json").read_text())
    assert summary["mixup"]["layer"] == ["input", "layer1", "layer2"] and summary["mixup"]["alpha"] == 2.0
    assert summary["epochs"] == 2 and summary["test_acc"] >= 0.5  # (reaching 95% in 15: tools/readme_run.py)


# ------------------------------------------------------------------------ the hook catalogue in the app

FAST = ["trainer.epochs=1", "data.train_size=100", "trainer.progress_bar=false", "+model.width=0.25"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "kinds"),
    [
        (["mixup=cutmix", "mixup.layer=input"], {"mixup": "CutMix(layer='input'"}),
        (["mixup=cutmix", "mixup.layer=layer2"], {"mixup": "CutMix(layer='layer2'"}),
        (["mixup=patchup", "mixup.layer=[input,layer1]"], {"mixup": "PatchUp(layer=['input', 'layer1']"}),
        (["mixup=nfm"], {"mixup": "NoisyFeatureMixup(layer=['input', 'layer1', 'layer2']"}),
        (["mixup=input"], {"mixup": "ManifoldMixup(layer='input', alpha=1.0"}),
        (["mixup=mixup_cutmix"], {"mixup": "OneOf([ManifoldMixup(layer='input', alpha=0.8"}),
        (
            ["input_scale.layer=layer1", "input_scale.factor=0.5"],
            {"input_scale": "InputScale(layer='layer1'"},
        ),
        (
            ["grad_scale.layer=layer3", "grad_scale.factor=0.1"],
            {"grad_scale": "GradScale(layer='layer3', factor=0.1)"},
        ),
        (
            ["mixup=none", "grad_scale.layer=layer3", "grad_scale.factor=-1.0"],
            {"grad_scale": "GradScale(layer='layer3', factor=-1.0)"},
        ),
        (
            [
                "mixup.mode=elem",
                "grad_clip.layer=layer2",
                "input_scale.layer=input",
                "input_scale.factor=[0.8,1.2]",
            ],
            {"grad_clip": "GradClip(layer='layer2'", "input_scale": "factor=(0.8, 1.2)"},
        ),
    ],
)
def test_catalogue_commands_train_with_their_hooks(tmp_path, overrides, kinds):
    cfg = config(*overrides, *FAST)
    run = app.build(cfg)
    described = {key: repr(hook) for key, hook in zip(_keys(cfg), run.hooks, strict=True)}
    for key, text in kinds.items():
        assert text in described[key], described
    for hook in run.hooks:
        hook.remove()
    acc = app.main(cfg, out_dir=str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["test_acc"] == acc
    assert summary["mixup"] == OmegaConf.to_container(cfg.mixup)
    for key, text in kinds.items():
        if key != "mixup":
            assert text in summary["hooks"][key]


def _keys(cfg):
    keys = ["mixup"] if cfg.mixup.get("_target_") else []
    keys += [k for k in ("input_scale", "grad_scale", "grad_clip") if cfg[k].layer is not None]
    return keys + [f"hooks[{i}]" for i in range(len(cfg.hooks))]


def test_hooks_list_instantiates_a_users_own_hook_class_once_allowed():
    hooks = "hooks=[{_target_: tests.toy_models.CountForwards, layer: layer2}]"
    with pytest.raises(
        app.ConfigError,
        match=r"^hooks\[0\]\._target_=tests\.toy_models\.CountForwards is not among the targets this app "
        r"builds \(mixhook\.\*, torch\.optim\.\*, torchvision\.models\.\*, timm\.models\.\*\); allow it with "
        r"allow_targets=\[tests\.toy_models\.\*\]",
    ):
        app.build(config(hooks, *FAST))
    run = app.build(config(hooks, "allow_targets=[tests.toy_models.CountForwards]", *FAST))
    counter = run.hooks[-1]
    assert type(counter).__name__ == "CountForwards" and counter.calls == 1  # the sample batch check
    run.model(torch.randn(3, 1, 8, 8))
    assert counter.calls == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["mixup=cutmix", "mixup.layer=linear"],
            "mixup.layer: CutMix at 'linear' needs a (B, C, L), (B, C, H, W) or (B, C, D, H, W) map",
        ),
        (["mixup=patchup", "mixup.layer=layer2"], "PatchUp block_size=7 is larger than the 4x4 feature map"),
        (
            ["hooks=[{_target_: mixhook.CutMix, layer: input}]"],
            "2 mixing regularizers configured (mixup, hooks[0])",
        ),
        (["grad_scale.layer=nosuch"], "grad_scale.layer: unknown layer 'nosuch'"),
        (
            ["input_scale.layer=input", "input_scale.factor=[2,1]"],
            "input_scale: factor range (low, high) needs low",
        ),
        (["grad_clip.layer=input"], "grad_clip: GradClip clips the gradient at a layer's output"),
        (["hooks=[{layer: layer2}]"], "hooks[0]: each entry needs a _target_"),
        (["mixup.mode=pairs"], "mixup: mode must be 'batch', 'elem' or 'pair', got 'pairs'"),
    ],
)
def test_catalogue_misconfigurations_fail_in_build(overrides, message):
    with pytest.raises(app.ConfigError) as info:
        app.build(config(*overrides))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_any_torch_optimizer_and_schedule_are_targets():
    run = app.build(
        config(
            "optim._target_=torch.optim.RMSprop", "~optim.nesterov", "+optim.alpha=0.8",
            "scheduler=multistep", "scheduler.milestones=[2,5]", "scheduler.gamma=0.5",
        )
    )  # fmt: skip
    try:
        group = run.optimizer.param_groups[0]
        assert isinstance(run.optimizer, torch.optim.RMSprop) and group["alpha"] == 0.8
        assert group["lr"] == 0.05 and group["momentum"] == 0.9 and group["weight_decay"] == 5e-4
        assert isinstance(run.scheduler, torch.optim.lr_scheduler.MultiStepLR)
        assert run.scheduler.milestones == {2: 1, 5: 1} and run.scheduler.gamma == 0.5
        assert {id(p) for p in group["params"]} == {id(p) for p in run.model.parameters()}
    finally:
        for handle in run.handles:
            handle.remove()
    adamw = app.build(config("optim=adamw", "scheduler=constant"))
    try:
        assert isinstance(adamw.optimizer, torch.optim.AdamW) and adamw.scheduler is None
        assert adamw.optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    finally:
        for handle in adamw.handles:
            handle.remove()
    cosine = app.build(config("trainer.epochs=7"))  # the default: cosine over the run's epochs
    try:
        assert isinstance(cosine.scheduler, torch.optim.lr_scheduler.CosineAnnealingLR)
        assert cosine.scheduler.T_max == 7 and cosine.scheduler.eta_min == 0.0
    finally:
        for handle in cosine.handles:
            handle.remove()

"""The bad-input matrix: each bad setting gets one line naming it, a non-zero exit before any training,
and leaves no metrics.csv, summary.json or checkpoint behind. Batch size 1 is not bad input, unless a
BatchNorm layer would see one value per channel (refused before training, not a traceback in step 1)."""

import json

import pytest

from harness.app_runs import config, run_cli
from mixhook.app import CONF_DIR
from mixhook.app import run as app
from mixhook.app.command_line import check_command_line
from tests.conftest import write_cifar


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["mixup.layer=layr2"],
            "error: mixup.layer: unknown layer 'layr2' in PreActResNet; did you mean 'layer2'",
        ),
        (["mixup.alpha=0"], "error: mixup: alpha must be a finite number > 0, got 0"),
        (["mixup.alpha=-1"], "error: mixup: alpha must be a finite number > 0, got -1"),
        (["mixup.prob=1.5"], "error: mixup: prob must be in [0, 1], got 1.5"),
        (["mixup.prob=-0.1"], "error: mixup: prob must be in [0, 1], got -0.1"),
        (["trainer.batch_size=0"], "error: trainer.batch_size must be an integer >= 1, got 0"),
        (  # 8x8 digits: layer4's maps are 1x1, and the first BatchNorm to see them is layer4.0.bn2
            ["trainer.batch_size=1"],
            "error: trainer.batch_size=1: PreActResNet's BatchNorm layer 'layer4.0.bn2' would see one value "
            "per channel (its input for one sample is (1, 512, 1, 1)), which it cannot train on; use "
            "trainer.batch_size=2 or more",
        ),
        (
            ["trainer.batch_size=1", "model=torchvision", "model.name=resnet18", "mixup.layer=layer1"],
            "error: trainer.batch_size=1: ResNet's BatchNorm layer 'layer2.0.bn1' would see one value",
        ),
        (["trainer.epochs=-1"], "error: trainer.epochs must be an integer >= 1, got -1"),
        (["trainer.strategy=zero3"], "error: trainer.strategy='zero3' is not a strategy; valid: ddp, fsdp"),
        (
            ["trainer.strategy=fsdp"],
            "error: trainer.strategy=fsdp shards the model over the processes of a job, but this run has "
            "one; launch it with torchrun --nproc_per_node=N",
        ),
        (
            ["trainer.fsdp_units=[layer1]"],
            "error: trainer.fsdp_units=['layer1'] names the units FSDP shards, but trainer.strategy=ddp; set "
            "trainer.strategy=fsdp, or leave fsdp_units null",
        ),
        (
            ["trainer.strategy=fsdp", "trainer.fsdp_units=[layer5]"],
            "error: trainer.fsdp_units: 'layer5' is not a module of the model; its children: conv1, layer1,",
        ),
        (
            ["trainer.strategy=fsdp", "trainer.fsdp_units=[layer1,layer1.0]"],
            "error: trainer.fsdp_units: 'layer1.0' is inside 'layer1'; name units that do not nest",
        ),
        (["trainer.checkpoint_every=-5"], "error: trainer.checkpoint_every must be an integer >= 0, got -5"),
        (["trainer.warmup_epochs=-1"], "error: trainer.warmup_epochs must be an integer >= 0, got -1"),
        (
            ["trainer.warmup_epochs=5", "trainer.warmup_start_factor=1.5"],
            "error: trainer.warmup_start_factor must be in [0, 1], got 1.5",
        ),
        (["trainer.logger=wandb"], "error: trainer.logger='wandb' is not a logger; valid: csv, tensorboard"),
        (["trainer.precision=8"], "error: trainer.precision='8' is not a precision; valid: 32, bf16, fp16"),
        (["probes.layers=[layr1]"], "error: probes.layer: unknown layer 'layr1'"),
        (
            ["mixup.layer=stage:9"],
            "error: mixup.layer: layer 'stage:9': PreActResNet has 5 stages, stage:0..4 (or stage:-5..-1): "
            "conv1, layer1, layer2, layer3, layer4. `mixhook-layers`",
        ),
        (["trainer.resume=3"], "error: trainer.resume: no checkpoint at 3"),
        (["trainer.resume=''"], "error: trainer.resume must be null, auto or a checkpoint path, got ''"),
        (["optim.momentum=-1"], "error: optim: Invalid momentum value: -1"),
        (["optim.weight_decay=-1"], "error: optim: Invalid weight_decay value: -1"),
        (["optim.lr=0"], "error: optim.lr must be > 0, got 0"),
        (  # refused by its class, not by the cosine schedule's T_max it cannot take
            ["scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau"],
            "error: scheduler: ReduceLROnPlateau steps on a validation metric, and this app has only",
        ),
        (["optim.nesterov=true", "optim.momentum=0"], "error: optim: Nesterov momentum requires a momentum"),
        (["data.test_size=1.5"], "error: data.test_size must be in (0, 1), got 1.5"),
        (["seed=-1"], "error: seed must be an integer >= 0, got -1"),
        (["probes.every=0"], "error: probes.every must be an integer >= 1, got 0"),
        (["schedule.off_epoch=-1"], "error: schedule.off_epoch must be an integer >= 0, got -1"),
        (
            ["schedule.layer_weights=[1,2]"],
            "error: schedule: layer_weights=[1, 2]: one weight >= 0 per layer of",
        ),
        (
            ["schedule.prob={start:0,end:2,epochs:3}"],
            "error: schedule: MixSchedule(prob=...): the ramp must stay in",
        ),
        (
            ["schedule.alpha={start:1,end:2}"],
            "error: schedule.alpha={'start': 1, 'end': 2}: a ramp takes start, end",
        ),
        (["mixup=none", "schedule.off_epoch=3"], "error: schedule.* is set but nothing mixes (mixup=none)"),
        (
            ["trainer.check_finite_every=0"],
            "error: trainer.check_finite_every must be an integer >= 1, got 0",
        ),
        (
            ["trainer.check_finite_every=10"],
            "error: trainer.check_finite_every=10 needs an optimizer that skips a step on the device, so",
        ),
        (
            ["trainer.mixed_loss_weight=0"],
            "error: trainer.mixed_loss_weight must be in (0, inf), got 0.0",
        ),
        (
            ["mixup=none", "trainer.mixed_loss_weight=2"],
            "error: trainer.mixed_loss_weight=2.0 weights the loss of mixed batches, but no mixup is",
        ),
        (
            ["mixup=rankmixup", "trainer.loss=bce_softmax"],
            "error: trainer.loss=bce_softmax trains on the mixer's soft targets, but RankMixup ranks "
            "confidences: its loss is no criterion of mixed targets; use trainer.loss=ce",
        ),
        (
            ["mixup=regmixup", "mixup.eta=0.5", "trainer.loss=bce_softmax"],
            "error: trainer.loss=bce_softmax trains on the mixer's soft targets, but RegMixup weighs its "
            "mixed rows by eta=0.5",
        ),
        (["mixup=mixupe", "mixup.eta=-1"], "error: mixup: eta must be a finite number >= 0, got -1"),
        (
            ["mixup=cmixup"],
            "error: mixup: CMixup mixes regression targets: its labels must be floating values (B,) or "
            "(B, d), got torch.int64 (2,) (class indices: use ManifoldMixup); data=digits has torch.int64 "
            "labels; train it on regression data: data=diabetes model=mlp",
        ),
        (
            ["+model.shortcut=relu"],
            "error: model.shortcut='relu' is not a shortcut; valid: input, activated",
        ),
        (["model=preact_resnet18_nfm", "model.width=0"], "error: model.width must be > 0, got 0"),
        (
            ["+model.width=0.3"],  # 19.2 channels: refused, not rounded
            "error: model: width must be a positive multiple of 1/64 (stages of 64*width, 128*width, ... "
            "channels: 0.25, 0.5, 1, 2), got 0.3",
        ),
        (
            ["data=cifar10", "data.root=/nonexistent"],
            "error: CIFAR-10 not found: /nonexistent/cifar-10-batches-py",
        ),
        (
            ["data=svhn", "data.root=/nonexistent"],
            "error: SVHN not found: /nonexistent/train_32x32.mat is missing",
        ),
        (
            ["data=imagefolder", "data.root=/nonexistent"],
            "error: data=imagefolder: /nonexistent/train is missing (data.train='train' under",
        ),
        (["data=imagefolder", "data.size=0"], "error: data.size must be an integer >= 1, got 0"),
        (["data=cifar10", "data.padding=-2"], "error: data.padding must be an integer >= 0, got -2"),
        (
            ["data=imagefolder", "data.crop=zoom"],
            "error: data.crop='zoom' is not a crop; valid: resized, padded",
        ),
        (["+model.stride=0"], "error: model.stride must be an integer >= 1, got 0"),
        (
            [
                "model._target_=tests.toy_models.TupleBlockNet",
                "allow_targets=[tests.toy_models.*]",
                'mixup.layer="block[1]"',
            ],
            "error: mixup.layer: ManifoldMixup at 'block[1]': its output element [1] is a tensor of "
            "shape (), which has no batch dimension 0",
        ),
        (
            [
                "model._target_=tests.toy_models.TupleBlockNet",
                "allow_targets=[tests.toy_models.*]",
                'mixup.layer="block[2]"',
            ],
            "error: mixup.layer: 'block[2]': its output has no element [2]; its elements: "
            "[0] tensor (2, 4, 8, 8)",
        ),
        (['mixup.layer="layer2["'], "error: mixup: layer spec 'layer2[' is malformed"),
        (
            [
                "model._target_=tests.toy_models.OddOutputsNet",
                "allow_targets=[tests.toy_models.*]",
                "mixup.layer=pooled",
            ],
            "error: mixup.layer: ManifoldMixup at 'pooled': it returned a tensor of shape (4, 8, 8), "
            "whose batch dimension 0 has size 4, but the model's input has a batch of 2",
        ),
        (  # the block's (B, 8, 8, 12) map read as NCHW by convention would be 8x12 on 8x8 digits
            [
                "model._target_=tests.toy_models.PermutedInCodeNet",
                "allow_targets=[tests.toy_models.*]",
                "mixup=cutmix",
                "mixup.layer=block",
            ],
            "error: mixup.layer: CutMix at 'block': PyTorch's convention gives NCHW maps, which makes this "
            "(2, 8, 8, 12) map 8x12, but the model's input is 8x8",
        ),
        (
            ["mixup=cutmix", "mixup.layer=linear"],
            "error: mixup.layer: CutMix at 'linear' needs a (B, C, L), (B, C, H, W) or (B, C, D, H, W) map",
        ),
        (
            ["mixup=cutmix", "mixup.layer=layer4"],
            "error: mixup.layer: CutMix at 'layer4': its 1x1 map is too small to ever paste a box",
        ),
        (
            ["mixup.partners=global"],
            "error: mixup.partners=global draws partners from every rank's batch, but this run has one "
            "process; launch it with torchrun",
        ),
        (
            ["mixup=saliencymix", "mixup.layer=input"],
            "error: mixup: SaliencyMix at 'input' with saliency='activation': the input is mixed before "
            "any layer runs",
        ),
        (
            ["mixup=transmix"],
            "error: mixup.attention: TransMix reads a ViT's attention "
            "('blocks.11.attn'), and PreActResNet has no attention module; train a ViT: "
            "experiment=vit_digits",
        ),
        (
            ["mixup=mixpro"],
            "error: mixup.attention: MixPro reads a ViT's attention",
        ),
        (
            ["mixup=tla"],
            "error: mixup.attention: TLA reads a ViT's attention ('blocks.*.attn'), and "
            "PreActResNet has no attention module; train a ViT: experiment=vit_digits",
        ),
        (
            ["mixup=smmix"],
            "error: mixup.attention: SMMix reads a ViT's attention ('blocks.11.attn'), and "
            "PreActResNet has no attention module; train a ViT: experiment=vit_digits",
        ),
        (
            ["mixup=mergemix"],
            "error: mixup.attention: MergeMix reads a ViT's attention ('blocks.11.attn'), and "
            "PreActResNet has no attention module; train a ViT: experiment=vit_digits",
        ),
        (
            [
                "mixup=transmix",
                "model=timm",
                "model.name=vit_tiny_patch16_224",
                "+model.img_size=8",
                "+model.patch_size=2",
                "mixup.attention=blocks.12.attn",
            ],
            "error: mixup.attention: unknown layer 'blocks.12.attn' in VisionTransformer",
        ),
        (["data.imbalance_ratio=0.5"], "error: data.imbalance_ratio must be in [1, inf], got 0.5"),
        (
            ["data.sampler=weighted"],
            "error: data.sampler='weighted' is not a sampler; valid: random, balanced",
        ),
        (
            ["mixup=remix", "data=diabetes", "model=mlp"],
            "error: mixup.policies.target: Remix needs classes, and data=diabetes has none",
        ),
        (
            ["mixup=balanced", "data=diabetes", "model=mlp"],
            "error: mixup.policies.partners: the mixer mixes with a class-balanced partner batch, and "
            "data=diabetes has no classes",
        ),
        (
            ["mixup=cutmix", "+mixup.policies.lam._target_=mixhook.policies.KernelWarping"],
            "error: mixup.policies: KernelWarping changes lam for each pair, which CutMix cannot take",
        ),
        (
            ["+mixup.policies.lam._target_=mixhook.policies.Remix"],
            "error: mixup.policies.lam: Remix sets the target of a mix, not its lam; put it under "
            "mixup.policies.target",
        ),
        (
            ["+mixup.policies.knob._target_=mixhook.policies.Remix"],
            "error: mixup.policies.knob: 'knob' is not a knob of a mix; valid: partners, lam, target",
        ),
        (["mixup=remix", "mixup.policies.target.kappa=0.5"], "error: mixup.policies.target: kappa must be"),
        (
            ["mixup=decouplemix", "trainer.loss=bce_softmax"],
            "error: trainer.loss=bce_softmax trains on the mixer's soft targets, but DecoupledLoss weights "
            "or adds to its loss",
        ),
        (["mixup=skmixup", "mixup.policies.lam.tau_std=0"], "error: mixup.policies.lam: tau_std must be"),
        (
            ["mixup=regmixup", "+mixup.policies.partners._target_=mixhook.policies.BalancedMixup"],
            "error: mixup.policies: BalancedMixup: RegMixup keeps the clean batch beside its mix",
        ),
        (
            ["mixup=balanced", "probes.layers=[layer1]", "probes.feature_maps=true"],
            "error: probes.feature_maps=true pins a mix of the batch with itself reversed, but the mixer",
        ),
        (
            ["mixup=puzzlemix", "mixup.grids=[2,4,8,16]"],
            "error: mixup.layer: PuzzleMix at 'input': grid side 16 does not fit its 8x8 map (a grid side "
            "must divide 8: [2, 4, 8]); choose grids among those, or grids='auto'",
        ),
        (["mixup=puzzlemix", "mixup.n_labels=4"], "error: mixup: n_labels must be 2 or 3"),
        (
            ["mixup=snapmix", "mixup.classifier=layer4"],
            "error: mixup.classifier: SnapMix: classifier='layer4' is a Sequential; SnapMix needs the "
            "nn.Linear classifier over pooled features",
        ),
        (
            ["mixup=snapmix", "mixup.features=layer3"],
            "error: mixup.features: SnapMix: features='layer3' outputs a tensor of shape (2, 256, 2, 2), but "
            "SnapMix needs the (B, D, h, w) map (or, where the model states it, (B, h, w, D)) whose pooled "
            "D = 512 features",
        ),
        (
            ["mixup=specmix", "mixup.layer=linear"],
            "error: mixup.layer: SpecMix at 'linear' needs a (B, C, H, W) map",
        ),
        (  # CIFAR's 16 pixels on digits' 8x8 images: every sample erased whole
            ["erasing=cutout"],
            "error: erasing.layer: Cutout at 'input': its 16-pixel square covers the whole 8x8 map wherever "
            "it is centred, so every sample would be erased whole; choose a size below 16",
        ),
        (
            ["erasing=random", "erasing.layer=linear"],
            "error: erasing.layer: RandomErasing at 'linear' erases a rectangle of one (B, C, H, W) map, and "
            "the output is a tensor of shape (2, 10)",
        ),
        (
            ["erasing=random", "erasing.p=1.5"],
            "error: erasing: RandomErasing: p must be a probability in [0, 1]",
        ),
        (
            ["erasing=random", "erasing.value=noise"],
            "error: erasing: RandomErasing: value must be 'random', a finite number or one finite number per "
            "channel, got 'noise'",
        ),
        (
            ["data=fashion_mnist", "data.root=/nonexistent/fm"],
            "error: Fashion-MNIST not found (looked in /nonexistent/fm, /nonexistent/fm/FashionMNIST/raw); "
            "get it: apt-get install dataset-fashion-mnist",
        ),
        (["trainer.eval_every=0"], "error: trainer.eval_every must be an integer >= 1, got 0"),
        (
            ["mixup=cutmix", "mixup.tokens=auto"],
            "error: mixup.layer: CutMix at 'input': tokens='auto' but PreActResNet does not state a fixed "
            "patch grid",
        ),
    ],
)
def test_bad_input_gets_one_line_and_a_non_zero_exit_before_training(tmp_path, capsys, overrides, line):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        app.main(config(*overrides), out_dir=str(out))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(line), err
    assert not any((out / name).exists() for name in ("metrics.csv", "summary.json", "last.pt"))


MIXUP_OPTIONS = ", ".join(sorted(p.stem for p in (CONF_DIR / "mixup").glob("*.yaml")))


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["mixup=nosuch"], f"error: mixup=nosuch is not an option of mixup; valid: {MIXUP_OPTIONS}\n"),
        (["-m", "mixup=none,nosuch"], "error: mixup=nosuch is not an option of mixup"),
        (["hydra.run.dir=afile/run"], "error: hydra.run.dir=afile/run cannot be created: "),
        (["hydra.run.dir=/proc/x"], "error: hydra.run.dir=/proc/x cannot be created: "),  # exists, writable
        (["hparams_search=optuna"], "error: hparams_search=optuna runs a sweep: add -m"),  # not one plain job
        (
            ["trainer.epoch=1"],
            "error: trainer.epoch=1: trainer has no key 'epoch'; did you mean trainer.epochs?",
        ),
        (
            ["-m", "trainer.epochs=1,abc"],  # Hydra: a 5-line report, exit 1
            "error: trainer.epochs=abc: Value 'abc' of type 'str' could not be converted to Integer",
        ),
        (
            ["-m", "seed=0,1", "hydra.sweep.dir=afile/sweep"],
            "error: hydra.sweep.dir=afile/sweep cannot be created: ",
        ),
        (  # the key exists in another group
            ["data.batch_size=0"],
            "error: data.batch_size=0: data has no key 'batch_size'; did you mean trainer.batch_size? ",
        ),
        (["trainer.lr=0.1"], "error: trainer.lr=0.1: trainer has no key 'lr'; did you mean optim.lr? "),
        (  # Hydra: a 6-line ConfigKeyError
            ["experiment=verma2019_cifar10_manifold", "data=digits"],
            "error: experiment=verma2019_cifar10_manifold sets data.augment, which data=digits has no key "
            "for: the experiment chooses its own data; leave data=digits out\n",
        ),
        (  # Hydra: 6 lines "Ambiguous value"
            ["mixup.layer=layer1,layer2"],
            "error: mixup.layer=layer1,layer2: a list needs brackets (mixup.layer=[layer1,layer2]); to sweep "
            "over the values, add -m\n",
        ),
        (["mixup=none,input"], "error: mixup=none,input sweeps over mixup: add -m"),
    ],
)
def test_what_hydra_would_reject_gets_one_line_too(tmp_path, monkeypatch, overrides, line):
    (tmp_path / "afile").write_text("a file, not a directory")
    monkeypatch.chdir(tmp_path)  # where train.py would run
    assert f"error: {check_command_line(overrides, str(CONF_DIR))}\n".startswith(line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # the checks created nothing


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.epoch=1"],
        ["-m", "trainer.epochs=1,abc"],
        ["experiment=verma2019_cifar10_manifold", "data=digits"],
        ["mixup.layer=layer1,layer2"],
    ],
)
@pytest.mark.process
def test_train_py_says_it_in_one_line_and_exits_2_before_hydra_starts(tmp_path, overrides):
    result = run_cli(*overrides, cwd=tmp_path)
    assert result.returncode == 2
    line = f"error: {check_command_line(overrides, str(CONF_DIR))}\n"
    assert result.stderr == line and result.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no outputs/ or multirun/ directory


def test_an_unwritable_run_directory_is_refused_by_the_app_too(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as info:
        app.main(config(), out_dir=str(tmp_path / "afile" / "run"))
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith(
        f"error: the run directory {tmp_path / 'afile' / 'run'} cannot be written"
    )


def test_a_text_file_as_the_checkpoint_to_resume_is_refused_and_kept(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "last.pt").write_text("hello, not a checkpoint\n")
    with pytest.raises(SystemExit) as info:
        app.main(config("trainer.resume=auto"), out_dir=str(out))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: trainer.resume: {out / 'last.pt'} cannot be read")
    assert (out / "last.pt").read_text() == "hello, not a checkpoint\n"
    assert not (out / "summary.json").exists()


@pytest.mark.slow
def test_a_last_batch_of_one_sample_trains(tmp_path):
    out = tmp_path / "run"  # 129 = 2 * 64 + 1 and 8x8 digits: layer4's BatchNorm sees 1 value per channel
    cfg = config("data.train_size=129", "trainer.epochs=1", "trainer.progress_bar=false")
    app.main(cfg, out_dir=str(out))
    assert json.loads((out / "summary.json").read_text())["epochs"] == 1


@pytest.mark.slow
def test_batch_size_1_while_mixing_trains_where_the_model_can(tmp_path):
    write_cifar(tmp_path / "cifar", "cifar10", per_file=3)
    out = tmp_path / "run"
    cfg = config(
        "data=cifar10", f"data.root={tmp_path / 'cifar'}", "data.num_workers=0", "trainer.batch_size=1",
        "trainer.epochs=1", "trainer.progress_bar=false", "mixup.layer=[input,layer1,layer2]",
    )  # fmt: skip
    acc = app.main(cfg, out_dir=str(out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_acc"] == acc and summary["epochs"] == 1


def test_a_search_is_accepted_in_either_multirun_form():

    for flag in ("-m", "--multirun", "hydra.mode=MULTIRUN"):
        assert check_command_line([flag, "hparams_search=optuna"], str(CONF_DIR)) is None
    assert check_command_line(["hparams_search=optuna"], str(CONF_DIR)).startswith(
        "hparams_search=optuna runs a sweep: add -m"
    )


@pytest.mark.slow
def test_a_misspelled_key_is_named_with_the_closest_valid_one():
    def check(*argv):
        return check_command_line(list(argv), str(CONF_DIR))

    assert check("mixup.alpa=0.3").startswith(
        "mixup.alpa=0.3: mixup has no key 'alpa'; did you mean mixup.alpha?"
    )
    assert check("seedd=1").startswith(
        "seedd=1: the config has no key 'seedd'; did you mean seed? valid: allow_targets, data,"
    )
    # the keys of the group option chosen on the same command line (CutMix has no grid)
    assert check("mixup=cutmix", "mixup.grid=2") == (
        "mixup.grid=2: mixup has no key 'grid'; valid: _target_, alpha, layer, mode, prefix, prob, rounding, "
        "tokens"
    )
    assert check("-m", "mixup=cutmix,fmix", "mixup.mode=elem").startswith("mixup.mode=elem: mixup has no")
    # Hydra composes a sweep's default option first: a key only the swept options have needs ++
    assert check("-m", "mixup=saliencymix,attentivecutmix", "mixup.saliency=gradient").endswith(
        "Hydra first composes the default mixup, so set a key that only some options have with "
        "++mixup.saliency=gradient"
    )
    assert check("-m", "mixup=saliencymix,attentivecutmix", "++mixup.saliency=gradient") is None
    assert check("-m", "mixup=cutmix,fmix", "mixup.layer=layer1") is None
    for fine in (
        ["mixup=nfm", "mixup.add_noise=0.1"],
        ["-m", "mixup.alpha=0.2,0.4", "trainer.epochs=1"],
        ["grad_scale.layer=layer1", "+extra=1", "hydra.job.chdir=false"],
        ["mixup=none"],
        ["experiment=verma2019_cifar10_manifold", "trainer.epochs=1"],
    ):
        assert check(*fine) is None, fine


@pytest.mark.slow
def test_a_value_of_the_wrong_type_is_named_before_hydra_starts():
    def check(*argv):
        return check_command_line(list(argv), str(CONF_DIR))

    assert check("trainer.epochs=abc") == (
        "trainer.epochs=abc: Value 'abc' of type 'str' could not be converted to Integer"
    )
    assert (
        check("trainer.compile=maybe")
        == "trainer.compile=maybe: Value 'maybe' is not a valid bool (type str)"
    )
    assert check("data.test_size=x").startswith("data.test_size=x: Value 'x' of type 'str' could not be")
    assert check("-m", "seed=0,1,x").startswith("seed=x: Value 'x'")  # every value of a sweep
    assert check("data=cifar10", "data.num_workers=two").startswith("data.num_workers=two: Value 'two'")
    for fine in (
        ["trainer.epochs=3", "trainer.precision=bf16", "trainer.resume=auto", "data.train_size=null"],
        ["-m", "seed=range(0,3)", "trainer.epochs=1,2"],
        ["-m", "hparams_search=optuna", "mixup.alpha=interval(0.1,4.0)"],
        ["trainer.epochs=${seed}"],
        ["probes.layers=[layer1,layer2]", "input_scale.factor=[0.5,2.0]"],
    ):
        assert check(*fine) is None, fine


def _check_run_directory(path, times, barrier):
    from mixhook.app.files import make_writable_dir

    barrier.wait()  # (all at once, as torchrun's processes start)
    for _ in range(times):
        make_writable_dir(path)


@pytest.mark.process
@pytest.mark.slow
def test_the_processes_of_a_job_check_one_run_directory_at_once(tmp_path):
    """torchrun's processes check the run directory together: each writes and removes a file of its own
    (with one name for all, a process removed the file another was about to, and a rank of a healthy job
    exited 2 saying the directory could not be written)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")  # (the property: several processes at once)
    barrier = context.Barrier(4)
    workers = [
        context.Process(target=_check_run_directory, args=(tmp_path / "run", 2000, barrier)) for _ in range(4)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    assert list((tmp_path / "run").iterdir()) == []

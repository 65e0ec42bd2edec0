"""Paper experiment configs: each composes to exactly the paper's recipe and figure, builds on real
CIFAR-format files, and a real multirun over two of them reports paper beside measured."""

import csv
import json

import pytest
import torch
from omegaconf import OmegaConf

from harness.app_runs import config, run_app
from mixhook import (
    AutoMix,
    CutMix,
    ManifoldMixup,
    MixupE,
    NoisyFeatureMixup,
    OneOf,
    RandomErasing,
    RankMixup,
    RegMixup,
    SAMix,
)
from mixhook.app import CONF_DIR
from mixhook.app import run as app
from tests.conftest import write_cifar, write_idx

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))

VERMA = {  # Verma et al. 2019, Appendix C, and the authors' code where the paper is silent
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4,
              "nesterov": True},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [400, 800], "gamma": 0.1},
    "trainer": {"epochs": 1200, "batch_size": 100, "loss": "bce_softmax"},
}  # fmt: skip
VERMA_SVHN = {  # the authors' README SVHN commands and code; the rest as their CIFAR recipe
    **VERMA,
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [500, 1000, 1500],
                  "gamma": 0.1},
    "trainer": {"epochs": 2000, "batch_size": 100, "loss": "bce_softmax"},
}  # fmt: skip
VERMA_TINY = {  # the authors' README Tiny-ImageNet commands and code; the rest as their CIFAR recipe
    **VERMA,
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [1000, 1500],
                  "gamma": 0.1},
    "trainer": {"epochs": 2000, "batch_size": 100, "loss": "bce_softmax"},
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
YUN_IMAGENET = {  # Yun et al. 2019: the authors' ImageNet command and code (per process: 256 over 4)
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4,
              "nesterov": True},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [75, 150, 225],
                  "gamma": 0.1},
    "trainer": {"epochs": 300, "batch_size": 64, "loss": "ce"},
}  # fmt: skip
ZHANG_IMAGENET = {  # Zhang et al. 2018, Section 3.1; the authors' CIFAR code where it is silent (per process)
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.4, "momentum": 0.9, "weight_decay": 1e-4,
              "nesterov": False},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [30, 60, 80],
                  "gamma": 0.1},
    "trainer": {"epochs": 90, "batch_size": 128, "loss": "ce", "warmup_epochs": 5,
                "warmup_start_factor": 0.25},
}  # fmt: skip
FARAMARZI = {  # the PatchUp authors' README command and code (chandar-lab/PatchUp)
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4,
              "nesterov": True},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [500, 1000, 1500],
                  "gamma": 0.1},
    "trainer": {"epochs": 2000, "batch_size": 100, "loss": "bce_softmax", "mixed_loss_weight": 2.0},
}  # fmt: skip
LIM = {  # the NFM authors' README command and code (erichson/NFM): the decay one epoch after the code's list
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4,
              "nesterov": False},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [101, 151, 181],
                  "gamma": 0.1},
    "trainer": {"epochs": 200, "batch_size": 128, "loss": "ce", "mixed_loss_weight": 1.0},
}  # fmt: skip
PINTO = {  # the RegMixup authors' commands.sh and code (FrancescoPinto/RegMixup)
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4,
              "nesterov": True},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [150, 250], "gamma": 0.1},
    "trainer": {"epochs": 350, "batch_size": 128, "loss": "ce"},
}  # fmt: skip
NOH = {  # the RankMixup authors' README command and configs (cvlab-yonsei/RankMixup)
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4,
              "nesterov": False},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [80, 120], "gamma": 0.1},
    "trainer": {"epochs": 200, "batch_size": 128, "loss": "ce"},
}  # fmt: skip
ZOU = {  # the MixupE authors' README command and code (oneHuster/MixupE)
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4,
              "nesterov": True},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [300, 600], "gamma": 0.1},
    "trainer": {"epochs": 800, "batch_size": 100, "loss": "ce"},
}  # fmt: skip
CAO = {  # the LDAM-DRW code's long-tailed CIFAR recipe (kaidic/LDAM-DRW), its CE baseline
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 2e-4,
              "nesterov": False},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [160, 180],
                  "gamma": 0.01},
    "trainer": {"epochs": 200, "batch_size": 128, "loss": "ce", "warmup_epochs": 5,
                "warmup_start_factor": 0.2},
}  # fmt: skip
OPENMIXUP = {  # OpenMixup's CIFAR-100 AutoMix and SAMix configs (Westlake-AI/openmixup, r18_*_mlr5e_2.py)
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4,
              "nesterov": False},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.CosineAnnealingLR", "eta_min": 0.05},
    "trainer": {"epochs": 400, "batch_size": 100, "loss": "ce"},
}  # fmt: skip
ZHONG = {  # Random Erasing's Fashion-MNIST script (zhunzhong07/Random-Erasing, fashionmnist.py)
    "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4,
              "nesterov": False},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.MultiStepLR", "milestones": [150, 225], "gamma": 0.1},
    "trainer": {"epochs": 300, "batch_size": 128, "loss": "ce"},
}  # fmt: skip
AUTOMIX = {"_target_": "mixhook.AutoMix", "layer": "input", "features": "layer3", "alpha": 2.0,
           "momentum": 0.999, "end_momentum": 0.999999, "mask_loss": 0.1, "mask_loss_mode": "L1",
           "mask_margin": 0.1, "lam_margin": 0.08, "mask_adjust": 0.0, "upsampling": "nearest",
           "clean_weight": 1.0}  # fmt: skip
SAMIX = {**AUTOMIX, "_target_": "mixhook.SAMix", "mask_loss_mode": "L1+Variance", "upsampling": "bilinear"}
REMIX = {"_target_": "mixhook.ManifoldMixup", "layer": "input", "alpha": 1.0,
         "policies": {"target": {"_target_": "mixhook.policies.Remix", "kappa": 3.0,
                                 "tau": 0.5}}}  # fmt: skip
RESNET32 = {"_target_": "mixhook.app.models.ResNet32"}
CUTMIX = {"_target_": "mixhook.CutMix", "layer": "input", "alpha": 1.0, "prob": 0.5}
MANIFOLD = {"_target_": "mixhook.ManifoldMixup", "layer": ["input", "layer1", "layer2"], "alpha": 2.0}
INPUT = {"_target_": "mixhook.ManifoldMixup", "layer": "input", "alpha": 1.0}


def patchup(mode, gamma, prob):  # models/preresnet.py's k in {0, 1, 2}: CutMix at the input, PatchUp after 2
    return {
        "_target_": "mixhook.OneOf",
        "mixers": [
            {"_target_": "mixhook.CutMix", "layer": "input", "alpha": 1.0, "prob": prob},
            {"_target_": "mixhook.PatchUp", "layer": ["conv1", "layer1"], "block_size": 7, "gamma": gamma,
             "mode": mode, "alpha": 2.0, "prob": prob},
        ],
        "p": [1 / 3, 2 / 3],
    }  # fmt: skip


NFM = {"_target_": "mixhook.NoisyFeatureMixup", "layer": ["input", "layer1", "layer2", "layer3"],
       "alpha": 1.0, "add_noise": 0.4, "mult_noise": 0.2, "prob": 1.0}  # fmt: skip
PREACT = {"_target_": "mixhook.app.models.PreActResNet18"}
RESNET50 = {"_target_": "mixhook.app.models.torchvision_model", "name": "resnet50"}
NFM_NET = {**PREACT, "shortcut": "activated", "width": 1}


def resnet(depth: int) -> dict:  # the Random Erasing code's CIFAR ResNet (projection shortcuts)
    return {"_target_": "mixhook.app.models.CifarResNet", "depth": depth, "shortcut": "projection"}


# name: (recipe, data, mixup keys, paper test error, its std[, model])
EXPECTED = {
    "verma2019_cifar10_none": (VERMA, "cifar10", {}, 4.83, 0.066),
    "verma2019_cifar10_input": (VERMA, "cifar10", INPUT, 3.82, 0.048),
    "verma2019_cifar10_manifold": (VERMA, "cifar10", MANIFOLD, 2.95, 0.046),
    "verma2019_cifar100_none": (VERMA, "cifar100", {}, 24.01, 0.376),
    "verma2019_cifar100_input": (VERMA, "cifar100", INPUT, 22.11, 0.424),
    "verma2019_cifar100_manifold": (VERMA, "cifar100", MANIFOLD, 20.34, 0.525),
    "verma2019_svhn_none": (VERMA_SVHN, "svhn", {}, None, None),
    "verma2019_svhn_input": (VERMA_SVHN, "svhn", INPUT, None, None),
    "verma2019_svhn_manifold": (VERMA_SVHN, "svhn", MANIFOLD, None, None),
    "verma2019_tinyimagenet_none": (VERMA_TINY, "imagefolder", {}, None, None, {**PREACT, "stride": 2}),
    "verma2019_tinyimagenet_input": (
        VERMA_TINY, "imagefolder", {**INPUT, "alpha": 0.2}, None, None, {**PREACT, "stride": 2}
    ),
    "verma2019_tinyimagenet_manifold": (
        VERMA_TINY, "imagefolder", {**MANIFOLD, "alpha": 0.2}, None, None, {**PREACT, "stride": 2}
    ),
    "zhang2018_cifar10_erm": (ZHANG, "cifar10", {}, 5.6, None),
    "zhang2018_cifar10_mixup": (ZHANG, "cifar10", INPUT, 4.2, None),
    "zhang2018_cifar100_mixup": (ZHANG, "cifar100", INPUT, 21.1, None),
    "zhang2018_imagenet_mixup": (
        ZHANG_IMAGENET, "imagefolder", {**INPUT, "alpha": 0.2}, None, None, RESNET50
    ),
    "yun2019_cifar100_cutmix": (YUN, "cifar100", CUTMIX, None, None),
    "yun2019_imagenet_cutmix": (YUN_IMAGENET, "imagefolder", {**CUTMIX, "prob": 1.0}, 21.40, None, RESNET50),
    "faramarzi2022_cifar10_patchup_soft": (FARAMARZI, "cifar10", patchup("soft", 0.75, 1.0), None, None),
    "faramarzi2022_cifar10_patchup_hard": (FARAMARZI, "cifar10", patchup("hard", 0.5, 0.7), None, None),
    "faramarzi2022_cifar100_patchup_soft": (FARAMARZI, "cifar100", patchup("soft", 0.75, 1.0), None, None),
    "faramarzi2022_cifar100_patchup_hard": (FARAMARZI, "cifar100", patchup("hard", 0.5, 0.7), None, None),
    "lim2022_cifar10_nfm": (LIM, "cifar10", NFM, None, None, NFM_NET),
    "lim2022_cifar100_nfm": (LIM, "cifar100", NFM, None, None, {**NFM_NET, "width": 2}),
    "pinto2022_cifar10_regmixup": (PINTO, "cifar10", {"_target_": "mixhook.RegMixup", "layer": "input",
                                   "alpha": 20.0, "eta": 1.0}, None, None),
    "pinto2022_cifar100_regmixup": (PINTO, "cifar100", {"_target_": "mixhook.RegMixup", "layer": "input",
                                    "alpha": 10.0, "eta": 1.0}, None, None),
    "noh2023_cifar10_rankmixup": (NOH, "cifar10", {"_target_": "mixhook.RankMixup", "layer": "input",
                                  "alpha": 2.0, "margin": 2.0, "weight": 0.1}, None, None),
    "zou2023_cifar100_mixupe": (ZOU, "cifar100", {"_target_": "mixhook.MixupE", "layer": "input",
                                "alpha": 2.0, "eta": 0.001, "threshold": 1.0}, None, None),
    "cao2019_cifar10_lt_erm": (CAO, "cifar10", {}, None, None, RESNET32),
    "cao2019_cifar100_lt_erm": (CAO, "cifar100", {}, None, None, RESNET32),
    "chou2020_cifar10_lt_remix": (CAO, "cifar10", REMIX, None, None, RESNET32),
    "chou2020_cifar100_lt_remix": (CAO, "cifar100", REMIX, None, None, RESNET32),
    "liu2022_cifar100_automix": (OPENMIXUP, "cifar100", AUTOMIX, None, None),
    "li2021_cifar100_samix": (OPENMIXUP, "cifar100", SAMIX, None, None),
    "zhong2020_fashion_mnist_resnet20": (ZHONG, "fashion_mnist", {}, 4.39, None, resnet(20)),
    "zhong2020_fashion_mnist_resnet20_erasing": (ZHONG, "fashion_mnist", {}, 4.02, None, resnet(20)),
    "zhong2020_fashion_mnist_resnet32": (ZHONG, "fashion_mnist", {}, 4.16, None, resnet(32)),
    "zhong2020_fashion_mnist_resnet32_erasing": (ZHONG, "fashion_mnist", {}, 3.80, None, resnet(32)),
    "clanuwat2018_kmnist_none": (VERMA, "kmnist", {}, 2.18, None),
    "clanuwat2018_kmnist_input": (VERMA, "kmnist", INPUT, 1.59, None),
    "clanuwat2018_kmnist_manifold": (VERMA, "kmnist", MANIFOLD, 1.17, None),
    "clanuwat2018_mnist_none": (VERMA, "mnist", {}, 0.44, None),
    "clanuwat2018_mnist_input": (VERMA, "mnist", INPUT, 0.46, None),
    "clanuwat2018_mnist_manifold": (VERMA, "mnist", MANIFOLD, 0.46, None),
}  # fmt: skip
ERASING = {  # the Random Erasing recipes' hook, with the values of the authors' Fashion-MNIST script
    "_target_": "mixhook.RandomErasing", "layer": "input", "p": 0.5, "scale": [0.02, 0.4],
    "ratio": [0.3, 1 / 0.3], "value": [0.4914], "aspect": "uniform", "attempts": 100,
}  # fmt: skip
REPOSITORIES = {
    "verma2019": "vikasverma1077/manifold_mixup at 870ef77",  # (SVHN; the CIFAR rows carry figures)
    "faramarzi2022": "chandar-lab/PatchUp at 31133f3",
    "lim2022": "erichson/NFM at ed22d5d",
    "pinto2022": "FrancescoPinto/RegMixup at fd78465",
    "noh2023": "cvlab-yonsei/RankMixup at e5dc77f",
    "zou2023": "oneHuster/MixupE at 64ba406",
    "cao2019": "kaidic/LDAM-DRW at 2536330",
    "chou2020": "kaidic/LDAM-DRW at 2536330",  # (Remix has no code: the recipe is LDAM-DRW's)
}
UNVERIFIED = [name for name in EXPECTED if name.startswith(tuple(REPOSITORIES)) and EXPECTED[name][3] is None]


# Recipes that are no paper's: name -> what they compose to (docs/configs.md shows them train)
RECIPES = {
    "fashion_mnist_study": {  # docs/fashion_mnist_study: its setting
        "model": {"_target_": "mixhook.app.models.PreActResNet18", "width": 0.25, "stride": 2},
        "optim": {"_target_": "torch.optim.SGD", "lr": 0.1},
        "trainer": {"epochs": 12, "batch_size": 128, "eval_every": 12, "threads": 1},
        "data": {"name": "fashion_mnist", "per_class": 1000, "padding": 0, "flip": True},
    },
    "vit_digits": {
        "model": {"_target_": "mixhook.app.models.timm_model", "name": "vit_tiny_patch16_224", "img_size": 8,
                  "patch_size": 2},
        "optim": {"_target_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.05},
        "scheduler": {"_target_": "torch.optim.lr_scheduler.CosineAnnealingLR", "T_max": 15},
        "trainer": {"warmup_epochs": 3, "epochs": 15},
        "data": {"name": "digits"},
    },
}  # fmt: skip


def test_every_experiment_config_is_checked_here():
    assert EXPERIMENTS == sorted([*EXPECTED, *RECIPES])


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_sets_what_it_says_keeps_the_mixup_chosen_and_attaches_no_paper(name):
    cfg = OmegaConf.to_container(config(f"experiment={name}", "mixup=transmix"), resolve=True)
    for group, values in RECIPES[name].items():
        assert {k: cfg[group][k] for k in values} == values, group
    assert cfg["paper"] is None and cfg["mixup"]["_target_"] == "mixhook.TransMix"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_experiment_sets_the_papers_hyperparameters_and_figure(name):
    recipe, data, mixup, value, std, *model = EXPECTED[name]
    cfg = OmegaConf.to_container(config(f"experiment={name}"), resolve=True)
    assert cfg["data"]["name"] == data and cfg["data"]["augment"] is True
    assert cfg["model"] == (model[0] if model else PREACT)
    for group in ("optim", "scheduler", "trainer"):
        assert {k: cfg[group][k] for k in recipe[group]} == recipe[group]
    assert {k: cfg["mixup"][k] for k in mixup} == mixup and (mixup or cfg["mixup"] == {})
    assert cfg["erasing"] == (ERASING if name.endswith("_erasing") else {})
    assert cfg["paper"]["metric"] == "test_error"
    assert cfg["paper"].get("value") == value and cfg["paper"].get("std") == std
    papers = (
        "Verma et al. 2019",
        "Zhang et al. 2018",
        "Yun et al. 2019",
        "Faramarzi et al. 2022",
        "Lim et al.",
        "Pinto et al. 2022",
        "Noh et al. 2023",
        "Zou et al. 2023",
        "Cao et al. 2019",
        "Chou et al. 2020",
        "Liu et al. 2022",
        "Li et al. 2021",
        "Zhong et al. 2020",
        "Clanuwat et al. 2018",
    )
    assert cfg["paper"]["source"].startswith(papers)


@pytest.mark.parametrize("name", UNVERIFIED)
def test_configs_from_the_authors_code_name_it_say_what_they_keep_and_drop_and_attach_no_unchecked_figure(
    name,
):
    paper = OmegaConf.to_container(config(f"experiment={name}").paper)
    assert "value" not in paper and paper["figure"].startswith("not attached")
    repository = REPOSITORIES[name.split("_")[0]]
    assert repository in paper["code"] and paper["kept"] and paper["dropped"]
    assert all(":" in line for line in paper["kept"])  # each with its source file:line


def test_the_cutmix_experiment_says_its_model_is_a_substitute_and_carries_no_figure():
    paper = config("experiment=yun2019_cifar100_cutmix").paper
    assert "value" not in paper and "PyramidNet-200" in paper.substitute


def test_command_line_overrides_win_over_the_experiment():
    cfg = config("experiment=verma2019_cifar10_manifold", "trainer.epochs=3", "trainer.loss=ce")
    assert cfg.trainer.epochs == 3 and cfg.trainer.loss == "ce" and cfg.scheduler.milestones == [400, 800]


@pytest.mark.parametrize("name", sorted(n for n, e in EXPECTED.items() if e[1].startswith("cifar")))
def test_experiment_builds_on_cifar_format_files(tmp_path, name):
    recipe, data, mixup, *_, model = (*EXPECTED[name], PREACT)[:6]
    per_file = 200 if model == RESNET32 else 4  # (a long tail of 100 classes needs 100 images at least)
    written = write_cifar(tmp_path, data, per_file=per_file)
    cfg = config(f"experiment={name}", f"data.root={tmp_path}", "data.num_workers=0")
    paper = OmegaConf.to_container(cfg.paper)  # (what the experiment's file says, before the run is built)
    run = app.build(cfg)
    try:
        classes = 10 if data == "cifar10" else 100
        assert run.model.linear.out_features == classes and run.settings.epochs == recipe["trainer"]["epochs"]
        if model == RESNET32:
            assert run.model.linear.in_features == 64 and len(run.model.layer3) == 5
            counts, total = (
                run.data.class_counts,
                sum(len(v[1]) for k, v in written.items() if "test" not in k),
            )
            assert counts[0] == min(total // classes, int((written_labels(written) == 0).sum()))
            assert sum(counts) < total and counts[-1] <= max(total // classes // 100, 1)
        else:
            assert run.model.linear.in_features == 512 * model.get("width", 1)
            assert run.model.shortcut == model.get("shortcut", "input")
        assert run.settings.mixed_loss_weight == recipe["trainer"].get("mixed_loss_weight", 1.0)
        assert run.optimizer.param_groups[0]["nesterov"] == recipe["optim"]["nesterov"]
        assert run.data.train.padding == (2 if name.startswith("verma2019") else 4)  # (the authors' code)
        if "milestones" in recipe["scheduler"]:
            assert run.scheduler.milestones == dict.fromkeys(recipe["scheduler"]["milestones"], 1)
        else:  # (OpenMixup's cosine to min_lr over the run)
            assert run.scheduler.T_max == recipe["trainer"]["epochs"] and run.scheduler.eta_min == 0.05
        kind = {"mixhook.ManifoldMixup": ManifoldMixup, "mixhook.CutMix": CutMix, "mixhook.OneOf": OneOf,
                "mixhook.NoisyFeatureMixup": NoisyFeatureMixup, "mixhook.RegMixup": RegMixup,
                "mixhook.RankMixup": RankMixup, "mixhook.MixupE": MixupE, "mixhook.AutoMix": AutoMix,
                "mixhook.SAMix": SAMix}  # fmt: skip
        expected = kind.get(mixup.get("_target_"))
        assert (run.mixup is None) if expected is None else isinstance(run.mixup, expected)
        assert run.summary["paper"] == paper
    finally:
        if run.mixup is not None:
            run.mixup.remove()


@pytest.mark.parametrize("name", sorted(n for n, e in EXPECTED.items() if "mnist" in e[1]))
def test_the_mnist_family_recipes_build_on_idx_files(tmp_path, name):
    """Random Erasing's Fashion-MNIST recipes and Clanuwat et al.'s KMNIST and MNIST ones, on IDX files the
    test writes: the authors' model (the Random Erasing code's ResNet with projection shortcuts, or
    PreActResNet-18), their normalisation, crop and flip, and the erasing hook with their values."""
    recipe, data, mixup, value, std, *model = EXPECTED[name]
    write_idx(tmp_path, n_train=20, n_test=10)
    cfg = config(f"experiment={name}", f"data.root={tmp_path}")
    run = app.build(cfg)
    try:
        assert (
            run.data.in_channels == 1
            and run.data.image_size == 28
            and run.settings.epochs == recipe["trainer"]["epochs"]
        )
        assert run.data.train.flip is (data == "fashion_mnist")
        if name.startswith("zhong2020"):
            depth = model[0]["depth"]
            assert len(run.model.layer1) == (depth - 2) // 6 and run.model.layer2[0].downsample is not None
            assert run.data.normalization == ([0.1307], [0.3081]) and run.data.train.padding == 4
        else:
            assert run.model.linear.in_features == 512 and run.data.train.padding == 2
        erasing = [h for h in run.hooks if isinstance(h, RandomErasing)]
        if name.endswith("_erasing"):
            (hook,) = erasing
            assert (hook.p, hook.scale, hook.ratio, hook.value) == (
                0.5,
                (0.02, 0.4),
                (0.3, 1 / 0.3),
                (0.4914,),
            )
            assert hook.aspect == "uniform" and hook.attempts == 100
        else:
            assert not erasing
        assert run.summary["paper"]["value"] == value
    finally:
        for handle in run.handles:
            handle.remove()


def written_labels(written: dict):
    return torch.cat([torch.as_tensor(v[1]) for k, v in written.items() if "test" not in k])


@pytest.mark.slow
def test_cfg_job_prints_the_papers_hyperparameters(tmp_path):
    result = run_app("experiment=verma2019_cifar100_manifold", "--cfg", "job", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.to_container(OmegaConf.create(result.stdout))
    assert printed["scheduler"]["milestones"] == [400, 800] and printed["trainer"]["epochs"] == 1200
    assert printed["paper"]["value"] == 20.34 and printed["data"]["name"] == "cifar100"
    # (--cfg sets Hydra's job config and leaves it set: run_app puts it back, or a later app.main of this
    # worker writes .hydra/ records of this command into its own run directory)
    from hydra.core.hydra_config import HydraConfig

    assert not HydraConfig.initialized()


@pytest.mark.slow
def test_a_multirun_over_paper_experiments_reports_paper_beside_measured(tmp_path):
    write_cifar(tmp_path / "cifar", "cifar10", per_file=8)
    sweep = tmp_path / "sweep"
    # data=cifar10 too: Hydra composes the sweep's base config without the swept experiment, where
    # data is digits and has no data.root
    result = run_app(
        "-m", "experiment=verma2019_cifar10_none,verma2019_cifar10_manifold", "data=cifar10",
        f"data.root={tmp_path / 'cifar'}", "data.num_workers=0", "trainer.epochs=1",
        "trainer.batch_size=8", "trainer.progress_bar=false", "+model.width=0.25", f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
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


def app_step(run, x, y):
    """One step of the app's loop on ``(x, y)`` with ``run``'s model, mixer and loss settings and an lr-1
    SGD: the loss it reports and each parameter's update, which is minus its gradient."""
    import torch

    from mixhook.app.training.loop import Training, train_one_epoch

    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    sgd = torch.optim.SGD(run.model.parameters(), lr=1.0)
    value = train_one_epoch(
        Training(
            run.model, sgd, torch.device("cpu"), run.mixup, progress_bar=False, task=run.task,
            mixed_loss_weight=run.settings.mixed_loss_weight,
        ),
        [(x, y)],
    )  # fmt: skip
    return value, {n: before[n] - p.detach() for n, p in run.model.named_parameters()}


def assert_same_step(value, updates, loss, reference):
    """The app's step (:func:`app_step`) took the reference's loss and gradients (``loss.backward()``
    already run on ``reference``)."""
    import torch

    assert value == pytest.approx(float(loss.detach()), rel=1e-12)
    for n, p in reference.named_parameters():
        torch.testing.assert_close(updates[n], p.grad, rtol=1e-9, atol=1e-12)


# chandar-lab/PatchUp at 31133f3, modules/patchup.py (PatchUp.forward, after the mask is drawn: here
# `holes` is given, as are `indices` and `lam`, so that both sides use the same draw).
def authors_patchup(x, targets, holes, indices, lam, soft):
    mask = 1 - holes
    unchanged = mask * x
    total_feats = x.size(1) * (x.size(2) ** 2)
    total_changed_pixels = holes[0].sum()
    total_changed_portion = total_changed_pixels / total_feats
    total_unchanged_portion = (total_feats - total_changed_pixels) / total_feats
    target_shuffled_onehot = targets[indices]
    if soft:
        target_reweighted = (
            total_unchanged_portion * targets
            + lam * total_changed_portion * targets
            + target_shuffled_onehot * (1 - lam) * total_changed_portion
        )
        patches = holes * x
        patches = patches * lam + patches[indices] * (1 - lam)
        target_b = lam * targets + (1 - lam) * target_shuffled_onehot
    else:
        target_reweighted = total_unchanged_portion * targets + total_changed_portion * target_shuffled_onehot
        patches = holes * x
        patches = patches[indices]
        target_b = targets[indices]
    x = unchanged + patches
    target_a = targets
    return target_a, target_b, target_reweighted, x, total_unchanged_portion


@pytest.mark.parametrize(("name", "k"), [
    ("faramarzi2022_cifar10_patchup_soft", 1), ("faramarzi2022_cifar10_patchup_hard", 2),
    ("faramarzi2022_cifar10_patchup_hard", 0),
])  # fmt: skip
@pytest.mark.slow
def test_the_patchup_recipe_trains_as_the_authors_code_on_the_same_draw(tmp_path, name, k):
    """One training step of the experiment's model, mixer and loss (the app's loop, float64) against the
    authors' forward (models/preresnet.py), mixing (modules/patchup.py, modules/cutmix.py) and loss
    (main.py:256-258, twice the BCE) on the same draw: the same loss and the same gradient."""
    import torch
    import torch.nn.functional as F

    from mixhook.app.models import PreActResNet18

    write_cifar(tmp_path, "cifar10", per_file=4)
    run = app.build(config(f"experiment={name}", f"data.root={tmp_path}", "data.num_workers=0"))
    try:
        model, mix = run.model.double(), run.mixup
        reference = PreActResNet18(num_classes=10).double().train()
        reference.load_state_dict(model.state_dict())
        g = torch.Generator().manual_seed(k)
        x = torch.randn(6, 3, 32, 32, generator=g, dtype=torch.float64)
        y = torch.tensor([0, 3, 3, 7, 1, 9])
        onehot = F.one_hot(y, 10).double()
        indices = torch.tensor([2, 0, 5, 1, 3, 4])
        out = x.clone()
        if k == 0:  # models/preresnet.py:158-163 and modules/cutmix.py (CutMix.apply) with the box given
            bbx1, bby1, bbx2, bby2 = 5, 9, 21, 30
            out[:, :, bbx1:bbx2, bby1:bby2] = out[indices, :, bbx1:bbx2, bby1:bby2]
            portion = 1 - ((bbx2 - bbx1) * (bby2 - bby1) / (out.size()[-1] * out.size()[-2]))
            target_a, target_b = onehot, onehot[indices]
            target_reweighted = portion * target_a + (1.0 - portion) * target_b
            mix.pin(0, box=(bbx1, bbx2, bby1, bby2), index=indices)
        out = reference.conv1(out)
        if k > 0:  # modules/patchup.py: one Bernoulli field per channel, max-pooled into 7x7 blocks
            centres = torch.bernoulli(torch.full((64, 32, 32), 0.02, dtype=torch.float64), generator=g)
            holes = F.max_pool2d(centres.expand(6, -1, -1, -1), 7, 1, 3)
            lam = 0.35
            soft = name.endswith("soft")
            if k == 1:
                target_a, target_b, target_reweighted, out, portion = authors_patchup(
                    out, onehot, holes, indices, lam, soft
                )
            out = reference.layer1(out)
            if k == 2:
                target_a, target_b, target_reweighted, out, portion = authors_patchup(
                    out, onehot, holes, indices, lam, soft
                )
            mix.pin(1, layer="conv1" if k == 1 else "layer1", mask=holes[0], index=indices, lam=lam)
        else:
            out = reference.layer1(out)
        out = reference.layer4(reference.layer3(reference.layer2(out)))
        output = reference.linear(F.avg_pool2d(out, 4).flatten(1))
        # main.py:214-215, 256-258 (loss_params [1, 1])
        bce_loss, softmax = torch.nn.BCELoss(), torch.nn.Softmax(dim=1)
        loss = (
            1 * bce_loss(softmax(output), target_a) * portion
            + bce_loss(softmax(output), target_b) * (1.0 - portion)
            + 1 * bce_loss(softmax(output), target_reweighted)
        )
        loss.backward()

        value, updates = app_step(run, x, y)
        assert mix.chosen is mix.mixers[0 if k == 0 else 1] and mix.last is not None
        assert_same_step(value, updates, loss, reference)
    finally:
        run.mixup.remove()


@pytest.mark.slow
def test_the_nfm_recipe_trains_as_the_authors_code_on_the_same_draw(tmp_path):
    """One training step of lim2022_cifar10_nfm (the app's loop, float64) against the authors' network,
    do_noisy_mixup and mixup_criterion (erichson/NFM: src/cifar_models/preresnet.py, src/noisy_mixup.py)
    on the same draw: mixed after layer2 (k=2), the noise tensors replayed from the mixer's generator."""
    import torch
    import torch.nn.functional as F

    from mixhook.functional import sample_beta
    from tests.app.test_models import AuthorsPreActResNet

    write_cifar(tmp_path, "cifar10", per_file=4)
    run = app.build(config("experiment=lim2022_cifar10_nfm", f"data.root={tmp_path}", "data.num_workers=0"))
    try:
        model, mix = run.model.double(), run.mixup
        theirs = AuthorsPreActResNet([2, 2, 2, 2], num_classes=10).double().train()
        theirs.load_state_dict(model.state_dict())
        g = torch.Generator().manual_seed(3)
        x = torch.randn(5, 3, 32, 32, generator=g, dtype=torch.float64)
        y = torch.tensor([4, 0, 4, 8, 2])
        index, lam = torch.tensor([3, 4, 0, 2, 1]), 0.3
        seen, original = {}, mix.mix

        def spy(leaves, draw):  # the generator state the noise is drawn from
            seen["state"] = draw.generator.get_state()
            return original(leaves, draw)

        mix.mix = spy
        mix.pin(layer="layer2", lam=lam, index=index)
        value, updates = app_step(run, x, y)

        # nfm.py's order: the mult level, the add level, then the noise from a generator seeded by one
        # draw (DeviceNoise): the uniforms, the normals
        replay = torch.Generator().set_state(seen["state"])
        shape = (5, 128, 16, 16)
        b2 = float(sample_beta(2.0, 5.0, replay))
        b1 = float(sample_beta(2.0, 5.0, replay))
        noise = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (), generator=replay)))
        uniform = torch.rand(shape, generator=noise, dtype=torch.float64)
        normal = torch.randn(shape, generator=noise, dtype=torch.float64)
        assert float(mix.last.info["mult_level"]) == pytest.approx(0.2 * b2)
        assert float(mix.last.info["add_level"]) == pytest.approx(0.4 * b1)

        # src/noisy_mixup.py (do_noisy_mixup, _noise) with lam, index and the noise given
        def do_noisy_mixup(x, y, add_noise_level, mult_noise_level):
            mixed_x = lam * x + (1 - lam) * x[index]
            y_a, y_b = y, y[index]
            add_noise = add_noise_level * b1 * normal
            mult_noise = mult_noise_level * b2 * (2 * uniform - 1) + 1
            return mult_noise * mixed_x + add_noise, y_a, y_b, lam

        out = theirs.conv1(x)  # src/cifar_models/preresnet.py forward with k = 2
        for i, block in enumerate(theirs.blocks):
            out = block(out)
            if i + 1 == 2:
                out, targets_a, targets_b, lam_ = do_noisy_mixup(out, y, 0.4, 0.2)
        outputs = theirs.linear(F.avg_pool2d(out, 4).view(5, -1))
        criterion = torch.nn.CrossEntropyLoss()  # train_cifar.py:115, src/noisy_mixup.py mixup_criterion
        loss = lam_ * criterion(outputs, targets_a) + (1 - lam_) * criterion(outputs, targets_b)
        loss.backward()
        assert_same_step(value, updates, loss, theirs)
    finally:
        run.mixup.remove()


def test_a_batch_left_unmixed_keeps_the_plain_loss_under_mixed_loss_weight():
    """main.py:262: a batch the draw leaves unmixed (r >= patchup_prob) trains on the plain BCE, once."""
    import torch
    import torch.nn.functional as F

    from mixhook.app.training.loop import Training, train_one_epoch
    from mixhook.app.training.task import Classification
    from tests.helpers import SmallCNN

    torch.manual_seed(0)
    model, x = SmallCNN().double(), torch.randn(4, 3, 8, 8, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1])
    never = ManifoldMixup("input", prob=0.0)
    with never.attach(model):
        expected = F.binary_cross_entropy(F.softmax(model(x), 1), F.one_hot(y, 5).double())
        sgd = torch.optim.SGD(model.parameters(), lr=0.0)
        value = train_one_epoch(
            Training(
                model, sgd, torch.device("cpu"), never, progress_bar=False,
                task=Classification("bce_softmax"), mixed_loss_weight=2.0,
            ),
            [(x, y)],
        )  # fmt: skip
    assert never.last is None and value == pytest.approx(float(expected.detach()), rel=1e-12)


def imagenet_recipe(root, name: str):
    """The run experiment ``name`` builds on a small JPEG tree in ImageNet's layout under ``root`` (three
    classes; images cut to 32 pixels to keep it quick)."""
    from tests.app.test_data_folders import jpeg_tree

    jpeg_tree(root / "train")
    jpeg_tree(root / "val", per_class=2)
    overrides = [f"experiment={name}", f"data.root={root}", "data.num_workers=0"]
    return app.build(config(*overrides, "data.size=32", "data.resize=32", "trainer.batch_size=4"))


def test_the_imagenet_cutmix_recipe_builds_on_an_image_folder_with_the_authors_pipeline(tmp_path):
    """Yun et al. 2019's ImageNet recipe on a small JPEG tree:
    ResNet-50 with one output per class, Nesterov SGD decayed every 75 epochs, CutMix on every batch at the
    input, and the authors' color augmentation (jitter 0.4, lighting 0.1) in the training pipeline only."""
    run = imagenet_recipe(tmp_path, "yun2019_imagenet_cutmix")
    try:
        assert type(run.model).__name__ == "ResNet" and run.model.fc.out_features == 3
        assert run.optimizer.param_groups[0]["nesterov"] and run.scheduler.milestones == {
            75: 1,
            150: 1,
            225: 1,
        }
        assert isinstance(run.mixup, CutMix) and run.mixup.prob == 1.0 and run.mixup.alpha == 1.0
        steps = [type(t).__name__ for t in run.data.train.dataset.dataset.transform.transforms]
        assert steps == ["RandomResizedCrop", "RandomHorizontalFlip", "ToDtype", "ResNetColor", "Normalize"]
        assert run.summary["paper"]["value"] == 21.40
    finally:
        run.mixup.remove()


def test_the_imagenet_mixup_recipe_warms_up_and_attaches_no_unread_figure(tmp_path):
    """Zhang et al. 2018's ImageNet recipe on a small JPEG tree: ResNet-50, input mixup with alpha 0.2, the
    rate warming up from 0.1 to 0.4 over 5 epochs step by step, then divided by 10 at 30, 60 and 80, the
    plain training pipeline; the paper's figure is named, not quoted."""
    run = imagenet_recipe(tmp_path, "zhang2018_imagenet_mixup")
    try:
        assert type(run.model).__name__ == "ResNet" and run.model.fc.out_features == 3
        assert run.settings.warmup_epochs == 5 and run.settings.warmup_start_factor == 0.25
        assert run.optimizer.param_groups[0]["lr"] == 0.4
        assert run.scheduler.milestones == {30: 1, 60: 1, 80: 1}
        assert isinstance(run.mixup, ManifoldMixup) and run.mixup.layers == ("input",)
        assert run.mixup.alpha == 0.2
        steps = [type(t).__name__ for t in run.data.train.dataset.dataset.transform.transforms]
        assert steps == ["RandomResizedCrop", "RandomHorizontalFlip", "ToDtype", "Normalize"]
        assert run.summary["warmup"] == {"epochs": 5, "start_factor": 0.25}
        paper = run.summary["paper"]
        assert "value" not in paper and paper["figure"].startswith("not attached")
    finally:
        run.mixup.remove()


def test_the_svhn_recipes_build_on_svhn_files_with_the_authors_pipeline(tmp_path):
    """Verma et al. 2019's SVHN rows as the authors' code trains them: at most 7,325 training images of each
    class, a 2-pixel padded crop and never a flip, the normalisation to [-1, 1], 2,000 epochs decayed at
    500, 1,000 and 1,500, Manifold Mixup over {input, layer1, layer2}."""
    from tests.app.test_data_folders import svhn_files

    svhn_files(tmp_path / "svhn", n_train=20)
    overrides = ["experiment=verma2019_svhn_manifold", f"data.root={tmp_path / 'svhn'}"]
    run = app.build(config(*overrides, "data.per_class=1"))  # (the files hold 2 of each class)
    try:
        train = run.data.train
        assert (train.padding, train.flip, train.augment) == (2, False, True)
        assert train.mean.flatten().tolist() == [0.5] * 3 and train.std.flatten().tolist() == [0.5] * 3
        assert torch.bincount(train.labels.cpu(), minlength=10).tolist() == [1] * 10
        assert run.settings.epochs == 2000 and run.scheduler.milestones == {500: 1, 1000: 1, 1500: 1}
        assert isinstance(run.mixup, ManifoldMixup) and run.mixup.layers == ("input", "layer1", "layer2")
        assert run.summary["paper"]["figure"].startswith("not attached")
    finally:
        run.mixup.remove()


def test_the_tiny_imagenet_recipes_build_on_tiny_imagenets_layout_with_the_authors_pipeline(tmp_path):
    """Verma et al. 2019's Tiny-ImageNet rows as the authors' code trains them: 64x64 images cropped from
    their 4-pixel padded copy and flipped, evaluated as they are, normalised to [-1, 1]; PreActResNet-18
    with a stride of 2 in its first convolution; 2,000 epochs decayed at 1,000 and 1,500; alpha 0.2."""
    from tests.app.test_data_folders import jpeg_tree

    jpeg_tree(tmp_path / "train", classes=("n01443537", "n01629819"), nested=True)
    jpeg_tree(tmp_path / "val", classes=("n01443537", "n01629819"), per_class=1)
    run = app.build(config("experiment=verma2019_tinyimagenet_manifold", f"data.root={tmp_path}",
                           "data.num_workers=0"))  # fmt: skip
    try:
        steps = [type(t).__name__ for t in run.data.train.dataset.dataset.transform.transforms]
        assert steps == ["RandomCrop", "RandomHorizontalFlip", "ToDtype", "Normalize"]
        crop, normalize = run.data.train.dataset.dataset.transform.transforms[0::3]
        assert crop.size == (64, 64) and crop.padding == [4, 4, 4, 4]
        assert list(normalize.mean) == [0.5] * 3 and list(normalize.std) == [0.5] * 3
        evaluation = [type(t).__name__ for t in run.data.test.dataset.transform.transforms]
        assert evaluation == ["CenterCrop", "ToDtype", "Normalize"]
        assert run.model.conv1.stride == (2, 2) and run.model.linear.out_features == 2
        assert run.settings.epochs == 2000 and run.scheduler.milestones == {1000: 1, 1500: 1}
        assert isinstance(run.mixup, ManifoldMixup) and run.mixup.alpha == 0.2
        assert run.summary["paper"]["figure"].startswith("not attached")
    finally:
        run.mixup.remove()

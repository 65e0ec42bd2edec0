"""The matrix's methods: one representative configuration of every mixer and policy, the model it is shown
on, and the shipped ``mixup=`` config of the app that trains it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import mixhook
from mixhook import policies

CLASSES = 3


class Cnn(nn.Module):
    """A small image classifier on 8x8 one-channel images (digits' shape): two convolutions, a pooled
    Linear head (SnapMix's ``features``/``classifier``), square maps (PuzzleMix), no batch norm (so the
    distributed replicas train the same function as the replay)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.fc = nn.Linear(6, CLASSES)

    def forward(self, x):
        return self.fc(F.relu(self.conv2(F.relu(self.conv1(x)))).mean((2, 3)))


class Mlp(nn.Module):
    """A regression MLP on 10 features (C-Mixup's)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(10, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)


def vit() -> nn.Module:
    """A tiny timm ViT on 8x8 one-channel images (TransMix's and MixPro's class-token attention)."""
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=CLASSES, img_size=8, patch_size=2, in_chans=1,
        embed_dim=8, depth=2, num_heads=2,
    )  # fmt: skip


MODELS: dict[str, Callable[[], nn.Module]] = {"cnn": Cnn, "mlp": Mlp, "vit": vit}


def model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind]().double().train()


def data(kind: str, n: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples for a model of ``kind``: images with class labels (every class), or features with
    float targets."""
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        x = torch.randn(n, 10, generator=g, dtype=torch.float64)
        return x, x[:, :3].sum(1) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    x = torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64)
    y = torch.arange(n) % CLASSES
    return x, y[torch.randperm(n, generator=g)]


def criterion(kind: str):
    """The per-sample loss the hand loop and every workflow take (its mean is the step's loss)."""
    if kind == "mlp":
        return lambda out, y: F.mse_loss(out, y.to(out.dtype), reduction="none")
    return lambda logits, y: F.cross_entropy(logits, y, reduction="none")


@dataclass(frozen=True)
class Method:
    """A method of the matrix: ``make(prefix)`` builds it (its layers named under ``prefix``: ``"net."``
    inside a LightningModule), on a model of ``kind``; ``app`` is its shipped ``mixup=`` config."""

    name: str
    make: Callable[[str], mixhook.MixingHook]
    kind: str = "cnn"
    app: str | None = None
    where: tuple[str, ...] = ()  # the app's overrides where the default data or model cannot take it

    @property
    def needs_partners(self) -> bool:
        from mixhook.integrations.draws import needs_partner_batch

        return needs_partner_batch(self.make(""))


def _gen(seed: int = 5) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _m(cls, *layers, **kwargs):
    """A maker of ``cls`` at ``layers`` (under the prefix it is given), with a fixed generator."""

    def make(prefix: str):
        named = [f"{prefix}{layer}" if layer != "input" else "input" for layer in layers]
        extra = {
            k: (f"{prefix}{v}" if k in ("features", "classifier", "attention") else v)
            for k, v in kwargs.items()
        }
        return cls(named if len(named) > 1 else named[0], generator=_gen(), **extra)

    return make


def _with(*chosen):
    """ManifoldMixup at the input with these policies (built afresh for each mixer)."""

    def make(prefix: str):
        return mixhook.ManifoldMixup("input", alpha=1.0, generator=_gen()).use(*(p() for p in chosen))

    return make


def _oneof(prefix: str):
    return mixhook.OneOf(
        [mixhook.ManifoldMixup("input", alpha=1.0), mixhook.CutMix("input", alpha=1.0)], generator=_gen()
    )


REGRESSION = ("data=diabetes", "model=mlp")  # what the app's refusals name
VIT = ("model=timm", "model.name=vit_tiny_patch16_224", "+model.img_size=8", "+model.patch_size=2")

METHODS: list[Method] = [
    Method("ManifoldMixup", _m(mixhook.ManifoldMixup, "input", "conv1", alpha=1.0), app="manifold"),
    Method("NoisyFeatureMixup", _m(mixhook.NoisyFeatureMixup, "input", "conv1"), app="nfm"),
    Method("CutMix", _m(mixhook.CutMix, "input"), app="cutmix"),
    Method("OneOf", _oneof, app="mixup_cutmix"),
    Method("FMix", _m(mixhook.FMix, "input"), app="fmix"),
    Method("GridMix", _m(mixhook.GridMix, "input", grid=2), app="gridmix"),
    Method("SmoothMix", _m(mixhook.SmoothMix, "input"), app="smoothmix"),
    Method("ResizeMix", _m(mixhook.ResizeMix, "input"), app="resizemix"),
    Method("TokenMix", _m(mixhook.TokenMix, "input", grid=4), app="tokenmix"),
    Method("PatchUp", _m(mixhook.PatchUp, "conv1", block_size=3), app="patchup"),
    Method("SaliencyMix", _m(mixhook.SaliencyMix, "input", saliency="gradient"), app="saliencymix"),
    Method("AttentiveCutMix", _m(mixhook.AttentiveCutMix, "conv1", grid=4, top_k=3), app="attentivecutmix"),
    Method("PuzzleMix", _m(mixhook.PuzzleMix, "input", grids="auto"), app="puzzlemix"),
    Method("SnapMix", _m(mixhook.SnapMix, "input", features="conv2", classifier="fc"), app="snapmix"),
    Method("SpecMix", _m(mixhook.SpecMix, "input"), app="specmix"),
    Method("AlignMix", _m(mixhook.AlignMix, "conv2", alpha=1.0), app="alignmix"),
    Method("CatchUpMix", _m(mixhook.CatchUpMix, "input", "conv1"), app="catchupmix"),
    Method("RegMixup", _m(mixhook.RegMixup, "input", alpha=1.0), app="regmixup"),
    Method("RankMixup", _m(mixhook.RankMixup, "input", alpha=1.0), app="rankmixup"),
    Method("MixupE", _m(mixhook.MixupE, "input", alpha=1.0), app="mixupe"),
    Method("CMixup", _m(mixhook.CMixup, "input", alpha=1.0), kind="mlp", app="cmixup", where=REGRESSION),
    Method("TransMix", _m(mixhook.TransMix, "input", attention="blocks.1.attn"), "vit", "transmix", VIT),
    Method("MixPro", _m(mixhook.MixPro, "input", attention="blocks.1.attn"), "vit", "mixpro", VIT),
    Method("AutoMix", _m(mixhook.AutoMix, "input", features="conv1"), app="automix"),
    Method("SAMix", _m(mixhook.SAMix, "input", features="conv1"), app="samix"),
    Method("Balanced-MixUp", _with(policies.BalancedMixup), app="balanced"),
    Method("Remix", _with(policies.Remix), app="remix"),
    Method("DecoupledLoss", _with(policies.DecoupledLoss), app="decouplemix"),
    Method("KernelWarping", _with(policies.KernelWarping), app="skmixup"),
    Method("LocalWeights", _with(lambda: policies.LocalWeights(sigma=0.5)), app="localmixup"),
    Method("SaliencyPairing", _with(policies.SaliencyPairing), app="guided_pairing"),
]

BY_NAME = {m.name: m for m in METHODS}

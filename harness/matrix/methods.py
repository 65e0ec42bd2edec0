"""The matrix's methods: one representative configuration of every mixer (its card's example, on the
reference model its card names: :data:`mixhook.engine.card.SHOWN_ON`) and policy, and the ``mixup=`` config
of the app that trains it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import mixhook
from mixhook import policies
from mixhook.engine.card import LAYER_ARGUMENTS, build, catalogue_order
from mixhook.engine.card import METHODS as METHODS_BY_CARD

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
    # hooks that are not mixers, beside the mixer (their layers named under the prefix), and the app's
    # overrides that add them: the erasing rows, each with a mixer at the same input
    beside: Callable[[str], list] | None = None
    app_beside: tuple[str, ...] = ()

    def hooks(self, prefix: str) -> list:
        """The hooks beside the mixer, built afresh (their layers named under ``prefix``)."""
        return [] if self.beside is None else self.beside(prefix)

    @property
    def needs_partners(self) -> bool:
        from mixhook.integrations.draws import needs_partner_batch

        return needs_partner_batch(self.make(""))


def _gen(seed: int = 5) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _m(cls, *layers, **kwargs):
    """A maker of ``cls`` at ``layers`` (under the prefix it is given), with a fixed generator: a
    configuration beside a card's example (tests/steps.py's methods at a hidden layer)."""

    def make(prefix: str):
        named = [f"{prefix}{layer}" if layer != "input" else "input" for layer in layers]
        extra = {k: (f"{prefix}{v}" if k in LAYER_ARGUMENTS else v) for k, v in kwargs.items()}
        return cls(named if len(named) > 1 else named[0], generator=_gen(), **extra)

    return make


def _with(*chosen):
    """ManifoldMixup at the input with these policies (built afresh for each mixer)."""

    def make(prefix: str):
        return mixhook.ManifoldMixup("input", alpha=1.0, generator=_gen()).use(*(p() for p in chosen))

    return make


def _card(name: str, cls: type, config: str) -> Method:
    """The method ``name`` as its card shows it: built from its example on its reference model, with its
    ``mixup=`` config and the app's overrides it names (a new method is in the matrix with its module)."""
    card = cls.card
    return Method(name, lambda prefix: build(cls, prefix, generator=_gen()), card.shown_on, config, card.app)


def methods() -> list[Method]:
    """Every catalogued method (in the catalogue's order, with its first ``mixup=`` config), every policy
    and the erasing hooks beside a mixer, as the matrix shows them."""
    from mixhook.app.methods import configs_of

    configs = configs_of()
    return [
        *(_card(name, METHODS_BY_CARD[name], configs[name][0]) for name in catalogue_order()),
        *POLICIES,
        *ERASING,
    ]


def _sumix(prefix: str):
    """SUMix's loss on input mixup (its uncertainty layer on the classifier, named under ``prefix``)."""
    return mixhook.ManifoldMixup("input", alpha=1.0, generator=_gen()).use(policies.SUMix(f"{prefix}fc"))


POLICIES: list[Method] = [
    Method("Balanced-MixUp", _with(policies.BalancedMixup), app="balanced"),
    Method("Remix", _with(policies.Remix), app="remix"),
    Method("DecoupledLoss", _with(policies.DecoupledLoss), app="decouplemix"),
    Method("SUMix", _sumix, app="sumix"),
    Method("KernelWarping", _with(policies.KernelWarping), app="skmixup"),
    Method("LocalWeights", _with(lambda: policies.LocalWeights(sigma=0.5)), app="localmixup"),
    Method("SaliencyPairing", _with(policies.SaliencyPairing), app="guided_pairing"),
]


def _erasing(cls, **kwargs):
    """``cls`` (a hook that is not a mixer) at the input and at ``conv1``, named under the prefix it is
    given, with a fixed generator: erased before input mixup mixes the same input."""

    def make(prefix: str) -> list:
        return [cls(["input", f"{prefix}conv1"], generator=_gen(6), **kwargs)]

    return make


ERASING: list[Method] = [  # (input mixup at the same input: erased, then mixed)
    Method("RandomErasing", _with(), app="input", beside=_erasing(mixhook.RandomErasing, p=0.75),
           app_beside=("erasing=random", "erasing.layer=[input,layer1]")),
    Method("Cutout", _with(), app="input", beside=_erasing(mixhook.Cutout, size=3, holes=2),
           app_beside=("erasing=cutout", "erasing.size=0.5", "erasing.layer=[input,layer1]")),
]  # fmt: skip

METHODS: list[Method] = methods()
BY_NAME = {m.name: m for m in METHODS}

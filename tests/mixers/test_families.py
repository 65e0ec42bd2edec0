"""Issue 97: what a method is beside its catalogue family (its card's ``traits``: a region method on a ViT's
tokens, one that reads attention, one that reads pixels, one that takes class counts, clean-and-mixed,
several samples per row) is stated once, on its card; every list of such methods is derived from the cards.

A synthetic method of each trait, written from docs/adding-a-mixer.md's words alone (its card table and its
extension points), is picked up by every place that lists or serves that trait, with no other file edited:
the selectors the tests and benchmarks build their lists with, the ViT benchmark's methods, the app's
data it is given (mean/std, class counts) and its refusals (attention on a model without any, a two-label
policy on a mix of several). A card its class contradicts is refused in one line."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.cases import methods as method_cases
from benchmarks.cases import vit
from mixhook import Card, CutMix, ManifoldMixup, Mixed, Mixer, RegionMixer, blend, recompute
from mixhook.app import build as app_build
from mixhook.app import preflight
from mixhook.app.data import Data
from mixhook.app.errors import ConfigError
from mixhook.engine.card import METHODS, TRAITS, build, methods_with, traits_of, unregister
from mixhook.layers import resolve_layer
from mixhook.mixers.transmix import ReadsAttention
from mixhook.policies import Remix


def _card(family: str = "blend", **more) -> Card:
    return Card(
        paper="Nobody et al. 2026",
        mixes="a test's",
        where="any map",
        family=family,
        signature=f"{more.pop('signature', 'X(layer)')}",
        hook="forward",
        commands="`mixup=x`",
        details="a synthetic method of one trait",
        **more,
    )


def _blend(leaves, draw) -> Mixed:
    return Mixed({leaves[0].path: blend(leaves[0].tensor, draw.lam, draw.index)})


@contextlib.contextmanager
def defined():
    """The synthetic methods defined inside it (each registers as it is defined), taken out after."""
    before = set(METHODS)
    try:
        yield
    finally:
        for name in set(METHODS) - before:
            unregister(name)


def _methods() -> dict:
    """One synthetic method per trait, as the page says to write each."""

    class TokenHalves(RegionMixer):  # a region method: RegionMixer takes tokens=
        card = _card("region", traits=("tokens",), signature="TokenHalves(layer, alpha=1.0)")

        def mix(self, leaves, draw):
            h = leaves[0].tensor
            own = torch.zeros(h.shape[2:], dtype=h.dtype)
            own[: h.shape[2] // 2] = 1
            return Mixed({leaves[0].path: own * h + (1 - own) * h[draw.index]}, lam=own.double().mean())

    class ReadsHeads(ReadsAttention, Mixer):  # the page's attention method: an `attention` argument
        card = _card(
            "attention", traits=("attention",), shown_on="vit", signature="ReadsHeads(layer, attention)",
            example={"layer": "input", "attention": "blocks.1.attn"},
        )  # fmt: skip

        def __init__(self, layer, attention, alpha=1.0, generator=None):
            super().__init__(layer, alpha, generator=generator)
            self.attention = attention

        def _register(self, model, modules, handles):
            _, module = resolve_layer(model, self.attention, "attention")
            super()._register(model, modules, handles)
            handles.append(module.register_forward_hook(recompute.hook(self._recorder), with_kwargs=True))

        def mix(self, leaves, draw):
            return _blend(leaves, draw)

    class Brightness(Mixer):  # reads pixel values: the input's normalisation as mean= and std=
        card = _card(traits=("pixels",), signature="Brightness(layer, mean=None, std=None)")

        def __init__(self, layer="input", mean=None, std=None, alpha=1.0, generator=None):
            super().__init__(layer, alpha, generator=generator)
            self.mean, self.std = mean, std

        def mix(self, leaves, draw):
            return _blend(leaves, draw)

    class Counted(Mixer):  # the training set's class counts, as counts=
        card = _card(traits=("class_counts",), signature="Counted(layer, counts=None)")

        def __init__(self, layer, counts=None, alpha=1.0, generator=None):
            super().__init__(layer, alpha, generator=generator)
            self.counts = counts

        def mix(self, leaves, draw):
            return _blend(leaves, draw)

    class CleanToo(ManifoldMixup):  # trained on the clean batch beside its mix: keeps_clean, clean_loss
        card = _card("clean", traits=("clean",), signature="CleanToo(layer)")
        keeps_clean = True

        def clean_loss(self, criterion, clean, mixed, target, last):
            return criterion(clean, target) + self.mixed_loss(criterion, mixed, target, last)

    class Triples(Mixer):  # three samples in a row: samples_per_row and Mixed.mixture
        card = _card(traits=("several",), signature="Triples(layer)")
        samples_per_row = 3

        def __init__(self, layer, alpha=1.0, generator=None):
            super().__init__(layer, alpha, generator=generator)

        def mix(self, leaves, draw):
            h, n = leaves[0].tensor, leaves[0].tensor.shape[0]
            second = torch.roll(draw.index, 1)
            indices = torch.stack([torch.arange(n), draw.index, second])
            weights = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
            mixed = 0.5 * h + 0.25 * h[draw.index] + 0.25 * h[second]
            return Mixed({leaves[0].path: mixed}, mixture=(indices, weights))

    return {
        "tokens": TokenHalves, "attention": ReadsHeads, "pixels": Brightness, "class_counts": Counted,
        "clean": CleanToo, "several": Triples,
    }  # fmt: skip


def _data(**facts) -> Data:
    return Data("written", None, None, in_channels=1, num_classes=3, image_size=8, **facts)


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.fc = nn.Conv2d(1, 4, 3, padding=1), nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.conv1(x).mean((2, 3)))


def test_every_trait_has_a_synthetic_method_written_from_the_page():
    with defined():
        assert set(_methods()) == set(TRAITS)


def test_a_synthetic_method_of_each_trait_is_in_the_lists_of_its_trait_and_no_other():
    with defined():
        made = _methods()
        for trait, cls in made.items():
            assert traits_of(cls) == {trait} and traits_of(cls.__new__(cls)) == {trait}
            for other in TRAITS:
                assert (cls.__name__ in methods_with(other)) == (other == trait), (trait, other)
        # the lists the tests and benchmarks build: the ViT case's methods, the CNN case's
        assert "ReadsHeads" in vit.makers(2) and vit.makers(4)["ReadsHeads"]().attention == "blocks.3.attn"
        assert "ReadsHeads" not in method_cases.method_variants()  # (it needs more than a layer)
        assert {"TokenHalves", "Counted", "Triples"} <= set(method_cases.method_variants())
    assert not {cls.__name__ for cls in made.values()} & set(METHODS)  # taken out again


def test_the_app_gives_each_trait_what_it_needs_from_the_data():
    with defined():
        made = _methods()
        pixels, counted = made["pixels"](), made["class_counts"]("conv1")
        app_build._give_pixels(pixels, _data(normalization=([0.25], [0.5])))
        assert (pixels.mean, pixels.std) == ([0.25], [0.5])
        app_build._feed_policies(None, counted, _data(class_counts=[5, 3, 2]))
        assert counted.counts == [5, 3, 2]
        with pytest.raises(ConfigError, match=r"^mixup: Counted needs classes, and data=written has none$"):
            app_build._feed_policies(None, made["class_counts"]("conv1"), _data())
        plain = ManifoldMixup("conv1")  # (a method of neither trait is given neither)
        app_build._give_pixels(plain, _data(normalization=([0.25], [0.5])))
        assert not hasattr(plain, "mean")


def test_the_app_refuses_an_attention_method_on_a_model_without_attention_before_training():
    with defined():
        reader = _methods()["attention"]("input", attention="blocks.1.attn")
        with pytest.raises(ConfigError, match=r"^mixup\.attention: ReadsHeads reads a ViT's attention"):
            preflight.attach(_CNN(), "mixup", reader, _data())


def test_a_clean_method_emits_the_clean_rows_and_a_several_one_refuses_a_two_label_policy():
    x, y = torch.randn(4, 1, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    with defined():
        made = _methods()
        model = _CNN().double().train()
        clean = made["clean"]("conv1", generator=torch.Generator().manual_seed(0))
        with clean.attach(model):
            logits = model(x)
            assert logits.shape[0] == 8  # the clean batch, then its mix
            clean.loss(F.cross_entropy, logits, y).backward()
        with pytest.raises(TypeError, match="^Remix weighs two labels per row, and Triples mixes up to 3"):
            made["several"]("conv1").use(Remix([5, 3, 2]))
        assert build(made["several"]).samples_per_row == 3


def test_a_card_its_class_contradicts_is_refused_in_one_line():
    with defined():
        with pytest.raises(
            TypeError, match=r"^Halves\.card does not state the trait 'tokens', and the class "
        ):

            class Halves(RegionMixer):
                card = _card("region")

        with pytest.raises(TypeError, match=r"^Clean\.card states the trait 'clean', and the class not "):

            class Clean(Mixer):
                card = _card("clean", traits=("clean",))

        class WiderCut(CutMix):  # (a setting of its own, the rest handed to CutMix: tokens= included)
            card = _card("region", traits=("tokens",), signature="WiderCut(layer, margin=0)")

            def __init__(self, layer, margin=0, **kwargs):
                super().__init__(layer, **kwargs)
                self.margin = margin

        assert "WiderCut" in methods_with("tokens")
        with pytest.raises(ValueError, match=r"^Card\(traits=\('shiny',\)\): a tuple of tokens, attention"):
            _card(traits=("shiny",))
        with pytest.raises(ValueError, match="a tuple of"):
            _card(traits="tokens")  # (a string, not a tuple of one)
        with pytest.raises(ValueError, match=r"methods_with\('shiny', family=None\): traits are tokens"):
            methods_with("shiny")


def test_the_packages_traits_match_what_each_method_does():
    """Every carded method of the package: ``"several"`` where it is made mixing more than two samples in a
    row (the class states the rest, checked as it is defined)."""
    for name, cls in METHODS.items():
        if cls.card.family == "composition":
            continue
        made = build(cls, generator=torch.Generator().manual_seed(0))
        assert (made.samples_per_row > 2) == ("several" in cls.card.traits), name

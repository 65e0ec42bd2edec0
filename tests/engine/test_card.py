"""A method's card (mixhook.Card) and the registry it makes: what is listed and what is refused in one line,
the catalogue's order, a method made from its example, a variant that states only its defaults, and the
app's config composed from a constructor."""

import inspect

import pytest
import torch

import mixhook
from mixhook import Card, CutMix, ManifoldMixup, Mixer
from mixhook.engine.card import FAMILIES, METHODS, build, catalogue_order, unregister
from mixhook.engine.mixer import with_defaults


def card(**changes) -> Card:
    values = dict(
        paper="Nobody et al. 2030", mixes="nothing", where="anywhere", family="blend", signature="X(layer)",
        hook="forward", commands="`mixup=x`", details="none",
    )  # fmt: skip
    return Card(**{**values, **changes})


@pytest.fixture
def defined():
    """Names the test defines, taken out of the registry after it."""
    names: list[str] = []
    yield names
    for name in names:
        unregister(name)


def test_a_class_with_a_card_of_its_own_is_listed_and_a_variant_without_one_is_not(defined):
    class Swap(Mixer):
        card = card(signature="Swap(layer)")

    defined.append("Swap")

    class QuietCutMix(CutMix):  # a test's variant of a method: no card of its own
        pass

    assert METHODS["Swap"] is Swap and "QuietCutMix" not in METHODS
    assert METHODS["CutMix"] is CutMix and METHODS["ManifoldMixup"] is ManifoldMixup


def test_a_second_method_of_the_same_name_and_a_card_that_is_no_card_are_refused(defined):
    with pytest.raises(TypeError, match=r"two methods named CutMix: mixhook\.mixers\.cutmix and .*test_card"):

        class CutMix(Mixer):  # noqa: F811 - the clash is the point
            card = card()

    assert METHODS["CutMix"] is mixhook.CutMix
    with pytest.raises(TypeError, match=r"Odd\.card is a dict: a mixhook\.Card"):

        class Odd(Mixer):
            card = {"paper": "x"}

    assert "Odd" not in METHODS


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"family": "blends"}, r"Card\(family='blends'\): one of blend, region, "),
        ({"shown_on": "resnet"}, r"Card\(shown_on='resnet'\): one of cnn, vit, mlp"),
    ],
)
def test_a_card_outside_its_choices_is_refused_in_one_line(changes, message):
    with pytest.raises(ValueError, match=message):
        card(**changes)


def test_the_catalogue_lists_by_family_then_year():
    order = catalogue_order()
    assert set(order) == set(METHODS)
    keys = [(FAMILIES.index(METHODS[n].card.family), METHODS[n].card.year) for n in order]
    assert keys == sorted(keys)
    assert order[0] == "ManifoldMixup" and order.index("AutoMix") > order.index("CutMix")
    assert card(paper="Verma et al. 2019; Zhang et al. 2018").year == 2019 and card(paper="timm").year == 0


def test_a_method_is_made_from_its_example_with_its_layers_under_a_prefix():
    made = build(mixhook.SnapMix, "net.", generator=torch.Generator().manual_seed(0))
    assert made.layers == ("input",) and made.features == "net.conv2" and made.classifier == "net.fc"
    manifold = build(mixhook.ManifoldMixup, "net.")
    assert tuple(manifold.layers) == ("input", "net.conv1") and manifold.alpha == 1.0
    one_of = build(mixhook.OneOf, "net.")
    assert [type(m) for m in one_of.mixers] == [ManifoldMixup, CutMix]


def test_a_variant_states_only_its_defaults_and_its_signature_shows_them():
    class Wide(ManifoldMixup):
        __init__ = with_defaults(ManifoldMixup.__init__, alpha=0.4, mode="elem")

    assert inspect.signature(Wide).parameters["alpha"].default == 0.4
    assert inspect.signature(ManifoldMixup).parameters["alpha"].default == 2.0  # (the base unchanged)
    wide = Wide("input")
    assert (wide.alpha, wide.mode) == (0.4, "elem") and Wide("input", alpha=1.0).alpha == 1.0
    with pytest.raises(TypeError, match=r"^Wide\(\) got an unexpected keyword argument 'beta'$"):
        Wide("input", beta=1)
    with pytest.raises(TypeError, match=r"with_defaults: ManifoldMixup\.__init__ takes no beta, gamma"):
        with_defaults(ManifoldMixup.__init__, gamma=1, beta=2)
    samix = inspect.signature(mixhook.SAMix).parameters
    assert samix["mask_loss_mode"].default == "L1+Variance" and samix["upsampling"].default == "bilinear"


def test_the_apps_config_of_a_method_without_a_file_is_its_constructors_defaults():
    pytest.importorskip("hydra")
    from mixhook.app.methods import configs_of, defaults

    node = defaults(mixhook.SmoothMix)
    assert node["_target_"] == "mixhook.SmoothMix" and node["layer"] == "???"  # required: the command line's
    assert "generator" not in node and node["sigma"] == [0.25, 0.5]  # (a tuple as a list)
    configs = configs_of()
    assert configs["ManifoldMixup"] == ["manifold", "input"]  # the one named after it first
    assert configs["OneOf"] == ["mixup_cutmix"] and set(configs) == set(METHODS)


def test_every_hook_that_is_not_a_mixer_states_its_card_and_the_catalogue_reads_it():
    """Issue 83: the scaling, gradient and noise hooks state a HookCard as the methods state a Card: every
    public hook of the package that modifies (a LayerHook that is neither a mixer nor a probe) is in
    HOOKS, and the catalogue's table of them is made from the cards (docs/_ext/generated.py)."""
    from mixhook import probes
    from mixhook.engine.card import HOOKS, HookCard, hook_table

    public = {
        name
        for name in mixhook.__all__
        if inspect.isclass(cls := getattr(mixhook, name))
        and issubclass(cls, mixhook.LayerHook)
        and cls is not mixhook.LayerHook
        and not issubclass(cls, mixhook.MixingHook)
        and cls.__module__ != probes.__name__
    }
    assert public == set(HOOKS) and {"NEFTune", "NoiseFiT", "InputScale", "GradScale", "GradClip"} <= public
    table = hook_table().splitlines()
    for name, cls in HOOKS.items():
        assert isinstance(cls.card, HookCard)
        assert sum(row.startswith(f"| `{name}(") for row in table) == 1
        assert cls.card.signature.startswith(f"{name}(layer")

"""What a method states about itself for the places that list it: its :class:`Card`.

A method's class carries ``card = Card(...)``, and every registry reads it from there: the catalogue's table
and the method's section (``docs/_ext/generated.py``), the API page, the app's ``mixup=`` group (a method
without a config file of its own is composed from its signature's defaults), the matrix's cells
(``harness/matrix``) and the gallery (which methods it draws). A class that states a card is a catalogued
method: defining it (importing its module) adds it to :data:`METHODS`, whichever package it lives in; a
subclass without a card of its own (a test's variant of a method) is not listed. A hook that is not a
mixer (a scaling, gradient or noise hook) states a :class:`HookCard` the same way, which lists it in
:data:`HOOKS`: the catalogue's table of such hooks and the API page read it.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

FAMILIES = (
    "blend",  # every position alike: lam*h + (1-lam)*h[index], and its noise
    "region",  # a region (box, mask, cells, band) from the partner
    "composition",  # drives other methods
    "saliency",  # a region chosen by saliency or class activation
    "feature",  # aligned or chosen features
    "clean",  # trained on the clean batch beside its mix
    "regression",  # float targets
    "attention",  # labels from a ViT's attention
    "learned",  # a mask made by a network trained beside the model
)
"""The catalogue's order: its table lists the methods by family, then by year."""

TRAITS = {
    "tokens": "a region method that mixes a ViT's patch tokens as the map they are (tokens=(rows, columns))",
    "attention": "reads a ViT's attention weights (attention=): shown on a ViT, refused before training on "
    "a model without attention",
    "pixels": "reads the input's pixel values and takes the data's normalisation as mean= and std=, which "
    "the app fills from the data where they are not given",
    "class_counts": "weighs by the training set's class counts, taken as counts=, which the app fills from "
    "the data",
    "clean": "trains on the clean batch beside its mix (keeps_clean: the mixed layer emits both, its "
    "clean_loss takes both)",
    "several": "mixes more than two samples into a row (samples_per_row > 2, Mixed.mixture): a target, "
    "weights or loss policy of two labels per row refuses it",
}
"""What a method is beside its catalogue family, stated on its card (``traits``): every list of such methods
(the tests', the benchmarks', the app's) is derived from the cards (:func:`methods_with`, :func:`traits_of`),
and :func:`register` refuses a card whose traits its class contradicts (its signature's ``tokens``,
``attention``, ``mean``/``std`` and ``counts``, its ``keeps_clean``). Needing a partner batch is a policy's
(``Policy.needs_partner_batch``: ``PartnerBatch``, ``BalancedMixup``, the way any method mixes with one);
class counts may be a method's trait or a policy's (``Policy.needs_class_counts``: ``Remix``), and the app
gives both the data's."""

SHOWN_ON = ("cnn", "vit", "mlp")
"""The matrix's reference models (``harness/matrix/methods.py``): ``cnn``: 8x8 one-channel images, layers
``conv1`` and ``conv2`` (4 and 6 channels) and ``fc`` (its classifier, after pooling); ``vit``: a timm ViT on
them, blocks ``blocks.0`` and ``blocks.1`` (attention ``blocks.1.attn``); ``mlp``: regression on 10
features, layers ``fc1`` and ``fc2``."""


@dataclass(frozen=True)
class Card:
    """What a method states for the places that list it (``card = Card(...)`` in its class).

    Attributes:
        paper: its authors and year, as the catalogue cites them (``"Yun et al. 2019"``).
        mixes: what it mixes, in one line (the catalogue's table).
        where: where it mixes (``"input, any map, ViT tokens"``; its extra forwards in parentheses).
        family: its place in the catalogue, one of :data:`FAMILIES`.
        signature: its call as the catalogue shows it, the arguments a user sets most with their defaults
            (``'CutMix(layer, alpha=1.0, prob=1.0)'``); each one is checked against the real signature.
        hook: the kind of hook and the outputs it takes (``"forward, (B,C,H,W) outputs or ViT tokens"``).
        commands: the app's commands that train it, Markdown (``"`mixup=cutmix mixup.layer=layer2`"``).
        details: what it computes, Markdown (the catalogue's section).
        workflows: where it trains exactly as a hand-written loop (the matrix): ``"all"``, ``"all but
            TRL"``, ``"all + TRL"`` (shown on a language model too).
        app: the app's overrides where the default experiment cannot take it (``("data=diabetes",
            "model=mlp")``), which its one-line refusal names.
        shown_on: the matrix's reference model it is shown on, one of :data:`SHOWN_ON`.
        example: its constructor's arguments on that model (``{"layer": "input", "grid": 2}``; layer names
            are the model's, ``"input"`` its input; a method that takes methods gives each as a dict with
            its class's name under ``"method"``): :func:`build` makes it (the matrix's cells).
        picture: whether the gallery draws it, or why not (a string: ``"a composition: ..."``).
        traits: what it is beside its family, each one of :data:`TRAITS` (``("tokens",)``,
            ``("tokens", "attention")``, ``("pixels", "clean")``): the lists of such methods are derived
            from them.
        drawn: how the gallery (``docs/gallery.py``) draws it, beyond the layer: its arguments on the
            gallery's models (the CNN's layers ``image`` and ``features``, its classifier ``head.3``; the
            ViT's, for ``shown_on="vit"``: attention ``encoder.layers.encoder_layer_1.self_attention``),
            with ``"input"`` and ``"hidden"`` dicts for those that differ between the picture's two panels,
            ``"seed"`` for a draw that shows the method (default 2), ``"size"`` for smaller images (a
            side in pixels) and ``"note"`` for a line under the mixed image.
    """

    paper: str
    mixes: str
    where: str
    family: str
    signature: str
    hook: str
    commands: str
    details: str
    workflows: str = "all"
    app: tuple[str, ...] = ()
    shown_on: str = "cnn"
    example: dict[str, Any] = field(default_factory=lambda: {"layer": "input"})
    picture: bool | str = True
    drawn: dict[str, Any] = field(default_factory=dict)
    traits: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = [t for t in self.traits if t not in TRAITS]
        if unknown or not isinstance(self.traits, tuple):
            raise ValueError(f"Card(traits={self.traits!r}): a tuple of {', '.join(TRAITS)}")
        if self.family not in FAMILIES:
            raise ValueError(f"Card(family={self.family!r}): one of {', '.join(FAMILIES)}")
        if self.shown_on not in SHOWN_ON:
            raise ValueError(f"Card(shown_on={self.shown_on!r}): one of {', '.join(SHOWN_ON)}")

    @property
    def year(self) -> int:
        """The first year its ``paper`` names (0 where none)."""
        found = re.search(r"\b(19|20)\d\d\b", self.paper)
        return int(found.group()) if found else 0


METHODS: dict[str, type] = {}
"""Every catalogued method by its class name: every class that states a ``card`` of its own, in the order
the classes were defined (``mixhook.mixers`` imports its modules by name)."""


def register(cls: type) -> None:
    """Add ``cls`` to :data:`METHODS` if it states a card of its own (called for every subclass of
    :class:`~mixhook.MixingHook` as it is defined); refuse a second method of the same name."""
    card = cls.__dict__.get("card")
    if card is None or cls.__name__.startswith("_"):
        return
    if not isinstance(card, Card):
        raise TypeError(f"{cls.__qualname__}.card is a {type(card).__name__}: a mixhook.Card")
    _check_traits(cls, card)
    other = METHODS.get(cls.__name__)
    if other is not None and other.__qualname__ == cls.__qualname__ and other.__module__ == cls.__module__:
        METHODS[cls.__name__] = cls  # its module imported again (importlib.reload): the new class
        return
    if other is not None:
        raise TypeError(f"two methods named {cls.__name__}: {other.__module__} and {cls.__module__}")
    METHODS[cls.__name__] = cls


def _parameters(cls: type) -> set[str]:
    """The names ``cls``'s constructor takes: its ``__init__``'s, and where that passes ``**kwargs`` on, its
    bases' (a subclass that adds a setting and hands the rest to CutMix takes ``tokens=`` too)."""
    names = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters
        names |= set(parameters)
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            break
    return names


# The traits a class's own code shows: (trait, what shows it, whether the class shows it)
def _shown(cls: type) -> list[tuple[str, str, bool]]:
    parameters = _parameters(cls)
    return [
        ("tokens", "takes tokens=", "tokens" in parameters),
        ("attention", "takes attention=", "attention" in parameters),
        ("pixels", "takes mean= and std=", "mean" in parameters and "std" in parameters),
        ("class_counts", "takes counts=", "counts" in parameters),
        ("clean", "keeps_clean is True", bool(getattr(cls, "keeps_clean", False))),
    ]


def _check_traits(cls: type, card: Card) -> None:
    """Refuse, in one line, a card whose traits the class's own code contradicts."""
    for trait, shown_by, shown in _shown(cls):
        if shown != (trait in card.traits):
            said = "states" if trait in card.traits else "does not state"
            does = "" if shown else "not "
            raise TypeError(
                f"{cls.__name__}.card {said} the trait {trait!r}, and the class {does}{shown_by}: "
                f"{TRAITS[trait]}"
            )


def traits_of(hook) -> frozenset[str]:
    """The traits of ``hook``'s method (a mixer, or its class), from its card (a subclass without a card of
    its own has its base's); none for a hook without a card."""
    cls = hook if isinstance(hook, type) else type(hook)
    card = getattr(cls, "card", None)
    return frozenset(card.traits) if isinstance(card, Card) else frozenset()


def methods_with(
    *traits: str, family: str | None = None, methods: dict[str, type] | None = None
) -> list[str]:
    """The names of the catalogued methods (:data:`METHODS`, in their order) whose cards state every one of
    ``traits`` (:data:`TRAITS`), of ``family`` where given: the one way a list of such methods is made."""
    unknown = [t for t in traits if t not in TRAITS]
    if unknown or (family is not None and family not in FAMILIES):
        raise ValueError(
            f"methods_with({', '.join(map(repr, traits))}, family={family!r}): traits are "
            f"{', '.join(TRAITS)}; families {', '.join(FAMILIES)}"
        )
    methods = METHODS if methods is None else methods
    return [
        name
        for name, cls in methods.items()
        if set(traits) <= set(cls.card.traits) and (family is None or cls.card.family == family)
    ]


def unregister(name: str) -> type | None:
    """Take the method ``name`` out of :data:`METHODS` (a method defined for a moment: a test's)."""
    return METHODS.pop(name, None)


def catalogue_order(methods: dict[str, type] | None = None) -> list[str]:
    """The methods' names in the catalogue's order: by family (:data:`FAMILIES`), then year, then name."""
    methods = METHODS if methods is None else methods
    return sorted(methods, key=lambda n: (FAMILIES.index(methods[n].card.family), methods[n].card.year, n))


LAYER_ARGUMENTS = ("layer", "features", "classifier", "attention", "saliency_layer")
"""The constructor arguments that name layers: :func:`build` puts them under a prefix."""


def build(cls: type, prefix: str = "", **extra):
    """``cls`` made from its card's ``example``, the layers it names put under ``prefix`` (``"net."``: the
    reference model inside a LightningModule; ``"input"`` stays), with ``extra`` arguments (a
    ``generator``; one the example sets too, e.g. another ``layer``, replaces it); a method an argument
    names (``{"method": "CutMix", ...}``) is made the same way."""

    def arguments(example: dict) -> dict:
        out = {}
        for key, value in example.items():
            if key in LAYER_ARGUMENTS and value is not None:
                named = [value] if isinstance(value, str) else list(value)
                named = [v if v == "input" else f"{prefix}{v}" for v in named]
                value = named[0] if isinstance(value, str) else named
            elif isinstance(value, list | tuple) and value and all(isinstance(v, dict) for v in value):
                value = [
                    METHODS[v["method"]](**arguments({k: x for k, x in v.items() if k != "method"}))
                    for v in value
                ]
            out[key] = value
        return out

    return cls(**{**arguments(cls.card.example), **extra})


HOOKS: dict[str, type] = {}
"""Every hook that is not a mixer and states a :class:`HookCard` (a scaling, gradient or noise hook), by
class name, in the order they are defined: the catalogue's table of them and the API page read it."""


@dataclass(frozen=True)
class HookCard:
    """What a hook that is not a mixer states for the catalogue's table of such hooks and the API page, as a
    method's :class:`Card` does for the methods: its class carries ``card = HookCard(...)``, which lists it
    in :data:`HOOKS` when the class is defined.

    Attributes:
        signature: its constructor as users call it (``"InputScale(layer, factor, in_eval=False)"``).
        hook: the kind of hook it registers, and where.
        formula: what it computes.
        paper: the paper it follows ("" for none).
        commands: the app's overrides that use it, or where it is documented when the app has none.
        members: the members the API page shows beside the class's docstring ("" for its default).
        example: for a hook with a loss of its own (``hook.loss(model, inputs)``: NoiseFiT, SFTMix), its
            constructor's arguments on the matrix's language model, which makes its row of the matrix
            (``harness/matrix/language.py``: a tiny Llama, its decoder layers ``model.layers.0`` and
            ``model.layers.1``, its final norm ``model.norm``, the LM head's input); ``None`` for the others.
        trainer: the Trainer mixins of :mod:`mixhook.integrations.lm` it trains with, by name
            (``("SFTMixLoss", "PairedBatches")``): the matrix's HF Trainer and TRL cells make the trainer's
            class of them.
    """

    signature: str
    hook: str
    formula: str
    paper: str = ""
    commands: str = ""
    members: str = ""
    example: dict[str, Any] | None = None
    trainer: tuple[str, ...] = ()

    def __set_name__(self, owner: type, name: str) -> None:
        if name == "card" and not owner.__name__.startswith("_"):
            HOOKS[owner.__name__] = owner


def hook_order() -> list[str]:
    """The hooks of :data:`HOOKS` in the catalogue's order: the forward hooks, then the backward ones, each
    by name."""
    return sorted(HOOKS, key=lambda n: (HOOKS[n].card.hook.startswith("backward"), n))


def hook_table() -> str:
    """The catalogue's table of the hooks that are not mixers (their cards), in :func:`hook_order`."""
    lines = ["| class | hook kind | formula | paper | CLI |", "| --- | --- | --- | --- | --- |"]
    for name in hook_order():
        c = HOOKS[name].card
        lines.append(f"| `{c.signature}` | {c.hook} | {c.formula} | {c.paper} | {c.commands} |")
    return "\n".join(lines) + "\n"

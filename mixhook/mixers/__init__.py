"""The mixing regularizers: one module per method, on one public contract.

This package holds the methods only. What they stand on is the engine (:mod:`mixhook.engine`):
:class:`~mixhook.engine.contract.MixingHook` is the contract a training loop relies on,
:class:`~mixhook.engine.mixer.Mixer` the base a method subclasses (see docs/adding-a-mixer.md);
:mod:`mixhook.functional` holds the blends' math and :mod:`mixhook.geometry` the regions'. Every
``MixingHook`` class defined in a module of this package is exported here and from ``mixhook`` under its
own name: a new method is a new module, found when the package is imported. :data:`METHODS` lists every
catalogued method, the ones of this package and any other class that states a
:class:`~mixhook.engine.card.Card` (a method of your own package joins it when its module is imported).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from ..engine.card import METHODS as METHODS  # (every catalogued method, by name)
from ..engine.card import Card
from ..engine.contract import Deferred, Draw, Mixed, MixingHook, MixState
from ..engine.mixer import Mixer
from ..engine.regions import MaskMixer, RegionMixer
from ..functional import blend, inverse_permutation, mix_targets, sample_beta, sample_lam, smooth_one_hot


def _discover() -> dict[str, type]:
    """Every public MixingHook class defined in this package's method modules, by name (each states its
    card, which lists it in :data:`METHODS`)."""
    found: dict[str, type] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, MixingHook)
                and obj.__module__ == module.__name__
                and not name.startswith("_")
            ):
                if name in found:
                    raise ImportError(
                        f"two mixers named {name}: {found[name].__module__} and {obj.__module__}"
                    )
                found[name] = obj
    return found


DEFINED_HERE: dict[str, type] = _discover()
globals().update(DEFINED_HERE)

__all__ = [
    *sorted(DEFINED_HERE),
    "Card",
    "Deferred",
    "Draw",
    "MaskMixer",
    "Mixed",
    "Mixer",
    "MixingHook",
    "MixState",
    "RegionMixer",
    "blend",
    "inverse_permutation",
    "mix_targets",
    "sample_beta",
    "sample_lam",
    "smooth_one_hot",
]

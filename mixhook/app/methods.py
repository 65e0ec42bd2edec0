"""The app's ``mixup=`` group and the catalogued methods (``mixhook.mixers.METHODS``).

A config file under ``conf/mixup/`` gives a method the paper's values, with comments; a method without one
is still in the group, under its class name in lower case (``mixup=channelswap``), composed from its
constructor's defaults (a required argument, such as a layer, is then set on the command line:
``mixup.layer=layer2``). So a new method trains from the app as soon as its module is imported: nothing of
the app names it.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import yaml

from mixhook.mixers import METHODS

from .conf import CONF_DIR

PLAIN = (type(None), bool, int, float, str)


def target(cls: type) -> str:
    """The ``_target_`` that names ``cls``: ``mixhook.<Name>`` where mixhook exports it, else its module's."""
    import mixhook

    if getattr(mixhook, cls.__name__, None) is cls:
        return f"mixhook.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def shipped(conf: Path = CONF_DIR) -> dict[str, dict]:
    """Every config file of the ``mixup=`` group, by its name: its values as written."""
    return {
        path.stem: yaml.safe_load(path.read_text()) or {} for path in sorted((conf / "mixup").glob("*.yaml"))
    }


def configs_of(conf: Path = CONF_DIR, files: dict[str, dict] | None = None) -> dict[str, list[str]]:
    """Each catalogued method's ``mixup=`` configs, by the method's name: the shipped files that name it
    with no policy (a policy's config is the policy's; the one named after the method first), else the one
    composed from its defaults. ``files``: :func:`shipped`'s, where it was read already."""
    by_target = {target(cls): name for name, cls in METHODS.items()}
    found: dict[str, list[str]] = {name: [] for name in METHODS}
    for config, values in (shipped(conf) if files is None else files).items():
        name = by_target.get(values.get("_target_"))
        if name is not None and not values.get("policies"):
            found[name].append(config)
    for name, configs in found.items():
        if not configs:
            configs.append(name.lower())
        configs.sort(key=lambda c: (not name.lower().startswith(c), c))  # the one named after it first
    return found


def defaults(cls: type) -> dict:
    """The config node of ``cls`` composed from its constructor: ``_target_``, and every argument whose
    default a config can hold (a required one is Hydra's ``???``: set it on the command line)."""
    node: dict = {"_target_": target(cls)}
    for name, parameter in inspect.signature(cls).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or name == "generator":
            continue
        value = parameter.default
        if value is parameter.empty:
            node[name] = "???"
        elif isinstance(value, PLAIN):
            node[name] = value
        elif isinstance(value, tuple | list) and all(isinstance(v, PLAIN) for v in value):
            node[name] = list(value)
    return node


def register(conf: Path = CONF_DIR) -> None:
    """Put every catalogued method without a config file of its own into Hydra's ConfigStore, as
    ``mixup/<its name in lower case>`` (idempotent: a method defined since is added)."""
    from hydra.core.config_store import ConfigStore

    files = shipped(conf)
    store = ConfigStore.instance()
    for name, configs in configs_of(conf, files).items():
        if not files.keys() & set(configs):
            store.store(group="mixup", name=name.lower(), node=defaults(METHODS[name]))

"""What the app asks of Hydra, the same under Hydra 1.3 and 1.4: no deprecation or whitelist warnings,
and the ``_target_``s it builds checked against one execution whitelist.

- ``version_base``: Hydra 1.3 warns without one; Hydra 1.4 deprecates the parameter (a
  ``Hydra15MigrationWarning`` whenever it is passed) and uses its current defaults. :data:`VERSION_BASE`
  is what to pass: ``version_base="1.3"`` under 1.3, nothing under 1.4.
- Execution whitelist: Hydra 1.4 warns for every ``instantiate()`` without an ``_execution_whitelist_``
  (an error from Hydra 1.5) and refuses targets outside one. The app builds its own classes
  (``mixhook.*``: mixers, hooks, models, the report callback) and ``torch.optim.*`` (optimizers and
  ``torch.optim.lr_scheduler``; the torchvision and timm models come through ``mixhook.app.models``'
  builders); a config that names anything else (a user's own hook class in ``hooks``) is refused in one
  line that says how to allow it: ``allow_targets=[mypackage.*]``. The check is the app's own, so it holds
  under Hydra 1.3 as under 1.4; under 1.4 the same list is also passed to Hydra.
"""

from __future__ import annotations

import hydra
from hydra.utils import instantiate as _instantiate
from omegaconf import DictConfig, ListConfig

_RELEASE = tuple(int(p) for p in hydra.__version__.split(".")[:2])
HYDRA_14 = _RELEASE >= (1, 4)
VERSION_BASE: dict = {} if HYDRA_14 else {"version_base": "1.3"}
TRUSTED = ("mixhook.*", "torch.optim.*", "torchvision.models.*", "timm.models.*")
# What Hydra itself instantiates from the config before the task runs: the sweep report callback and the
# launcher and sweeper plugins (joblib, submitit, Optuna).
HYDRA_TARGETS = ("mixhook.app.report.ReportCallback", "hydra_plugins.*", "optuna.samplers.*")
# The keyword arguments of train.py's @hydra.main
HYDRA_MAIN: dict = {"execution_whitelist": list(HYDRA_TARGETS)} if HYDRA_14 else dict(VERSION_BASE)


class TargetNotAllowed(ValueError):
    """A ``_target_`` outside the execution whitelist, said in one line."""


def allowed(extra=()) -> tuple[str, ...]:
    """The whitelist: :data:`TRUSTED` and the user's ``allow_targets``, each a dotted name or a package
    prefix ending in ``.*``."""
    patterns = list(TRUSTED)
    for pattern in extra or ():
        if not isinstance(pattern, str) or not pattern or pattern == "*" or "*" in pattern[:-2]:
            raise TargetNotAllowed(
                f"allow_targets: {pattern!r} is not a target: give a dotted name (mypackage.MyHook) or a "
                "package prefix (mypackage.*)"
            )
        patterns.append(pattern)
    return tuple(patterns)


def _matches(target: str, patterns: tuple[str, ...]) -> bool:
    for pattern in patterns:
        if pattern.endswith(".*") and target.startswith(pattern[:-1]):
            return True
        if target == pattern:
            return True
    return False


def check_targets(node, key: str, patterns: tuple[str, ...]) -> None:
    """Every ``_target_`` in ``node`` (nested ones too: OneOf's mixers), or a one-line
    :class:`TargetNotAllowed` naming the first outside ``patterns`` and how to allow it."""
    if isinstance(node, DictConfig):
        target = node.get("_target_")
        if isinstance(target, str) and not _matches(target, patterns):
            package = target.rpartition(".")[0] or target
            raise TargetNotAllowed(
                f"{key}._target_={target} is not among the targets this app builds ({', '.join(patterns)}); "
                f"allow it with allow_targets=[{package}.*] (or allow_targets=[{target}])"
            )
        for child in node:
            if not str(child).startswith("_"):
                check_targets(node._get_node(child), f"{key}.{child}", patterns)
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            check_targets(item, f"{key}[{i}]", patterns)


def instantiate(node: DictConfig, key: str, patterns: tuple[str, ...], **kwargs):
    """``hydra.utils.instantiate(node, **kwargs)`` once every target in ``node`` is allowed, with the
    whitelist passed to Hydra 1.4."""
    check_targets(node, key, patterns)
    if HYDRA_14:
        kwargs["_execution_whitelist_"] = _canonical(patterns)
    return _instantiate(node, **kwargs)


def _canonical(patterns: tuple[str, ...]) -> list[str]:
    """``patterns`` and, for each dotted name, where the object it names is defined: Hydra 1.4 checks
    that (``torch.nn.Identity`` is ``torch.nn.modules.linear.Identity``)."""
    from hydra.utils import get_object

    out = list(patterns)
    for pattern in patterns:
        if pattern.endswith(".*"):
            continue
        try:
            target = get_object(pattern)
        except Exception:  # noqa: BLE001  (instantiate will say that it cannot be found)
            continue
        name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}"
        if name not in out:
            out.append(name)
    return out

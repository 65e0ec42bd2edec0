r"""Building objects from config nodes, safely: only the ``_target_``\ s the app trusts (its own, torch's
optimizers and schedulers, torchvision's and timm's models) and those ``allow_targets`` adds; any other is
refused in one line."""

from __future__ import annotations

import inspect
import logging

from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from . import hydra_compat
from .errors import ConfigError

log = logging.getLogger("mixhook")


def parameters_of(target: str) -> set[str]:
    """The names of the parameters of what ``target`` names (empty when it cannot be found: building it
    then says why)."""
    try:
        return set(inspect.signature(target_object(target)).parameters)
    except Exception:  # noqa: BLE001
        return set()


def target_object(target: str):
    """What ``target`` names, or ``None`` when it cannot be found (building it then says why)."""
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception:  # noqa: BLE001
        return None


def allowed_targets(cfg: DictConfig) -> tuple[str, ...]:
    """The execution whitelist: the app's own targets and ``allow_targets`` (:mod:`.hydra_compat`)."""
    try:
        return hydra_compat.allowed(OmegaConf.select(cfg, "allow_targets") or ())
    except hydra_compat.TargetNotAllowed as err:
        raise ConfigError(str(err)) from None


def instantiate(node: DictConfig, key: str, patterns: tuple[str, ...] = hydra_compat.TRUSTED, **kwargs):
    """``hydra.utils.instantiate`` of an allowed ``_target_`` (:mod:`.hydra_compat`), with the cause of a
    failure said in one line under ``key``: Hydra 1.3 wraps what the constructor raises in an
    ``InstantiationException``, Hydra 1.4 lets it through (torch's ``ValueError: Invalid momentum value``)."""
    try:
        return hydra_compat.instantiate(node, key, patterns, _convert_="all", **kwargs)
    except hydra_compat.TargetNotAllowed as err:
        raise ConfigError(str(err)) from None
    except InstantiationException as err:
        cause = err.__cause__ or err
        raise ConfigError(f"{key}: {' '.join(str(cause).split())}") from err
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError, ImportError) as err:
        raise ConfigError(f"{key}: {' '.join(str(err).split())}") from err

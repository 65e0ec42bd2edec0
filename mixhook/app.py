"""Hydra glue: a composed config in, objects built and checked, the training loop run, accuracy out.

Everything a user can get wrong is checked in :func:`build` before the first training step; each
problem becomes a :class:`ConfigError` whose message is one line naming the config key, the bad value
and what would be valid. :func:`main` prints that line and exits with status 2 (in a multirun sweep it
raises instead, so that Hydra records the failed job and the sweep goes on).
"""

from __future__ import annotations

import logging
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from .data import Data, DataNotFoundError, build_data
from .layers import UnknownLayerError, trace_outputs
from .mixing import ManifoldMixup, check_mixable
from .training import train

log = logging.getLogger("mixhook")


class ConfigError(ValueError):
    """A configuration problem, said in one line."""


@dataclass
class Run:
    """Everything :func:`build` made from the config, ready for :func:`mixhook.training.train`."""

    model: nn.Module
    data: Data
    mixup: ManifoldMixup | None
    optimizer: torch.optim.Optimizer
    scheduler: object
    device: torch.device
    epochs: int
    settings: dict


def main(cfg: DictConfig, out_dir: str | None = None) -> float:
    """Build, check and run one experiment; return its final test accuracy (what Optuna maximises).

    Results go to ``out_dir``, by default the Hydra run's output directory.
    """
    try:
        run = build(cfg)
    except ConfigError as err:
        if _in_multirun():
            raise
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if out_dir is None:
        from hydra.core.hydra_config import HydraConfig

        out_dir = HydraConfig.get().runtime.output_dir
    log.info("%s on %s, %s, mixup %s -> %s", cfg.model.get("name", cfg.model._target_.rsplit(".", 1)[-1]),
             cfg.data.name, run.device, run.mixup, out_dir)  # fmt: skip
    summary = train(
        run.model,
        run.data,
        run.optimizer,
        run.scheduler,
        run.epochs,
        run.device,
        out_dir,
        mixup=run.mixup,
        settings=run.settings,
        progress_bar=bool(cfg.trainer.progress_bar),
    )
    log.info(
        "done: test_acc %.2f%%  best %.2f%% (epoch %d)  test_nll %.4f  %.0fs  -> %s/summary.json",
        100 * summary["test_acc"], 100 * summary["best_test_acc"], summary["best_epoch"],
        summary["test_nll"], summary["seconds"], out_dir,
    )  # fmt: skip
    return summary["test_acc"]


def build(cfg: DictConfig) -> Run:
    """Turn the config into checked objects. Raises :class:`ConfigError` for anything a user set wrong."""
    seed = _integer(cfg, "seed", minimum=0)
    epochs = _integer(cfg, "trainer.epochs", minimum=1)
    batch_size = _integer(cfg, "trainer.batch_size", minimum=1)
    eval_batch_size = _integer(cfg, "trainer.eval_batch_size", minimum=1)
    device = _device(cfg.trainer.device)
    _seed_everything(seed)

    data_options = OmegaConf.to_container(cfg.data, resolve=True)
    try:
        data = build_data(batch_size=batch_size, eval_batch_size=eval_batch_size, seed=seed, **data_options)
    except DataNotFoundError as err:
        raise ConfigError(str(err)) from err
    except (ValueError, TypeError) as err:
        raise ConfigError(f"data: {err}") from err

    model = _instantiate(cfg.model, "model", in_channels=data.in_channels, num_classes=data.num_classes)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model: {cfg.model._target_} built a {type(model).__name__}, not an nn.Module")

    mixup = None
    if cfg.mixup.get("_target_"):
        generator = torch.Generator().manual_seed(seed)
        mixup = _instantiate(cfg.mixup, "mixup", generator=generator)
    _check_model(model, mixup, data)

    optimizer, scheduler = _optimizer(cfg.optim, model, epochs)
    settings = {
        "mixup": OmegaConf.to_container(cfg.mixup, resolve=True),
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "data": cfg.data.name,
        "seed": seed,
        "device": str(device),
        "torch": torch.__version__,
    }
    return Run(model, data, mixup, optimizer, scheduler, device, epochs, settings)


def _check_model(model: nn.Module, mixup, data: Data) -> None:
    """Attach the mixup hooks (resolving the layer names) and run one sample batch through the model
    in eval mode, checking that it runs on this data and that each mixup layer returns a mixable
    tensor."""
    if mixup is not None:
        try:
            mixup.attach(model)
        except UnknownLayerError as err:
            raise ConfigError(f"mixup.layer: {err}") from err
    x = next(iter(data.test))[0][:2]
    layers = mixup.layers if mixup is not None else ()
    try:
        outputs = trace_outputs(model, layers, x)
    except Exception as err:  # whatever the model raises on this input is a model/data mismatch
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ConfigError(
            f"model: {type(model).__name__} fails on a {data.name} batch of shape {tuple(x.shape)}: "
            f"{type(err).__name__}: {reason}"
        ) from err
    for name in layers:
        if name not in outputs:
            raise ConfigError(f"mixup.layer: {name!r} does not run in {type(model).__name__}.forward()")
        try:
            check_mixable(name, outputs[name], x[:2].shape[0])
        except TypeError as err:
            raise ConfigError(f"mixup.layer: {err}") from err


def _optimizer(cfg: DictConfig, model: nn.Module, epochs: int):
    if not cfg.lr > 0:
        raise ConfigError(f"optim.lr must be > 0, got {cfg.lr}")
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        nesterov=cfg.nesterov,
    )
    schedulers = {
        "cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs),
        "multistep": lambda: torch.optim.lr_scheduler.MultiStepLR(
            optimizer, milestones=list(cfg.milestones), gamma=cfg.gamma
        ),
        "constant": lambda: None,
    }
    if cfg.scheduler not in schedulers:
        raise ConfigError(
            f"optim.scheduler={cfg.scheduler!r} is not a schedule; valid: {', '.join(schedulers)}"
        )
    return optimizer, schedulers[cfg.scheduler]()


def _instantiate(node: DictConfig, key: str, **kwargs):
    """``hydra.utils.instantiate`` with the cause of a failure said in one line under ``key``."""
    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as err:
        cause = err.__cause__ or err
        raise ConfigError(f"{key}: {cause}") from err


def _integer(cfg: DictConfig, key: str, minimum: int) -> int:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"trainer.device={spec!r} is not a device; valid: auto, cpu, cuda, cuda:N"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={spec!r} but no CUDA device is available; use auto or cpu")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"trainer.device={spec!r}: only auto, cpu, cuda and cuda:N are supported")
    return device


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN

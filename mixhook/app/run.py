"""Hydra glue: a composed config in, objects built and checked, the training loop run, accuracy out.

Everything a user can get wrong is checked in :func:`build` before the first training step; each
problem becomes a :class:`ConfigError` whose message is one line naming the config key, the bad value
and what would be valid. :func:`main` prints that line and exits with status 2 (in a multirun sweep it
raises instead, so that Hydra records the failed job and the sweep goes on).
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from mixhook.compose import mixers_of
from mixhook.gradients import GradClip, GradScale
from mixhook.layers import INPUT, UnknownLayerError, trace_outputs
from mixhook.mixers import MixingHook
from mixhook.probes import ActivationStats, GradStats
from mixhook.scaling import InputScale

from .data import Data, DataNotFoundError, build_data
from .training import LOSSES, train
from .training import checkpoint as ckpt
from .training.distributed import Dist
from .training.logging import LOGGERS, RunLogger
from .training.loop import PRECISIONS, Interrupted, NonFiniteLoss

log = logging.getLogger("mixhook")


class ConfigError(ValueError):
    """A configuration problem, said in one line."""


@dataclass
class Run:
    """Everything :func:`build` made from the config, ready for :func:`mixhook.app.training.train`."""

    model: nn.Module
    data: Data
    mixup: MixingHook | None
    hooks: list
    optimizer: torch.optim.Optimizer
    scheduler: object
    device: torch.device
    epochs: int
    settings: dict
    handles: list  # what each hook's attach() returned: removing them detaches everything


def main(cfg: DictConfig, out_dir: str | None = None) -> float:
    """Build, check and run one experiment; return its final test accuracy (what Optuna maximises).

    Results go to ``out_dir``, by default the Hydra run's output directory. Outside a multirun, a
    configuration error exits with status 2, a non-finite loss with 3 and SIGTERM/SIGINT with 128 +
    the signal, each after one line on stderr.
    """
    if out_dir is None:
        from hydra.core.hydra_config import HydraConfig

        out_dir = HydraConfig.get().runtime.output_dir
    try:
        return _main(cfg, out_dir)
    except (ConfigError, NonFiniteLoss, Interrupted) as err:
        if _in_multirun():
            _record_failure(out_dir, err)
            raise
        if isinstance(err, Interrupted):  # status 128 + the signal, as a shell reports a kill
            line, status = str(err), 128 + err.signum
        else:
            line, status = f"error: {err}", 2 if isinstance(err, ConfigError) else 3
        print(line, file=sys.stderr)
        raise SystemExit(status) from None
    except Exception as err:
        if _in_multirun():  # the sweep report lists the run as failed with this line
            _record_failure(out_dir, err)
        raise


def check_command_line(argv: list[str], conf_dir: str) -> str | None:
    """What Hydra would reject only with a multi-line report, said in one line before it starts: an
    option that is not in its config group (``mixup=nosuch``), a ``hydra.run.dir`` or
    ``hydra.sweep.dir`` that cannot be created, a search (``hparams_search=...``) without ``-m``,
    which Hydra would run as one plain job, and a key that is not in the config
    (``trainer.epoch=1``, named with the closest valid key). Returns the line, or ``None``."""
    multirun = any(arg in ("-m", "--multirun", "hydra.mode=MULTIRUN") for arg in argv)
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep or arg.startswith("-") or "${" in value or "(" in value:
            continue
        group = os.path.join(conf_dir, key)
        if not key.startswith("hydra") and os.path.isdir(group):
            options = sorted(f[:-5] for f in os.listdir(group) if f.endswith(".yaml"))
            for option in value.split(","):
                if option not in ("null", "") and not os.path.isfile(os.path.join(group, f"{option}.yaml")):
                    return f"{key}={option} is not an option of {key}; valid: {', '.join(options)}"
        if key in ("hydra.run.dir", "hydra.sweep.dir"):
            problem = _creatable(value)
            if problem:
                return f"{key}={value} cannot be created: {problem}"
        if key == "hparams_search" and value not in ("null", "") and not multirun:
            return f"hparams_search={value} runs a sweep: add -m (python train.py -m {arg} ...)"
    return _unknown_key(argv, conf_dir)


def _unknown_key(argv: list[str], conf_dir: str) -> str | None:
    """A key that is not in the composed config (``trainer.epoch=1``), named with the closest valid one.

    The config is composed with the command line's group choices (the first option of a sweep); keys
    added with ``+`` and Hydra's own are left to Hydra. ``None`` when every key exists (or when the
    config cannot be composed here: Hydra then reports that itself)."""
    import difflib

    from hydra import compose, initialize_config_dir
    from omegaconf import DictConfig

    groups, keys = [], []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or arg.startswith(("-", "+", "~")) or key.startswith("hydra"):
            continue
        if os.path.isdir(os.path.join(conf_dir, key)):
            if key != "hparams_search":  # a sweeper's config needs its plugin: Hydra's business
                groups.append(f"{key}={value.split(',')[0]}")
        else:
            keys.append((key, arg))
    if not keys:
        return None
    try:
        with initialize_config_dir(config_dir=os.path.abspath(conf_dir), version_base="1.3"):
            cfg = compose(config_name="config", overrides=groups)
    except Exception:  # noqa: BLE001  (whatever stops composing here, Hydra will say itself)
        return None
    for key, arg in keys:
        node, walked = cfg, []
        for part in key.split("."):
            if not isinstance(node, DictConfig):
                break  # into a list or a value: Hydra checks that
            if part not in node:
                where = ".".join(walked) or "the config"
                valid = sorted(str(k) for k in node.keys())
                close = difflib.get_close_matches(part, valid, n=1, cutoff=0.5)
                prefix = ".".join(walked) + "." if walked else ""
                hint = f"did you mean {prefix}{close[0]}? " if close else ""
                return f"{arg}: {where} has no key {part!r}; {hint}valid: {', '.join(valid)}"
            walked.append(part)
            node = node[part]
    return None


def _creatable(path: str) -> str | None:
    """Why directory ``path`` cannot be created and written (``None`` if it can): tried for real, and
    whatever this check created is removed again."""
    path = os.path.abspath(path)
    missing = []
    parent = path
    while not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    try:
        _make_writable_dir(path)
    except OSError as err:
        return f"{err.strerror or err} ({err.filename or path})"
    finally:
        for created in missing:  # deepest first
            try:
                os.rmdir(created)
            except OSError:
                pass
    return None


def _make_writable_dir(path: str) -> None:
    """Create directory ``path`` (and its parents) and write and remove a file in it; ``OSError`` if
    either cannot be done."""
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, ".mixhook-write-test")
    with open(probe, "w") as f:
        f.write("ok")
    os.remove(probe)


def _record_failure(out_dir: str, err: BaseException) -> None:
    from .report import ERROR_FILE

    lines = str(err).strip().splitlines()
    with open(os.path.join(out_dir, ERROR_FILE), "w") as f:
        f.write(f"{type(err).__name__}: {lines[-1] if lines else ''}\n")


# Keys that may differ between a run and its resumption: where things are, how they are shown.
RESUMABLE_CHANGES = {
    "trainer.resume", "trainer.progress_bar", "trainer.checkpoint_every", "trainer.device",
    "data.root", "data.num_workers", "data.download",
}  # fmt: skip


def _main(cfg: DictConfig, out_dir: str) -> float:
    dist = Dist.from_env(cuda=_device(cfg.trainer.device).type == "cuda")
    try:
        return _run(cfg, dist.broadcast(out_dir), dist)  # every rank works in rank 0's run directory
    finally:
        dist.close()


def _run(cfg: DictConfig, out_dir: str, dist: Dist) -> float:
    if not dist.main:
        log.setLevel(logging.WARNING)  # rank 0 reports
    _check_writable(out_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    state = _resume_state(cfg, out_dir, config)
    run = build(cfg, dist)
    log.info("%s on %s, %s, hooks %s -> %s", cfg.model.get("name", cfg.model._target_.rsplit(".", 1)[-1]),
             cfg.data.name, run.device, run.hooks or "none", out_dir)  # fmt: skip
    logger = feature_maps = None
    if cfg.probes.feature_maps and probe_layers(cfg):
        feature_maps = (probe_layers(cfg), next(iter(run.data.test))[0][:4])
    try:
        if dist.main:
            try:
                logger = RunLogger(
                    out_dir, cfg.trainer.logger, run.hooks, state["global_step"] if state else None
                )
            except ValueError as err:
                raise ConfigError(str(err)) from err
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
            loss=cfg.trainer.loss,
            hooks=run.hooks,
            checkpoint_every=cfg.trainer.checkpoint_every,
            resume=state,
            config=config,
            precision=str(cfg.trainer.precision),
            compile=cfg.trainer.compile,
            channels_last=cfg.trainer.channels_last,
            dist=dist,
            logger=logger,
            feature_maps=feature_maps,
        )
    except ckpt.CheckpointError as err:
        raise ConfigError(f"trainer.resume: {err}") from err
    finally:  # no hook outlives the run, whatever ended it
        for handle in run.handles:
            handle.remove()
        if logger is not None:
            logger.close()
    log.info(
        "done: test_acc %.2f%%  best %.2f%% (epoch %d)  test_nll %.4f  %.0fs  -> %s/summary.json",
        100 * summary["test_acc"], 100 * summary["best_test_acc"], summary["best_epoch"],
        summary["test_nll"], summary["seconds"], out_dir,
    )  # fmt: skip
    return summary["test_acc"]


def build(cfg: DictConfig, dist: Dist | None = None) -> Run:
    """Turn the config into checked objects. Raises :class:`ConfigError` for anything a user set wrong.

    ``dist``: in a data-parallel job, this rank's data share, CUDA device and random streams."""
    dist = dist or Dist()
    seed = _integer(cfg, "seed", minimum=0)
    epochs = _integer(cfg, "trainer.epochs", minimum=1)
    _integer(cfg, "trainer.checkpoint_every", minimum=0)
    device = dist.device if dist.enabled and dist.device.type == "cuda" else _device(cfg.trainer.device)
    if cfg.trainer.loss not in LOSSES:
        raise ConfigError(f"trainer.loss={cfg.trainer.loss!r} is not a loss; valid: {', '.join(LOSSES)}")
    if str(cfg.trainer.precision) not in PRECISIONS:
        raise ConfigError(
            f"trainer.precision={cfg.trainer.precision!r} is not a precision; valid: {', '.join(PRECISIONS)}"
        )
    if cfg.trainer.logger not in LOGGERS:
        raise ConfigError(
            f"trainer.logger={cfg.trainer.logger!r} is not a logger; valid: {', '.join(LOGGERS)}"
        )
    for key in ("trainer.compile", "trainer.channels_last"):
        if not isinstance(OmegaConf.select(cfg, key), bool):
            raise ConfigError(f"{key} must be true or false, got {OmegaConf.select(cfg, key)!r}")
    model, data = build_model_and_data(cfg, dist)

    if dist.enabled:  # the model is built alike on every rank; each rank then mixes its own way
        torch.manual_seed(dist.seed(seed))
    hooks = _build_hooks(cfg, dist.seed(seed))
    if not dist.main:  # rank 0 probes its own batches; the others do not record what nobody writes
        hooks = [(key, hook) for key, hook in hooks if not key.startswith("probes")]
    mixers = mixers_of([hook for _, hook in hooks])
    if len(mixers) > 1:
        keys = ", ".join(key for key, hook in hooks if hook in mixers)
        raise ConfigError(
            f"{len(mixers)} mixing regularizers configured ({keys}); "
            "each would mix every batch: keep one, or combine them in one entry with mixhook.OneOf"
        )
    mixup = mixers[0] if mixers else None
    handles = _attach_and_check(model, hooks, data)

    optimizer, scheduler = _optimizer(cfg.optim, model, epochs)
    settings = {
        "mixup": OmegaConf.to_container(cfg.mixup, resolve=True),
        "hooks": {key: repr(hook) for key, hook in hooks if hook is not mixup},
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "data": cfg.data.name,
        "seed": seed,
        "device": str(device),
        "torch": torch.__version__,
        "loss": cfg.trainer.loss,
        "precision": str(cfg.trainer.precision),
        "processes": dist.world,
        "paper": OmegaConf.to_container(cfg.paper, resolve=True) if cfg.get("paper") else None,
    }
    hook_objects = [hook for _, hook in hooks]
    return Run(model, data, mixup, hook_objects, optimizer, scheduler, device, epochs, settings, handles)


def build_model_and_data(cfg: DictConfig, dist: Dist | None = None) -> tuple[nn.Module, Data]:
    """Seed everything with ``cfg.seed``, then build the data and the model for it (what the layer
    browser needs, and the first part of :func:`build`)."""
    seed = _integer(cfg, "seed", minimum=0)
    batch_size = _integer(cfg, "trainer.batch_size", minimum=1)
    eval_batch_size = _integer(cfg, "trainer.eval_batch_size", minimum=1)
    _seed_everything(seed)
    data_options = OmegaConf.to_container(cfg.data, resolve=True)
    try:
        rank, world = (dist.rank, dist.world) if dist else (0, 1)
        data = build_data(
            batch_size=batch_size, eval_batch_size=eval_batch_size, seed=seed, rank=rank, world_size=world,
            **data_options,
        )  # fmt: skip
    except DataNotFoundError as err:
        raise ConfigError(str(err)) from err
    except (ValueError, TypeError) as err:
        raise ConfigError(f"data: {err}") from err
    model = _instantiate(cfg.model, "model", in_channels=data.in_channels, num_classes=data.num_classes)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model: {cfg.model._target_} built a {type(model).__name__}, not an nn.Module")
    return model, data


def probe_layers(cfg: DictConfig) -> list[str]:
    """``probes.layers`` as a list (empty: no probes)."""
    layers = OmegaConf.select(cfg, "probes.layers") or []
    return [layers] if isinstance(layers, str) else list(layers)


def _check_writable(out_dir: str) -> None:
    """Fail before anything else if the run directory cannot be created or written."""
    try:
        _make_writable_dir(out_dir)
    except OSError as err:
        raise ConfigError(f"the run directory {out_dir} cannot be written: {err.strerror or err}") from None


def _resume_state(cfg: DictConfig, out_dir: str, config: dict) -> dict | None:
    """The checkpoint to continue from (``trainer.resume``), checked to belong to this run's config;
    ``None`` for a fresh start. Refuses to start afresh over a run directory's existing checkpoint."""
    resume = cfg.trainer.get("resume")
    here = os.path.join(out_dir, ckpt.FILE)
    if resume is None:
        if os.path.exists(here):
            raise ConfigError(
                f"the run directory {out_dir} already holds a checkpoint ({ckpt.FILE}); continue it with "
                "trainer.resume=auto, or choose another hydra.run.dir"
            )
        return None
    if not isinstance(resume, str) or not resume:
        raise ConfigError(f"trainer.resume must be null, auto or a checkpoint path, got {resume!r}")
    if resume == "auto" and not os.path.exists(here):
        log.info("trainer.resume=auto: no %s in %s yet, starting from the beginning", ckpt.FILE, out_dir)
        return None
    path = here if resume == "auto" else resume
    try:
        state = ckpt.load(path)
    except ckpt.CheckpointError as err:
        raise ConfigError(f"trainer.resume: {err}") from None
    saved, current = _flat(state.get("config") or {}), _flat(config)
    for key in sorted(saved.keys() | current.keys()):
        if key in RESUMABLE_CHANGES or key.startswith("hydra."):
            continue
        old, new = saved.get(key, "<unset>"), current.get(key, "<unset>")
        if old != new:
            raise ConfigError(
                f"trainer.resume: {path} was written with {key}={old!r}, this run has {key}={new!r}; "
                "resume with the checkpoint's settings"
            )
    return state


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _build_hooks(cfg: DictConfig, seed: int) -> list[tuple[str, object]]:
    """Every configured hook with the config key it came from: ``mixup``, ``input_scale``,
    ``grad_scale``, ``grad_clip`` (each off while its ``layer`` is null) and the ``hooks`` list."""
    hooks: list[tuple[str, object]] = []
    if cfg.mixup.get("_target_"):
        hooks.append(
            ("mixup", _instantiate(cfg.mixup, "mixup", generator=torch.Generator().manual_seed(seed)))
        )
    simple = {"input_scale": InputScale, "grad_scale": GradScale, "grad_clip": GradClip}
    for key, cls in simple.items():
        options = OmegaConf.to_container(cfg[key], resolve=True)
        if options.get("layer") is None:
            continue
        if cls is InputScale:
            options["generator"] = torch.Generator().manual_seed(seed + 1)
        try:
            hooks.append((key, cls(**options)))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{key}: {err}") from err
    if probe_layers(cfg):
        every = OmegaConf.select(cfg, "probes.every")
        try:
            hooks.append(("probes", ActivationStats(probe_layers(cfg), every=every)))
            graded = [name for name in probe_layers(cfg) if name != INPUT]
            if graded:
                hooks.append(("probes.grad", GradStats(graded, every=every)))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"probes: {err}") from err
    for i, node in enumerate(cfg.hooks):
        key = f"hooks[{i}]"
        if not isinstance(node, DictConfig) or not node.get("_target_"):
            raise ConfigError(
                f"{key}: each entry needs a _target_ (a hook class such as mixhook.GradClip), got {node}"
            )
        hook = _instantiate(node, key)
        if not callable(getattr(hook, "attach", None)):
            raise ConfigError(
                f"{key}: {node._target_} built a {type(hook).__name__}, which has no attach(model)"
            )
        hooks.append((key, hook))
    return hooks


def _attach_and_check(model: nn.Module, hooks: list[tuple[str, object]], data: Data) -> list:
    """Attach every hook (resolving layer names) and run one sample batch through the model in eval
    mode, checking that it runs on this data and that each mixing layer returns what its regularizer
    can mix. Returns the handles; on any failure, what was attached is removed again."""
    handles: list = []
    try:
        for key, hook in hooks:
            try:
                handles.append(hook.attach(model))
            except UnknownLayerError as err:
                raise ConfigError(
                    f"{key}.layer: {err}. `python -m mixhook.layers` with this run's model and data "
                    "overrides lists every layer with its output and whether it can be mixed"
                ) from err
        _check_sample_batch(model, hooks, data)
    except BaseException:
        for handle in handles:
            if callable(getattr(handle, "remove", None)):
                handle.remove()
        raise
    return [h for h in handles if callable(getattr(h, "remove", None))]


def _check_sample_batch(model: nn.Module, hooks: list[tuple[str, object]], data: Data) -> None:
    x = next(iter(data.test))[0][:2]
    checks = [(key, hook) for key, hook in hooks if callable(getattr(hook, "check_output", None))]
    layers = list(dict.fromkeys(name for _, hook in checks for name in hook.layers))
    try:
        outputs = trace_outputs(model, layers, x)
    except Exception as err:  # whatever the model raises on this input is a model/data mismatch
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ConfigError(
            f"model: {type(model).__name__} fails on a {data.name} batch of shape {tuple(x.shape)}: "
            f"{type(err).__name__}: {reason}"
        ) from err
    for key, hook in checks:
        for name in hook.layers:
            if name not in outputs:
                raise ConfigError(f"{key}.layer: {name!r} does not run in {type(model).__name__}.forward()")
            try:
                hook.check_output(name, outputs[name], x.shape[0])
            except (TypeError, ValueError) as err:
                raise ConfigError(f"{key}.layer: {err}") from err


def _optimizer(cfg: DictConfig, model: nn.Module, epochs: int):
    for key, positive in (("lr", True), ("momentum", False), ("weight_decay", False)):
        value = cfg.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or value < 0 or (positive and value == 0):
            raise ConfigError(f"optim.{key} must be a number {'>' if positive else '>='} 0, got {value!r}")
    if not isinstance(cfg.nesterov, bool):
        raise ConfigError(f"optim.nesterov must be true or false, got {cfg.nesterov!r}")
    if cfg.nesterov and not cfg.momentum > 0:
        raise ConfigError(f"optim.nesterov=true needs optim.momentum > 0, got {cfg.momentum}")
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        nesterov=cfg.nesterov,
    )
    milestones = list(cfg.milestones)
    if cfg.scheduler == "multistep" and (
        not all(isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in milestones)
        or milestones != sorted(set(milestones))
    ):
        raise ConfigError(
            f"optim.milestones must be increasing epoch numbers >= 1 for multistep, got {milestones}"
        )
    if not cfg.gamma > 0:
        raise ConfigError(f"optim.gamma must be > 0, got {cfg.gamma}")
    schedulers = {
        "cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs),
        "multistep": lambda: torch.optim.lr_scheduler.MultiStepLR(
            optimizer, milestones=milestones, gamma=cfg.gamma
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

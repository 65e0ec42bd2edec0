"""Hydra glue: a composed config in, objects built and checked, the training loop run, accuracy out.

Everything a user can get wrong is checked in :func:`build` before the first training step; each
problem becomes a :class:`ConfigError` whose message is one line naming the config key, the bad value
and what would be valid. :func:`main` prints that line and exits with status 2 (in a multirun sweep the
job returns NaN instead and the sweep goes on; the report's callback ends the sweep with one line and
status 1).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import os
import random
import re
import sys

import numpy as np
import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf
from torch import nn

from mixhook.compose import mixers_of
from mixhook.layers import INPUT, UnknownLayerError, fastai_layers, trace_outputs
from mixhook.mixers import MixingHook
from mixhook.mixers.contract import members
from mixhook.mixers.partners import crosses_ranks
from mixhook.probes import ActivationStats, GradStats

from . import hydra_compat, schema
from .data import Data, DataNotFoundError, build_data
from .files import make_writable_dir
from .provenance import environment
from .records import RunRecords, torch_messages_to_log
from .training import Run, Settings, train
from .training import checkpoint as ckpt
from .training.distributed import Dist
from .training.finite import NonFiniteLoss, check_every
from .training.logging import RunLogger
from .training.loop import Interrupted
from .training.state import check_resumable

log = logging.getLogger("mixhook")


class ConfigError(ValueError):
    """A configuration problem, said in one line."""


def main(cfg: DictConfig, out_dir: str | None = None) -> float:
    """Build, check and run one experiment; return its final test accuracy (what Optuna maximises; minus
    the test RMSE for a regression task, so that maximising it still means better).

    Results go to ``out_dir``, by default the Hydra run's output directory. A configuration error exits
    with status 2, a non-finite loss with 3 and SIGTERM/SIGINT with 128 + the signal, each after one line
    on stderr (and in ``train.log``: :mod:`.records`). In a multirun, a job that fails so returns NaN
    after its line, and the sweep goes on; SIGTERM/SIGINT stops the sweep.
    """
    from hydra.core.hydra_config import HydraConfig

    if out_dir is None:
        out_dir = HydraConfig.get().runtime.output_dir
    records = RunRecords(cfg, out_dir)  # before anything is written: whose directory this is
    multirun = _in_multirun()
    try:
        return _main(cfg, out_dir, records)
    except (ConfigError, NonFiniteLoss, Interrupted) as err:
        if isinstance(err, Interrupted):  # status 128 + the signal, as a shell reports a kill
            line, status = str(err), 128 + err.signum
        else:
            line, status = f"error: {err}", 2 if isinstance(err, ConfigError) else 3
        records.failed(line, error=_error_line(err) if multirun else None)
        print(line, file=sys.stderr)
        if multirun:
            from .report import mark_failed

            mark_failed(HydraConfig.get().sweep.dir, HydraConfig.get().job.num, line)
        if multirun and not isinstance(err, Interrupted):
            # the job failed and the sweep goes on: its line is in error.txt for the sweep report, whose
            # callback ends the sweep with one line and a non-zero status (mixhook.app.report); Optuna
            # counts a NaN as a failed trial. (Raised, it would end the sweep in Hydra's traceback.)
            return math.nan
        if multirun:  # Ctrl-C or SIGTERM stops the sweep, not only this job: report it first
            from .report import write_report

            write_report(HydraConfig.get().sweep.dir)
        raise SystemExit(status) from None
    except Exception as err:  # a bug, not bad input: Hydra shows the traceback; the sweep report the line
        records.failed(f"error: {_error_line(err)}", error=_error_line(err) if multirun else None)
        raise


_TRAINING_BEGAN = [False]


def training_began() -> bool:
    """Whether this process has begun a run's training loop (``train.py``'s Ctrl-C handler asks: before,
    Ctrl-C ends the start-up at once)."""
    return _TRAINING_BEGAN[0]


def _error_line(err: BaseException) -> str:
    """What a sweep report says of a failed job: the error's type and its message's last line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"


def _main(cfg: DictConfig, out_dir: str, records: RunRecords) -> float:
    dist = Dist.from_env(cuda=_device(cfg.trainer.device).type == "cuda")
    records.enabled = dist.main  # rank 0 keeps the records
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.trainer.threads or default_threads(dist))
    try:
        return _run(cfg, dist.broadcast(out_dir), dist, records)  # every rank works in rank 0's run directory
    finally:
        torch.set_num_threads(threads)
        dist.close()


def default_threads(dist: Dist | None = None) -> int:
    """``trainer.threads=null``: ``$MIXHOOK_THREADS`` if set, else the CPU cores this process may use (its
    affinity: a SLURM or container limit), shared by the processes of a data-parallel job on this machine.
    Not what ``OMP_NUM_THREADS`` says: the joblib launcher sets it to 1 in its workers and torchrun to 1 per
    process, and CPU results depend on the thread count, so the same config gives the same numbers under
    every launcher."""
    env = os.environ.get("MIXHOOK_THREADS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ConfigError(f"MIXHOOK_THREADS={env!r}: a number of threads >= 1, or unset")
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if dist is not None and dist.enabled else 1
    return max(cores // max(local, 1), 1)


def _run(cfg: DictConfig, out_dir: str, dist: Dist, records: RunRecords) -> float:
    if not dist.main:
        log.setLevel(logging.WARNING)  # rank 0 reports
    _check_writable(out_dir)
    run = build(cfg, dist)
    try:
        run.config = OmegaConf.to_container(cfg, resolve=True)
        state = _resume_state(cfg, out_dir, run.config)
        records.accepted()
        log.info("%s on %s, %s, hooks %s -> %s", cfg.model.get("name", cfg.model._target_.rsplit(".", 1)[-1]),
                 cfg.data.name, run.device, run.hooks or "none", out_dir)  # fmt: skip
        if cfg.probes.feature_maps and probe_layers(cfg):
            x, y = next(iter(run.data.test))
            run.feature_maps = (probe_layers(cfg), x[:4], y[:4])
        logger = None
        if dist.main:
            try:
                logger = RunLogger(
                    out_dir, cfg.trainer.logger, run.hooks, state["global_step"] if state else None
                )
            except ValueError as err:
                raise ConfigError(str(err)) from err
        try:
            _TRAINING_BEGAN[0] = True
            with torch_messages_to_log():
                summary = train(run, out_dir, resume=state, dist=dist, logger=logger)
        except ckpt.CheckpointError as err:
            raise ConfigError(f"trainer.resume: {err}") from err
        finally:
            if logger is not None:
                logger.close()
    finally:  # no hook outlives the run, whatever ended it
        for handle in run.handles:
            handle.remove()
    if summary.get("task") == "regression":
        log.info(
            "done: test_rmse %.3f  best %.3f (epoch %d)  %.0fs  -> %s/summary.json", summary["test_rmse"],
            summary["best_test_rmse"], summary["best_epoch"], summary["seconds"], out_dir,
        )  # fmt: skip
        return -summary["test_rmse"]
    log.info(
        "done: test_acc %.2f%%  best %.2f%% (epoch %d)  test_nll %.4f  test_ece %.2f%%  %.0fs  "
        "-> %s/summary.json",
        100 * summary["test_acc"], 100 * summary["best_test_acc"], summary["best_epoch"],
        summary["test_nll"], 100 * summary["test_ece"], summary["seconds"], out_dir,
    )  # fmt: skip
    return summary["test_acc"]


def build(cfg: DictConfig, dist: Dist | None = None) -> Run:
    """Turn the config into checked objects. Raises :class:`ConfigError` for anything a user set wrong.

    ``dist``: in a data-parallel job, this rank's data share, CUDA device and random streams."""
    dist = dist or Dist()
    model, data = build_model_and_data(cfg, dist)  # checks the schema's ranges first
    device = dist.device if dist.enabled and dist.device.type == "cuda" else _device(cfg.trainer.device)

    if dist.enabled:  # the model is built alike on every rank; each rank then mixes its own way
        torch.manual_seed(dist.seed(cfg.seed))
    if OmegaConf.select(cfg, "mixup.layer") == "fastai":  # fastai's default candidates, named
        try:
            cfg.mixup.layer = fastai_layers(model)
        except ValueError as err:
            raise ConfigError(f"mixup.layer=fastai: {err}") from err
    hooks = _build_hooks(cfg, dist.seed(cfg.seed))
    if not dist.main:  # rank 0 probes its own batches; the others do not record what nobody writes
        hooks = [(key, hook) for key, hook in hooks if not key.startswith("probes")]
    mixers = mixers_of([hook for _, hook in hooks])
    if crosses_ranks(*mixers) and not dist.enabled:
        raise ConfigError(
            "mixup.partners=global draws partners from every rank's batch, but this run has one process; "
            "launch it with torchrun --nproc_per_node=N, or use mixup.partners=local"
        )
    if crosses_ranks(*mixers) and cfg.probes.feature_maps and probe_layers(cfg):
        raise ConfigError(
            "probes.feature_maps=true draws its pictures on rank 0 alone, which cannot mix with partners "
            "from the other ranks (mixup.partners=global); turn one of them off"
        )
    if len(mixers) > 1:
        keys = ", ".join(key for key, hook in hooks if hook in mixers)
        raise ConfigError(
            f"{len(mixers)} mixing regularizers configured ({keys}); "
            "each would mix every batch: keep one, or combine them in one entry with mixhook.OneOf"
        )
    mixup = mixers[0] if mixers else None
    if mixup is None and cfg.trainer.mixed_loss_weight != 1.0:
        raise ConfigError(
            f"trainer.mixed_loss_weight={cfg.trainer.mixed_loss_weight!r} weights the loss of mixed batches, "
            "but no mixup is configured; set a mixup or leave it at 1.0"
        )
    if data.task == "regression" and cfg.trainer.loss != "ce":
        raise ConfigError(
            f"trainer.loss={cfg.trainer.loss} trains on class probabilities, but data={data.name} is a "
            "regression task (trained with the squared error); use trainer.loss=ce"
        )
    if data.task == "regression" and cfg.probes.feature_maps and probe_layers(cfg):
        raise ConfigError(
            f"probes.feature_maps=true draws image feature maps, and data={data.name} has none; turn it off"
        )
    if mixup is not None and cfg.trainer.loss == "bce_softmax":
        for mixer in members(mixup):
            why = mixer.targets_refused() if hasattr(mixer, "targets_refused") else None
            if why:
                raise ConfigError(
                    "trainer.loss=bce_softmax trains on the mixer's soft targets, but "
                    f"{type(mixer).__name__} {why}; use trainer.loss=ce"
                )
    handles = _attach_and_check(model, hooks, data)
    try:
        optimizer = _optimizer(cfg.optim, model, _allowed(cfg))
        scheduler = _scheduler(cfg.scheduler, optimizer, _allowed(cfg))
        if (
            cfg.trainer.precision == "fp16"
            and isinstance(optimizer, torch.optim.SGD)
            and optimizer.defaults.get("fused")
        ):  # tests/e2e/test_precision.py shows it on this torch
            raise ConfigError(
                "optim.fused=true with trainer.precision=fp16: torch's fused SGD fills its momentum with "
                "uninitialised memory when the grad scaler skips a first step (LibreYOLO/libreyolo#771); "
                "use optim.fused=false or trainer.precision=bf16"
            )
        try:
            check_finite_every = check_every(cfg.trainer.check_finite_every, optimizer, device)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    trainer = cfg.trainer
    settings = Settings(
        epochs=trainer.epochs,
        loss=trainer.loss,
        precision=trainer.precision,
        compile=trainer.compile,
        channels_last=trainer.channels_last,
        progress_bar=trainer.progress_bar,
        checkpoint_every=trainer.checkpoint_every,
        mixed_loss_weight=trainer.mixed_loss_weight,
        check_finite_every=check_finite_every,
    )
    try:
        schedule = _schedule(cfg, mixup)
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    summary = {
        "mixup": OmegaConf.to_container(cfg.mixup, resolve=True),
        "schedule": repr(schedule) if schedule is not None else None,
        "hooks": {key: repr(hook) for key, hook in hooks if hook is not mixup},
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "data": cfg.data.name,
        "task": data.task,
        "data_split": data.split_hash,
        "seed": cfg.seed,
        "device": str(device),
        "torch": torch.__version__,
        "environment": environment(device),
        "loss": trainer.loss,
        "mixed_loss_weight": trainer.mixed_loss_weight,
        "precision": trainer.precision,
        "check_finite_every": check_finite_every,
        "processes": dist.world,
        "paper": OmegaConf.to_container(cfg.paper, resolve=True) if cfg.get("paper") else None,
    }
    return Run(
        model, data, optimizer, scheduler, device, settings,
        mixup=mixup, hooks=[hook for _, hook in hooks], handles=handles, summary=summary, schedule=schedule,
    )  # fmt: skip


def _schedule(cfg: DictConfig, mixup):
    """The run's :class:`~mixhook.MixSchedule` from ``schedule.*`` (``None`` when every key is at its
    default); a bad value is a :class:`ConfigError` naming the key."""
    from mixhook.schedule import MixSchedule, Ramp

    node = OmegaConf.to_container(cfg.schedule, resolve=True)
    if not node["off_epoch"] and all(node[k] is None for k in ("prob", "alpha", "layer_weights")):
        return None
    if mixup is None:
        raise ConfigError(
            "schedule.* is set but nothing mixes (mixup=none): set a mixup or drop the schedule"
        )

    def value(key):
        given = node[key]
        if isinstance(given, dict):
            unknown = set(given) - {"start", "end", "epochs", "shape"}
            if unknown or not {"start", "end", "epochs"} <= set(given):
                raise ConfigError(
                    f"schedule.{key}={given}: a ramp takes start, end, epochs and optionally shape "
                    "(linear or cosine)"
                )
            try:
                return Ramp(**given)
            except ValueError as err:
                raise ConfigError(f"schedule.{key}: {err}") from None
        return given

    prob, alpha = value("prob"), value("alpha")
    try:
        return MixSchedule(
            mixup, prob=prob, alpha=alpha, off_epoch=node["off_epoch"], layer_weights=node["layer_weights"]
        )
    except (TypeError, ValueError) as err:
        raise ConfigError(f"schedule: {err}") from None


def build_model_and_data(cfg: DictConfig, dist: Dist | None = None) -> tuple[nn.Module, Data]:
    """Check the config's ranges (:func:`mixhook.app.schema.check`), seed everything with ``cfg.seed``,
    then build the data and the model for it (what the layer browser needs, and the first part of
    :func:`build`)."""
    try:
        schema.check(cfg)
    except schema.SchemaError as err:
        raise ConfigError(str(err)) from None
    _seed_everything(cfg.seed)
    if cfg.data.get("pipeline") == "auto":  # resolved, so that a checkpoint names the batches it saw
        cfg.data.pipeline = "device"
    data_options = OmegaConf.to_container(cfg.data, resolve=True)
    dist = dist or Dist()
    device = dist.device if dist.enabled and dist.device.type == "cuda" else _device(cfg.trainer.device)
    try:
        data = build_data(
            batch_size=cfg.trainer.batch_size, eval_batch_size=cfg.trainer.eval_batch_size, seed=cfg.seed,
            rank=dist.rank, world_size=dist.world, device=device, **data_options,
        )  # fmt: skip
    except DataNotFoundError as err:
        raise ConfigError(str(err)) from err
    except (ValueError, TypeError) as err:
        raise ConfigError(f"data: {err}") from err
    try:
        model = _instantiate(
            cfg.model, "model", _allowed(cfg), in_channels=data.in_channels, num_classes=data.num_classes
        )
    except ConfigError as err:
        if data.task != "regression":
            raise
        raise ConfigError(f"{err} (data={data.name} is tabular: model=mlp)") from err
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
        make_writable_dir(out_dir)
    except OSError as err:
        raise ConfigError(f"the run directory {out_dir} cannot be written: {err.strerror or err}") from None


def _resume_state(cfg: DictConfig, out_dir: str, config: dict) -> dict | None:
    """The checkpoint to continue from (``trainer.resume``), checked to belong to this run's config;
    ``None`` for a fresh start. Refuses to start afresh over a run directory's existing checkpoint."""
    resume = cfg.trainer.get("resume")
    here = os.path.join(out_dir, ckpt.FILE)
    if resume is None:
        if os.path.exists(here):
            other = "hydra.sweep.dir" if _in_multirun() else "hydra.run.dir"
            raise ConfigError(
                f"the run directory {out_dir} already holds a checkpoint ({ckpt.FILE}); continue it with "
                f"trainer.resume=auto, or choose another {other}"
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
    saved_epochs = OmegaConf.select(OmegaConf.create(state.get("config") or {}), "trainer.epochs")
    as_saved = None
    if isinstance(saved_epochs, int) and saved_epochs != cfg.trainer.epochs:  # extending the run
        before = copy.deepcopy(cfg)
        before.trainer.epochs = saved_epochs
        as_saved = OmegaConf.to_container(before, resolve=True)
    try:
        check_resumable(state, config, as_saved)
    except ckpt.CheckpointError as err:
        raise ConfigError(f"trainer.resume: {path}: {err}") from None
    return state


def _build_hooks(cfg: DictConfig, seed: int) -> list[tuple[str, object]]:
    """Every configured hook with the config key it came from: ``mixup``, ``input_scale``,
    ``grad_scale``, ``grad_clip`` (``_target_`` nodes, each off while its ``layer`` is null), the
    probes and the ``hooks`` list. A hook whose constructor takes a ``generator`` and is not given one
    gets its own, seeded from ``seed`` and its place (so that ``seed`` changes every hook's draws)."""
    hooks: list[tuple[str, object]] = []
    patterns = _allowed(cfg)
    if cfg.mixup.get("_target_"):
        hooks.append(("mixup", _build_hook(cfg.mixup, "mixup", seed, patterns)))
    for offset, key in enumerate(("input_scale", "grad_scale", "grad_clip"), start=1):
        if cfg[key].get("layer") is not None:
            hooks.append((key, _build_hook(cfg[key], key, seed + offset, patterns)))
    if probe_layers(cfg):
        every = cfg.probes.every
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
        hooks.append((key, _build_hook(node, key, seed + 4 + i, patterns)))
    return hooks


def _build_hook(node: DictConfig, key: str, seed: int, patterns: tuple[str, ...] = hydra_compat.TRUSTED):
    """The hook a ``_target_`` node describes, checked to have ``attach(model)``."""
    extra = {}
    if "generator" not in node and "generator" in _parameters(node._target_):
        extra["generator"] = torch.Generator().manual_seed(seed)
    hook = _instantiate(node, key, patterns, **extra)
    if not callable(getattr(hook, "attach", None)):
        raise ConfigError(f"{key}: {node._target_} built a {type(hook).__name__}, which has no attach(model)")
    return hook


def _parameters(target: str) -> set[str]:
    """The names of the parameters of what ``target`` names (empty when it cannot be found: building it
    then says why)."""
    try:
        return set(inspect.signature(_object(target)).parameters)
    except Exception:  # noqa: BLE001
        return set()


def _object(target: str):
    """What ``target`` names, or ``None`` when it cannot be found (building it then says why)."""
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception:  # noqa: BLE001
        return None


def _layer_key(hook, err: UnknownLayerError) -> str:
    """The config key that named the unknown layer: ``layer``, or a method's other layer argument
    (TransMix's ``attention``, the saliency methods' ``saliency_layer``)."""
    named = re.search(r"unknown layer '([^']+)'", str(err))
    if named and getattr(hook, "attention", None) == named[1]:
        return "attention"
    if named and getattr(getattr(hook, "saliency", None), "layer", None) == named[1]:
        return "saliency_layer"
    return "layer"


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
                    f"{key}.{_layer_key(hook, err)}: {err}. `python -m mixhook.layers` with this run's model "
                    "and data overrides lists every layer with its output and whether it can be mixed"
                ) from err
        _check_sample_batch(model, hooks, data)
    except BaseException:
        for handle in handles:
            if callable(getattr(handle, "remove", None)):
                handle.remove()
        raise
    return [h for h in handles if callable(getattr(h, "remove", None))]


def _check_sample_batch(model: nn.Module, hooks: list[tuple[str, object]], data: Data) -> None:
    x, y = (t[:2] for t in next(iter(data.test)))
    for key, hook in hooks:
        if isinstance(hook, MixingHook):
            try:
                hook.check_targets(y)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"{key}: {err}; data={data.name} has {y.dtype} labels") from err
    checks = [(key, hook) for key, hook in hooks if callable(getattr(hook, "check_output", None))]
    layers = list(dict.fromkeys(name for _, hook in checks for name in hook.layers))
    norms = _batchnorm_inputs(model) if _one_sample_batches(data) else None
    try:
        with norms or contextlib.nullcontext():
            outputs = trace_outputs(model, layers, x)
    except Exception as err:  # whatever the model raises on this input is a model/data mismatch
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        hint = f" (data={data.name} is tabular: model=mlp)" if data.task == "regression" else ""
        raise ConfigError(
            f"model: {type(model).__name__} fails on a {data.name} batch of shape {tuple(x.shape)}{hint}: "
            f"{type(err).__name__}: {reason}"
        ) from err
    if norms is not None:
        _check_one_sample(model, norms.shapes, x.shape[0], data)
    for key, hook in checks:
        for name in hook.layers:
            if name not in outputs:
                raise ConfigError(f"{key}.layer: {name!r} does not run in {type(model).__name__}.forward()")
            try:
                hook.check_output(name, outputs[name], x.shape[0], model_input=x)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"{key}.layer: {err}") from err


def _one_sample_batches(data: Data) -> bool:
    """Whether a training batch can hold a single sample: ``trainer.batch_size=1``, or a training share of
    one sample (the sampler leaves out a last batch of one only when there are others)."""
    return data.train.batch_size == 1 or len(data.train.sampler) == 1


class _batchnorm_inputs:
    """While entered, the input shape of every BatchNorm layer of ``model`` the forward reaches, by name
    (``shapes``), recorded by forward pre-hooks that it removes on exit."""

    def __init__(self, model: nn.Module):
        self.model, self.shapes, self.handles = model, {}, []

    def __enter__(self):
        for name, module in self.model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                self.handles.append(module.register_forward_pre_hook(self._record(name)))
        return self

    def _record(self, name: str):
        def hook(module, args):
            if args and isinstance(args[0], torch.Tensor):
                self.shapes.setdefault(name, tuple(args[0].shape))

        return hook

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return False


def _check_one_sample(model: nn.Module, shapes: dict[str, tuple], batch: int, data: Data) -> None:
    """Refuse, before training, a run whose batches of one sample a BatchNorm layer cannot train on: in
    training mode it needs more than one value per channel (torch raises in the first step otherwise);
    ``shapes`` are the layers' inputs for a sample batch of ``batch`` samples."""
    for name, shape in shapes.items():
        if len(shape) >= 2 and math.prod(shape) // (batch * shape[1]) == 1:
            one = data.train.batch_size == 1
            what = "trainer.batch_size=1" if one else "a training set of one sample (data.train_size)"
            raise ConfigError(
                f"{what}: {type(model).__name__}'s BatchNorm layer {name!r} would see one value per channel "
                f"(its input for one sample is {(1, *shape[1:])}), which it cannot train on; use "
                "trainer.batch_size=2 or more"
            )


def _optimizer(
    node: DictConfig, model: nn.Module, patterns: tuple[str, ...] = hydra_compat.TRUSTED
) -> torch.optim.Optimizer:
    """The ``optim`` node's ``torch.optim`` optimizer over the model's parameters (its constructor
    checks the values: ``optim: Invalid learning rate: -1``)."""
    if not node.get("_target_"):
        raise ConfigError("optim needs a _target_ (an optimizer class such as torch.optim.SGD)")
    optimizer = _instantiate(node, "optim", patterns, params=model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optim: {node._target_} built a {type(optimizer).__name__}, not a torch.optim optimizer"
        )
    return optimizer


def _scheduler(
    node: DictConfig, optimizer: torch.optim.Optimizer, patterns: tuple[str, ...] = hydra_compat.TRUSTED
):
    """The ``scheduler`` node's learning-rate schedule on ``optimizer`` (``None`` without a
    ``_target_``), stepped once at the end of every epoch."""
    if not node.get("_target_"):
        return None
    plateau = ConfigError(
        "scheduler: ReduceLROnPlateau steps on a validation metric, and this app has only the test "
        "set: choose a schedule over epochs (cosine, multistep, or any other torch.optim.lr_scheduler)"
    )
    target = _object(node._target_)  # refused by its class, before the default's T_max fails it
    if isinstance(target, type) and issubclass(target, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise plateau
    scheduler = _instantiate(node, "scheduler", patterns, optimizer=optimizer)
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise plateau
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ConfigError(
            f"scheduler: {node._target_} built a {type(scheduler).__name__}, not a torch.optim.lr_scheduler"
        )
    return scheduler


def _allowed(cfg: DictConfig) -> tuple[str, ...]:
    """The execution whitelist: the app's own targets and ``allow_targets`` (:mod:`.hydra_compat`)."""
    try:
        return hydra_compat.allowed(OmegaConf.select(cfg, "allow_targets") or ())
    except hydra_compat.TargetNotAllowed as err:
        raise ConfigError(str(err)) from None


def _instantiate(node: DictConfig, key: str, patterns: tuple[str, ...] = hydra_compat.TRUSTED, **kwargs):
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

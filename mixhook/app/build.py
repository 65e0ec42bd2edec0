"""A composed config in, one checked :class:`~mixhook.app.training.Run` out: the model and data, the
hooks, the optimizer and the schedule; everything a user can get wrong is refused here, before training,
as a :class:`~mixhook.app.errors.ConfigError`."""

from __future__ import annotations

import logging
import random

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from mixhook.compose import mixers_of
from mixhook.engine.card import traits_of
from mixhook.engine.contract import members
from mixhook.engine.partners import crosses_ranks
from mixhook.layers import INPUT, fastai_layers
from mixhook.policies import KNOBS
from mixhook.probes import ActivationStats, GradStats

from . import hydra_compat, schema
from .data import Data, DataNotFoundError, build_data
from .errors import ConfigError
from .instantiate import allowed_targets, instantiate, parameters_of, target_object
from .preflight import attach_and_check
from .provenance import environment
from .training import Run, Settings
from .training.distributed import Dist, shard, shard_units
from .training.finite import check_every
from .training.task import task_for

log = logging.getLogger("mixhook")

ERASING_SEED = 1_000_003  # erasing's generator: seed + this (the hooks list's are seed + 4 + i)


def build(cfg: DictConfig, dist: Dist | None = None) -> Run:
    """Turn the config into checked objects. Raises :class:`ConfigError` for anything a user set wrong.

    ``dist``: in a data-parallel job, this rank's data share, CUDA device and random streams."""
    dist = dist or Dist()
    model, data = build_model_and_data(cfg, dist)  # checks the schema's ranges first
    device = dist.device if dist.enabled and dist.device.type == "cuda" else device_of(cfg.trainer.device)
    units = _check_strategy(cfg, dist, model)

    if dist.enabled:  # the model is built alike on every rank; each rank then mixes its own way
        torch.manual_seed(dist.seed(cfg.seed))
    if OmegaConf.select(cfg, "mixup.layer") == "fastai":  # fastai's default candidates, named
        try:
            cfg.mixup.layer = fastai_layers(model)
        except ValueError as err:
            raise ConfigError(f"mixup.layer=fastai: {err}") from err
    hooks = build_hooks(cfg, dist.seed(cfg.seed))
    if not dist.main:  # rank 0 probes its own batches; the others do not record what nobody writes
        hooks = [(key, hook) for key, hook in hooks if not key.startswith("probes")]
    task = task_for(data, cfg.trainer.loss)  # what the run learns (refused here where the loss cannot)
    mixup = _the_mixer(cfg, hooks, data, dist)
    _span_the_run(cfg, mixup, data)
    _feed_policies(cfg, mixup, data)
    _give_pixels(mixup, data)
    _check_soft_targets(cfg, mixup)
    handles = attach_and_check(model, hooks, data)
    try:  # (a refusal from here on leaves the model without the hooks)
        optimizer, scheduler, check_finite_every = _optimization(cfg, model, units, device, dist, mixup)
        schedule = _schedule(cfg, mixup)
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
        warmup_epochs=trainer.warmup_epochs,
        warmup_start_factor=trainer.warmup_start_factor,
        eval_every=trainer.eval_every,
    )
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
        "warmup": _warmup(trainer),
        "mixed_loss_weight": trainer.mixed_loss_weight,
        "precision": trainer.precision,
        "check_finite_every": check_finite_every,
        "processes": dist.world,
        "strategy": trainer.strategy if dist.enabled else None,  # (trainer.strategy: ddp or fsdp)
        "paper": OmegaConf.to_container(cfg.paper, resolve=True) if cfg.get("paper") else None,
        # each hook's layer specs as written and the real layers they named on this model (stage:2 -> layer2)
        "layers": {
            key: {spec: list(names) for spec, names in hook.resolved.items()}
            for key, hook in hooks
            if getattr(hook, "resolved", None)
        },
    }
    return Run(
        model, data, optimizer, scheduler, device, settings,
        mixup=mixup, hooks=[hook for _, hook in hooks], handles=handles, summary=summary, schedule=schedule,
        task=task,
    )  # fmt: skip


def _span_the_run(cfg: DictConfig, mixup, data) -> None:
    """Every mixer told the run's optimizer steps (``span``: a schedule over the run, AutoMix's
    momentum's)."""
    for mixer in members(mixup) if mixup is not None else ():
        mixer.span(cfg.trainer.epochs * len(data.train))


def _the_mixer(cfg: DictConfig, hooks: list, data, dist: Dist):
    """The one mixing regularizer among ``hooks`` (``None``: none), refused in one line where the run
    cannot train with it (partners from every rank in one process, two mixers, its settings against the
    task)."""
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
    if not data.images and cfg.probes.feature_maps and probe_layers(cfg):
        raise ConfigError(
            f"probes.feature_maps=true draws image feature maps, and data={data.name} has none; turn it off"
        )
    return mixup


def _optimization(
    cfg: DictConfig, model: nn.Module, units, device: torch.device, dist: Dist, mixup=None
) -> tuple:
    """The model sharded where asked (after its hooks, before the optimizer), its optimizer (over the
    model's parameters and the mixer's own: AutoMix's Mix Block), scheduler and how often the loss is
    checked for a non-finite value; a combination torch gets wrong refused."""
    _shard(model, units, device, dist)
    own = list(mixup.parameters()) if mixup is not None else []
    options = mixup.parameter_options() if own else {}
    optimizer = _optimizer(cfg.optim, model, allowed_targets(cfg), own, options)
    scheduler = _scheduler(cfg.scheduler, optimizer, allowed_targets(cfg))
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
        return optimizer, scheduler, check_every(cfg.trainer.check_finite_every, optimizer, device)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _shard(model: nn.Module, units: list[str] | None, device: torch.device, dist: Dist) -> None:
    """With ``trainer.strategy=fsdp`` (``units``, from :func:`_check_strategy`; ``None``: DDP, nothing done
    here): ``model``, its hooks attached, on ``device``, sharded over the job's ranks: each of ``units``,
    then the model. The optimizer is built over the shards after it."""
    if units is None:
        return
    model.to(device)
    shard(model, units, dist)


def _check_strategy(cfg: DictConfig, dist: Dist, model: nn.Module) -> list[str] | None:
    """The modules FSDP shards one by one with ``trainer.strategy=fsdp`` (``None``: ``ddp``); refuse, in one
    line, a strategy the run cannot train with."""
    trainer = cfg.trainer
    if trainer.strategy != "fsdp":
        if trainer.fsdp_units is not None:
            raise ConfigError(
                f"trainer.fsdp_units={list(trainer.fsdp_units)} names the units FSDP shards, but "
                f"trainer.strategy={trainer.strategy}; set trainer.strategy=fsdp, or leave fsdp_units null"
            )
        return None
    try:
        units = shard_units(model, None if trainer.fsdp_units is None else list(trainer.fsdp_units))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not dist.enabled:
        raise ConfigError(
            "trainer.strategy=fsdp shards the model over the processes of a job, but this run has one; "
            "launch it with torchrun --nproc_per_node=N (or Hydra's submitit launcher with tasks_per_node), "
            "or use trainer.strategy=ddp"
        )
    refused = [  # (what is set, why a sharded run does not train with it)
        (trainer.compile, "trainer.compile=true", "compiling a sharded model is not tested by the app"),
        (
            trainer.precision == "fp16",
            "trainer.precision=fp16",
            "the fp16 grad scaler is not tested on sharded gradients (use bf16)",
        ),
        (
            trainer.channels_last,
            "trainer.channels_last=true",
            "FSDP2 shards contiguous parameters only (torch refuses a channels-last weight)",
        ),
        (
            bool(cfg.probes.feature_maps and probe_layers(cfg)),
            "probes.feature_maps=true",
            "the pictures are drawn by rank 0 alone, and a sharded model's forward needs every rank",
        ),
    ]
    for set_, key, why in refused:
        if set_:
            raise ConfigError(f"{key} with trainer.strategy=fsdp: {why}; turn one of them off")
    return units


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
    seed_everything(cfg.seed)
    if cfg.data.get("pipeline") == "auto":  # resolved, so that a checkpoint names the batches it saw
        cfg.data.pipeline = "device"
    data_options = OmegaConf.to_container(cfg.data, resolve=True)
    dist = dist or Dist()
    device = dist.device if dist.enabled and dist.device.type == "cuda" else device_of(cfg.trainer.device)
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
        model = instantiate(
            cfg.model,
            "model",
            allowed_targets(cfg),
            in_channels=data.in_channels,
            num_classes=data.num_classes,
        )
    except ConfigError as err:
        if data.images:
            raise
        raise ConfigError(  # (the image models' own message, about channels and classes, would mislead)
            f"model: data={data.name} is tabular ({data.in_channels} features, a {data.task} target): train "
            "it with model=mlp"
        ) from err
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model: {cfg.model._target_} built a {type(model).__name__}, not an nn.Module")
    return model, data


def probe_layers(cfg: DictConfig) -> list[str]:
    """``probes.layers`` as a list (empty: no probes)."""
    layers = OmegaConf.select(cfg, "probes.layers") or []
    return [layers] if isinstance(layers, str) else list(layers)


def build_hooks(cfg: DictConfig, seed: int) -> list[tuple[str, object]]:
    """Every configured hook with the config key it came from: ``mixup``, ``erasing`` (off as
    ``erasing=none``), ``input_scale``, ``grad_scale``, ``grad_clip`` (``_target_`` nodes, each off while
    its ``layer`` is null), the probes and the ``hooks`` list. A hook whose constructor takes a
    ``generator`` and is not given one gets its own, seeded from ``seed`` and its place (so that ``seed``
    changes every hook's draws)."""
    hooks: list[tuple[str, object]] = []
    patterns = allowed_targets(cfg)
    if cfg.mixup.get("_target_"):
        hooks.append(("mixup", build_hook(cfg.mixup, "mixup", seed, patterns)))
    if cfg.get("erasing") and cfg.erasing.get("_target_"):
        hooks.append(("erasing", build_hook(cfg.erasing, "erasing", seed + ERASING_SEED, patterns)))
    for offset, key in enumerate(("input_scale", "grad_scale", "grad_clip"), start=1):
        if cfg[key].get("layer") is not None:
            hooks.append((key, build_hook(cfg[key], key, seed + offset, patterns)))
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
        hooks.append((key, build_hook(node, key, seed + 4 + i, patterns)))
    return hooks


def build_hook(node: DictConfig, key: str, seed: int, patterns: tuple[str, ...] = hydra_compat.TRUSTED):
    """The hook a ``_target_`` node describes, checked to have ``attach(model)``; a mixer's ``policies``
    node (``partners``, ``lam``, ``target``, ``weights``, ``loss``: a policy's ``_target_`` node each, or
    null) is built and given to it (``mixer.use(...)``)."""
    extra = {}
    policies = None
    if "policies" in node and "policies" not in parameters_of(node._target_):
        policies = node.policies
        node = OmegaConf.masked_copy(node, [k for k in node if k != "policies"])
    if "generator" not in node and "generator" in parameters_of(node._target_):
        extra["generator"] = torch.Generator().manual_seed(seed)
    hook = instantiate(node, key, patterns, **extra)
    if not callable(getattr(hook, "attach", None)):
        raise ConfigError(f"{key}: {node._target_} built a {type(hook).__name__}, which has no attach(model)")
    if policies is not None:
        _use_policies(hook, policies, f"{key}.policies", patterns)
    return hook


def _use_policies(hook, node, key: str, patterns: tuple[str, ...]) -> None:
    """``hook.use(...)`` the policies of a ``policies`` node, each under the knob it sets."""
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{key} must map knobs ({', '.join(KNOBS)}) to policies, got {node!r}")
    if not callable(getattr(hook, "use", None)):
        raise ConfigError(f"{key}: {type(hook).__name__} takes no policies")
    chosen = []
    for knob, value in node.items():
        if value is None:  # (a knob turned off: mixup.policies.target=null)
            continue
        where = f"{key}.{knob}"
        if knob not in KNOBS:
            raise ConfigError(f"{where}: {knob!r} is not a knob of a mix; valid: {', '.join(KNOBS)}")
        if not isinstance(value, DictConfig) or not value.get("_target_"):
            raise ConfigError(
                f"{where} needs a _target_ (a policy such as mixhook.policies.Remix), got {value}"
            )
        policy = instantiate(value, where, patterns)
        if getattr(policy, "knob", None) != knob:
            raise ConfigError(
                f"{where}: {type(policy).__name__} sets the {getattr(policy, 'knob', '?')} of a mix, not its "
                f"{knob}; put it under {key}.{getattr(policy, 'knob', '?')}"
            )
        chosen.append(policy)
    try:
        hook.use(*chosen)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{key}: {err}") from None


def _check_soft_targets(cfg: DictConfig, mixup) -> None:
    """``trainer.loss=bce_softmax`` trains on the mixer's soft targets: refuse a mixer (or a policy) whose
    loss is more than a criterion of them."""
    if mixup is not None and cfg.trainer.loss == "bce_softmax":
        for mixer in members(mixup):
            changing = [type(p).__name__ for p in getattr(mixer, "policies", ()) if p.changes_loss]
            if changing:
                raise ConfigError(
                    "trainer.loss=bce_softmax trains on the mixer's soft targets, but "
                    f"{', '.join(changing)} weights or adds to its loss beyond them; use trainer.loss=ce"
                )
            why = mixer.targets_refused() if hasattr(mixer, "targets_refused") else None
            if why:
                raise ConfigError(
                    "trainer.loss=bce_softmax trains on the mixer's soft targets, but "
                    f"{type(mixer).__name__} {why}; use trainer.loss=ce"
                )


def _give_pixels(mixup, data: Data) -> None:
    """A mixer whose operations read pixel values (its card's trait ``"pixels"``: AugMix, PuzzleMix) and
    that was given no ``mean``/``std`` gets the data's normalisation, logged (the one-line refusal of data
    that has none stays its own)."""
    for mixer in members(mixup) if mixup is not None else []:
        if "pixels" in traits_of(mixer) and mixer.mean is None and data.normalization is not None:
            mixer.mean, mixer.std = (list(v) for v in data.normalization)
            log.info("mixup: %s reads pixels: mean=%s, std=%s (data=%s's normalisation)",
                     type(mixer).__name__, mixer.mean, mixer.std, data.name)  # fmt: skip


def _feed_policies(cfg: DictConfig, mixup, data: Data) -> None:
    """What the mixers and their policies need from the data: the training set's class counts (a method
    whose card states ``"class_counts"``, a policy that ``needs_class_counts``: Remix) where not given, a
    partner batch per step (:meth:`~mixhook.app.data.Data.partner_batches`)."""
    mixers = members(mixup) if mixup is not None else []
    policies = [p for mixer in mixers for p in getattr(mixer, "policies", ())]
    counted = [(m, "mixup") for m in mixers if "class_counts" in traits_of(m)]
    counted += [(p, "mixup.policies.target") for p in policies if p.needs_class_counts]
    for holder, key in counted:
        if holder.counts is None:
            if data.class_counts is None:
                raise ConfigError(
                    f"{key}: {type(holder).__name__} needs classes, and data={data.name} has none"
                )
            holder.counts = data.class_counts
    if any(policy.needs_partner_batch for policy in policies):
        if data.make_partners is None:
            raise ConfigError(
                "mixup.policies.partners: the mixer mixes with a class-balanced partner batch, and "
                f"data={data.name} has no classes"
            )
        if cfg.probes.feature_maps and probe_layers(cfg):
            raise ConfigError(
                "probes.feature_maps=true pins a mix of the batch with itself reversed, but the mixer draws "
                "its partners from a second batch (mixup.policies.partners); turn one of them off"
            )
        data.partner_batches()


def _optimizer(
    node: DictConfig,
    model: nn.Module,
    patterns: tuple[str, ...] = hydra_compat.TRUSTED,
    extra=(),
    options: dict | None = None,
) -> torch.optim.Optimizer:
    """The ``optim`` node's ``torch.optim`` optimizer over the model's parameters and ``extra`` (a mixer's
    own: one more group with its ``options`` where it has some; its constructor checks the values:
    ``optim: Invalid learning rate: -1``)."""
    if not node.get("_target_"):
        raise ConfigError("optim needs a _target_ (an optimizer class such as torch.optim.SGD)")
    params = [*model.parameters(), *extra]
    if extra and options:
        params = [{"params": list(model.parameters())}, {"params": list(extra), **options}]
    optimizer = instantiate(node, "optim", patterns, params=params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optim: {node._target_} built a {type(optimizer).__name__}, not a torch.optim optimizer"
        )
    return optimizer


def _warmup(trainer) -> dict | None:
    """``summary.json``'s record of the learning-rate warm-up (``None``: none); a warm-up longer than the
    run is said in the log."""
    if not trainer.warmup_epochs:
        return None
    if trainer.warmup_epochs > trainer.epochs:
        log.warning(
            "trainer.warmup_epochs=%d is longer than the run (trainer.epochs=%d): the learning rate never "
            "reaches the scheduler's", trainer.warmup_epochs, trainer.epochs,
        )  # fmt: skip
    return {"epochs": trainer.warmup_epochs, "start_factor": trainer.warmup_start_factor}


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
    target = target_object(node._target_)  # refused by its class, before the default's T_max fails it
    if isinstance(target, type) and issubclass(target, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise plateau
    scheduler = instantiate(node, "scheduler", patterns, optimizer=optimizer)
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise plateau
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ConfigError(
            f"scheduler: {node._target_} built a {type(scheduler).__name__}, not a torch.optim.lr_scheduler"
        )
    return scheduler


def device_of(spec: str) -> torch.device:
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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

"""The app's config schema: Hydra structured configs (dataclasses in Hydra's ConfigStore) for the groups
whose keys the app reads itself, with every range said once, beside its key.

The YAML files under ``conf/`` keep the defaults and the comments users read; each one extends its
schema here (``defaults: [<group>_schema, _self_]``; the root config extends ``base_config``), so
Hydra refuses a key that is not in the schema and converts or refuses a value of the wrong type while
composing.

The nodes that name an object to build (``model``, ``mixup``, ``optim``, ``scheduler``, the hooks: a
``_target_`` and its arguments) have no fixed keys, since any class can be named: their values are
checked against the signature of the class they name (a number where its default is a number, true or
false where it is a bool), and the ranges torch leaves unchecked are in :data:`TARGET_RULES`.

:func:`check` checks all of it in one place and raises :class:`SchemaError` with one line naming the
key, the bad value and what is valid.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from .data import CROPS, NORMALIZE, PIPELINES, SAMPLERS
from .models.preact_resnet import SHORTCUTS
from .training.distributed import STRATEGIES
from .training.forward import PRECISIONS
from .training.logging import LOGGERS
from .training.task import LOSSES


class SchemaError(ValueError):
    """A config value outside its range, said in one line."""


def _at_least(minimum: int, default: Any):
    return field(default=default, metadata={"min": minimum})


def _one_of(choices, default: Any):
    return field(default=default, metadata={"choices": tuple(choices)})


# data.imbalance_ratio: the largest training class over the smallest (data.long_tail_subset; null: as is)
IMBALANCE = field(default=None, metadata={"closed": (1.0, math.inf)})


@dataclass
class TrainerConfig:
    epochs: int = _at_least(1, 15)
    batch_size: int = _at_least(1, 64)
    eval_batch_size: int = _at_least(1, 512)
    device: str = "auto"
    progress_bar: bool = True
    logger: str = _one_of(LOGGERS, "csv")
    precision: str = _one_of(PRECISIONS, "32")
    compile: bool = False
    channels_last: bool = False
    loss: str = _one_of(LOSSES, "ce")
    mixed_loss_weight: float = field(default=1.0, metadata={"open": (0.0, math.inf)})
    warmup_epochs: int = _at_least(0, 0)  # a linear warm-up of the learning rate (training.warmup)
    warmup_start_factor: float = field(default=0.1, metadata={"closed": (0.0, 1.0)})
    checkpoint_every: int = _at_least(0, 0)
    eval_every: int = _at_least(1, 1)  # test every this many epochs, and after the last
    check_finite_every: int | None = _at_least(1, None)
    resume: str | None = None
    threads: int | None = _at_least(1, None)  # torch's intra-op threads (null: training.threads.default)
    strategy: str = _one_of(STRATEGIES, "ddp")  # how a job of several processes trains (training.distributed)
    fsdp_units: list[str] | None = None  # the modules FSDP shards as units (null: each child with parameters)


@dataclass
class DigitsConfig:
    name: str = "digits"
    test_size: float = field(default=0.2, metadata={"open": (0.0, 1.0)})
    split_seed: int = _at_least(0, 0)
    train_size: int | None = _at_least(10, None)
    imbalance_ratio: float | None = IMBALANCE
    sampler: str = _one_of(SAMPLERS, "random")  # random: a permutation per epoch; balanced: classes equally


@dataclass
class DiabetesConfig:
    name: str = "diabetes"
    test_size: float = field(default=0.2, metadata={"open": (0.0, 1.0)})
    split_seed: int = _at_least(0, 0)
    train_size: int | None = _at_least(10, None)


@dataclass
class CifarConfig:
    name: str = MISSING
    root: str = "data"
    download: bool = False
    augment: bool = True
    padding: int = _at_least(0, 4)  # the random crop's zero padding, in pixels (augment=true)
    per_class: int | None = _at_least(1, None)  # at most this many training images per class
    subset_seed: int = _at_least(0, 0)  # the seed of that subset
    mean: list[float] | None = None  # the normalisation (null: the data set's own)
    std: list[float] | None = None
    num_workers: int = _at_least(0, 2)
    pipeline: str = _one_of(PIPELINES, "auto")
    imbalance_ratio: float | None = IMBALANCE
    sampler: str = _one_of(SAMPLERS, "random")


@dataclass
class SvhnConfig(CifarConfig):  # CIFAR's keys and pipelines, and the extra split
    name: str = "svhn"
    root: str = "data/svhn"
    augment: bool = False
    extra: bool = False


@dataclass
class MnistConfig(CifarConfig):  # CIFAR's keys and pipelines; the files looked for where root is null
    name: str = MISSING
    root: str | None = None
    flip: bool = False


@dataclass
class ImageFolderConfig:
    name: str = "imagefolder"
    root: str = "data/imagenet"
    train: str = "train"
    val: str = "val"
    size: int = _at_least(1, 224)
    resize: int = _at_least(1, 256)
    augment: bool = True
    color_jitter: float = 0.0  # (>= 0: the data builder checks it)
    lighting: float = 0.0
    num_workers: int = _at_least(0, 8)
    normalize: str = _one_of(NORMALIZE, "workers")
    crop: str = _one_of(CROPS, "resized")
    padding: int = _at_least(0, 4)  # crop=padded: the random crop's zero padding, in pixels
    mean: list[float] | None = None  # the normalisation (null: ImageNet's)
    std: list[float] | None = None
    imbalance_ratio: float | None = IMBALANCE
    subset_seed: int = _at_least(0, 0)  # the seed of the long tail's images
    sampler: str = _one_of(SAMPLERS, "random")


@dataclass
class InputScaleConfig:
    _target_: str = "mixhook.InputScale"
    layer: Any = None
    factor: Any = 1.0  # a number, or [low, high]: the constructor checks it
    in_eval: bool = False


@dataclass
class GradScaleConfig:
    _target_: str = "mixhook.GradScale"
    layer: Any = None
    factor: float = 1.0


@dataclass
class GradClipConfig:
    _target_: str = "mixhook.GradClip"
    layer: Any = None
    max_norm: float = 1.0


@dataclass
class ProbesConfig:
    layers: Any = field(default_factory=list)  # a layer name or a list of them
    every: int = _at_least(1, 50)
    feature_maps: bool = False


@dataclass
class ScheduleConfig:
    off_epoch: int = _at_least(0, 0)
    prob: Any = None  # a number, or a ramp {start, end, epochs, shape}
    alpha: Any = None
    layer_weights: Any = None  # one weight per layer of mixup.layer


@dataclass
class Config:
    seed: int = _at_least(0, 0)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # before scheduler: T_max is epochs
    paper: Any = None
    data: Any = MISSING
    model: Any = MISSING
    mixup: Any = MISSING
    erasing: Any = field(default_factory=dict)  # (erasing=none: {})
    optim: Any = MISSING
    scheduler: Any = MISSING
    input_scale: InputScaleConfig = field(default_factory=InputScaleConfig)
    grad_scale: GradScaleConfig = field(default_factory=GradScaleConfig)
    grad_clip: GradClipConfig = field(default_factory=GradClipConfig)
    hooks: list[Any] = field(default_factory=list)
    probes: ProbesConfig = field(default_factory=ProbesConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    allow_targets: list[str] = field(default_factory=list)  # _target_s beyond mixhook.* and torch.optim.*


def register() -> None:
    """Put the schemas into Hydra's ConfigStore (idempotent): ``base_config`` for the root config,
    ``<group>/<name>_schema`` for the group options that extend one, and ``mixup/<name>`` for each method
    without a config file (:func:`mixhook.app.methods.register`)."""
    from . import methods

    methods.register()
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    store.store(group="data", name="digits_schema", node=DigitsConfig)
    store.store(group="data", name="cifar_schema", node=CifarConfig)
    store.store(group="data", name="diabetes_schema", node=DiabetesConfig)
    store.store(group="data", name="svhn_schema", node=SvhnConfig)
    store.store(group="data", name="mnist_schema", node=MnistConfig)
    store.store(group="data", name="imagefolder_schema", node=ImageFolderConfig)


# Ranges that torch's constructors leave unchecked, where the value would be silently wrong.
TARGET_RULES: dict[str, dict[str, dict]] = {
    "torch.optim.Optimizer": {"lr": {"positive": True}},  # lr=0: a run that learns nothing
    "torch.optim.lr_scheduler.MultiStepLR": {
        # unsorted or repeated milestones: gamma applied out of order or twice
        "milestones": {"increasing": 1},
        "gamma": {"positive": True},
    },
    "torch.optim.lr_scheduler.CosineAnnealingLR": {"T_max": {"min": 1}},
    "mixhook.app.models.PreActResNet18": {
        "shortcut": {"choices": SHORTCUTS},
        "width": {"positive": True},
        "stride": {"min": 1},
    },
}


def check(cfg: DictConfig) -> None:
    """Check every ranged field of ``cfg`` (a composed config) and every ``_target_`` node's values:
    :class:`SchemaError` for the first problem. The schema's types were checked by Hydra while
    composing."""
    _check_node(cfg, "")


def _check_node(node: DictConfig, prefix: str) -> None:
    schema = OmegaConf.get_type(node)
    if not (isinstance(schema, type) and is_dataclass(schema)):
        _check_plain_node(node, prefix)
        return
    for spec in fields(schema):
        value = OmegaConf.select(node, spec.name, throw_on_missing=False)
        key = f"{prefix}{spec.name}"
        if isinstance(value, DictConfig):
            _check_node(value, f"{key}.")
        elif isinstance(value, ListConfig):
            if spec.metadata:
                _check_value(key, list(value), spec.metadata)
            for i, item in enumerate(value):  # the hooks list
                if isinstance(item, DictConfig):
                    _check_node(item, f"{key}[{i}].")
        elif value is not None:
            _check_value(key, value, spec.metadata)
    if "_target_" in node:  # input_scale, grad_scale, grad_clip: their constructor's types too
        _check_target(node, prefix)


def _check_plain_node(node: DictConfig, prefix: str) -> None:
    """A node without a schema (``Config.data`` and the like are ``Any``): its ``_target_``'s values, and
    the structured nodes it may hold (OneOf's mixers, the hooks list)."""
    if "_target_" in node:
        _check_target(node, prefix)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, ListConfig) and not child._is_missing() and not child._is_none():
            for i, item in enumerate(child):
                if isinstance(item, DictConfig):
                    _check_node(item, f"{prefix}{key}[{i}].")
        elif isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _check_node(child, f"{prefix}{key}.")


def _check_target(node: DictConfig, prefix: str) -> None:
    """The values of a ``_target_`` node against the signature of the class it names, and the
    :data:`TARGET_RULES` of that class (or of a base class it extends)."""
    from hydra.utils import get_object

    try:
        target = get_object(str(node._target_))
        parameters = inspect.signature(target).parameters
    except Exception:  # noqa: BLE001  (building it will say why it cannot be found)
        return
    rules: dict[str, dict] = {}
    for name, rule in TARGET_RULES.items():  # the rules of the class and of the classes it extends
        base = get_object(name)
        subclass = inspect.isclass(target) and inspect.isclass(base) and issubclass(target, base)
        if target is base or subclass:
            rules.update(rule)
    for key in node:
        if str(key).startswith("_"):
            continue
        value = OmegaConf.select(node, str(key), throw_on_missing=False)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        parameter = parameters.get(str(key))
        default = parameter.default if parameter is not None else inspect.Parameter.empty
        name = f"{prefix}{key}"
        if isinstance(default, bool) and value is not None and not isinstance(value, bool):
            raise SchemaError(f"{name} must be true or false, got {value!r}")
        if (
            isinstance(default, (int, float))
            and not isinstance(default, bool)
            and isinstance(value, (str, bool))
        ):
            raise SchemaError(f"{name} must be a number, got {value!r}")
        if key in rules and value is not None:
            _check_value(name, value, rules[str(key)])


def _check_value(key: str, value: Any, rule) -> None:
    if "min" in rule and value < rule["min"]:
        raise SchemaError(f"{key} must be an integer >= {rule['min']}, got {value!r}")
    if "choices" in rule and value not in rule["choices"]:
        kind = key.rsplit(".", 1)[-1]
        raise SchemaError(f"{key}={value!r} is not a {kind}; valid: {', '.join(rule['choices'])}")
    if "increasing" in rule and (value != sorted(set(value)) or any(v < rule["increasing"] for v in value)):
        raise SchemaError(f"{key} must be increasing numbers >= {rule['increasing']}, got {value}")
    if "positive" in rule and not value > 0:
        raise SchemaError(f"{key} must be > 0, got {value!r}")
    if "closed" in rule:
        low, high = rule["closed"]
        if not (math.isfinite(value) and low <= value <= high):
            raise SchemaError(f"{key} must be in [{low:g}, {high:g}], got {value!r}")
    if "open" in rule:
        low, high = rule["open"]
        if not (math.isfinite(value) and low < value < high):
            raise SchemaError(f"{key} must be in ({low:g}, {high:g}), got {value!r}")

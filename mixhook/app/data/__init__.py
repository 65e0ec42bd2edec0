"""Data sets for the experiment app: scikit-learn's digits (offline, the default), CIFAR-10/100, SVHN,
MNIST, Fashion-MNIST and KMNIST, ImageNet-format image folders (ImageNet, Tiny-ImageNet, any
``root/train/<class>/`` tree), and scikit-learn's diabetes data (offline), a regression task.

:func:`build_data` returns a :class:`Data` bundle: train and test loaders and what the model needs to
know (channels, classes, image size).

One module per family: :mod:`.tabular` (digits, diabetes), :mod:`.cifar` (CIFAR's and SVHN's files),
:mod:`.mnist` (the MNIST family's IDX files), :mod:`.folders` (image folders); beneath them :mod:`.images`
(small images held as one uint8 tensor, per sample and per batch on the device, the normalisation),
:mod:`.augment` (the augmentations the app computes itself) and :mod:`.sampling` (the training order,
each sample's augmentation seed, the subsets). The training order and the random augmentation are
functions of (seed, epoch, position), not of a stream that the run consumes (:mod:`.sampling`): the same
seed gives the same batches, whatever the number of loader workers, and a run resumed at step k of an
epoch sees exactly the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, Subset

from mixhook.policies.partners import class_balanced_weights

from ..errors import DataNotFoundError
from . import cifar, folders, mnist, tabular
from .augment import (
    IMAGENET_EIGVAL,
    IMAGENET_EIGVEC,
    ResNetColor,
    augmentation_draws,
    crop_and_flip,
    jitter,
    pca_lighting,
)
from .cifar import _CIFAR, load_cifar_files, load_svhn_file  # noqa: F401 (_CIFAR: the tests' and a benchmark's)
from .folders import (
    CROPS,
    IMAGE_EXTENSIONS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    NORMALIZE,
    DeviceNormalized,
    FolderImages,
)
from .images import DeviceBatches, SmallImages, normalization, small_images
from .mnist import read_idx
from .sampling import EpochSampler, SeededSamples, long_tail_subset, per_class_subset

SAMPLERS = ("random", "balanced")  # data.sampler: each epoch a permutation, or classes drawn equally often
PIPELINES = ("auto", "device", "workers")  # data.pipeline: where small images' batches are made (build_data)


@dataclass
class Data:
    """Loaders plus the shape facts a model is built from. ``train`` and ``test`` are ``DataLoader``s or,
    for small images (CIFAR, SVHN, the MNIST family) with ``pipeline="device"``, :class:`DeviceBatches`
    (the same interface: batches, ``len``, ``batch_size``, the training ``sampler``)."""

    name: str
    train: DataLoader | DeviceBatches
    test: DataLoader | DeviceBatches
    in_channels: int
    num_classes: int
    image_size: int
    split_hash: str | None = None  # provenance.digest of the train and test images and labels
    task: str = "classification"  # or "regression": float targets, MSE, RMSE (training.task.TASKS)
    target_scale: float = 1.0  # regression: the std the targets were divided by (RMSE in their units)
    class_counts: list[int] | None = None  # classification: the training images of each class
    normalization: tuple | None = None  # images: the per-channel (mean, std) of their [0, 1] pixels
    partners: DataLoader | DeviceBatches | None = None  # a class-balanced partner batch per step
    make_partners: Callable | None = field(default=None, repr=False)  # builds ``partners`` (partner_batches)

    @property
    def images(self) -> bool:
        """Whether its samples are images (``image_size`` > 0); else rows of features (diabetes), which
        only an MLP takes and which have no feature maps to draw."""
        return self.image_size > 0

    def partner_batches(self) -> None:
        """Give the training loop a second, class-balanced batch per step (:attr:`partners`: the same
        images, batch size and pipeline, each class drawn equally often, with replacement: Balanced-MixUp's
        class-based loader), for a mixer whose partners come from a second batch."""
        if self.partners is None and self.make_partners is not None:
            self.partners = self.make_partners()


def _check_choices(
    name: str, builders: dict, batch_size, eval_batch_size, pipeline: str, sampler: str
) -> None:
    """Refuse, in one line, a data set, batch size, pipeline or sampler that does not exist."""
    if name not in builders:
        raise ValueError(f"data.name={name!r} is not a data set; valid: {', '.join(builders)}")
    for key, value in (("trainer.batch_size", batch_size), ("trainer.eval_batch_size", eval_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if pipeline not in PIPELINES:
        raise ValueError(f"data.pipeline={pipeline!r} is not a pipeline; valid: {', '.join(PIPELINES)}")
    if sampler not in SAMPLERS:
        raise ValueError(f"data.sampler={sampler!r} is not a sampler; valid: {', '.join(SAMPLERS)}")


def build_data(
    name: str,
    batch_size: int,
    eval_batch_size: int = 512,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
    pipeline: str = "auto",
    sampler: str = "random",
    **options,
) -> Data:
    """Build the data set ``name`` (``digits``, ``cifar10``, ``cifar100``, ``svhn``, ``mnist``,
    ``fashion_mnist``, ``kmnist``, ``imagefolder`` or ``diabetes``) with its ``options``.

    With ``world_size`` > 1 (data-parallel training) the loaders hold rank ``rank``'s share: every
    ``world_size``-th sample of each epoch's order for training, and a disjoint shard of the test set
    (the ranks' test metrics sum to the whole set's).

    ``pipeline`` (CIFAR, SVHN, the MNIST family): ``"device"`` holds the images on ``device`` as one
    uint8 tensor and crops, flips and normalises each batch there (:class:`DeviceBatches`); ``"workers"``
    augments sample by sample in DataLoader workers; ``"auto"`` is ``"device"`` (faster on CPU too: see
    the README's Performance section). Both draw a sample's augmentation from its (seed, epoch) seed,
    and both follow the same order.

    ``sampler``: ``"random"`` (each epoch a permutation of the training set) or ``"balanced"`` (each epoch
    as many samples, drawn with replacement so that every class comes equally often: a class-balanced
    sampler for long-tailed data). :meth:`Data.partner_batches` adds a second, class-balanced batch per
    step."""
    builders = {
        "digits": tabular.digits, "cifar10": cifar.cifar, "cifar100": cifar.cifar, "svhn": cifar.svhn,
        "mnist": mnist.mnist, "fashion_mnist": mnist.mnist, "kmnist": mnist.mnist,
        "imagefolder": folders.imagefolder, "diabetes": tabular.diabetes,
    }  # fmt: skip
    _check_choices(name, builders, batch_size, eval_batch_size, pipeline, sampler)
    train_set, test_set, info = builders[name](name=name, **options)
    labels = info.pop("train_labels", None)
    if labels is not None:
        info["class_counts"] = torch.bincount(labels, minlength=info["num_classes"]).tolist()
    elif sampler == "balanced":
        raise ValueError(f"data.sampler=balanced draws classes equally often, but data={name} has no classes")
    num_workers = int(options.get("num_workers", 0))
    norm = info.pop("normalized_on_device", None)  # (data.normalize=device: the mean and std)

    def epochs(stream: int = 0, balanced: bool = sampler == "balanced") -> EpochSampler:
        weights = class_balanced_weights(labels) if balanced else None
        return EpochSampler(
            len(train_set), seed, rank=rank, world_size=world_size, batch_size=batch_size, weights=weights,
            stream=stream,
        )  # fmt: skip

    pin = torch.device(device).type == "cuda"  # page-locked batches: their copy to the GPU is queued
    device_batches = isinstance(train_set, SmallImages) and pipeline in ("auto", "device")

    def training(order: EpochSampler):
        if device_batches:
            return DeviceBatches(train_set, batch_size, device, sampler=order)
        loader = DataLoader(
            SeededSamples(train_set),
            batch_size=batch_size,
            sampler=order,
            generator=torch.Generator().manual_seed(seed),  # the workers' base seed, not the global stream
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            pin_memory=pin,
        )
        return loader if norm is None else DeviceNormalized(loader, device, *norm)

    if labels is not None:  # the partner batches: their own stream of class-balanced epochs
        info["make_partners"] = lambda: training(epochs(stream=1, balanced=True))
    if device_batches:
        shard = torch.arange(rank, len(test_set), world_size)
        test = DeviceBatches(test_set, eval_batch_size, device, indices=shard)
        return Data(name=name, train=training(epochs()), test=test, **info)
    if world_size > 1:
        test_set = Subset(test_set, range(rank, len(test_set), world_size))
    train = training(epochs())
    test = DataLoader(
        test_set,
        batch_size=eval_batch_size,
        shuffle=False,
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=pin,
    )
    if norm is not None:
        test = DeviceNormalized(test, device, *norm)
    return Data(name=name, train=train, test=test, **info)


__all__ = [
    "CROPS", "IMAGE_EXTENSIONS", "IMAGENET_EIGVAL", "IMAGENET_EIGVEC", "IMAGENET_MEAN", "IMAGENET_STD",
    "NORMALIZE", "PIPELINES", "SAMPLERS", "Data", "DataNotFoundError", "DeviceBatches", "DeviceNormalized",
    "EpochSampler", "FolderImages", "ResNetColor", "SeededSamples", "SmallImages", "augmentation_draws",
    "build_data", "crop_and_flip", "jitter", "load_cifar_files", "load_svhn_file", "long_tail_subset",
    "normalization", "pca_lighting", "per_class_subset", "read_idx", "small_images",
]  # fmt: skip

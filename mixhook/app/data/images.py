"""Image sets held as one uint8 tensor (CIFAR, SVHN, the MNIST family): augmented sample by sample in
DataLoader workers (:class:`SmallImages`) or batch by batch on the training device (:class:`DeviceBatches`);
the training and test sets of such a data set, cut to fewer images and normalised (:func:`small_images`);
and the per-channel normalisation every image set takes (:func:`normalization`)."""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset

from ..provenance import digest
from .augment import augmentation_draws, crop_and_flip
from .sampling import EpochSampler, long_tail_subset, per_class_subset


def normalization(own_mean, own_std, mean: list | None, std: list | None) -> tuple:
    """The per-channel mean and std images are normalised with: the data set's own, or ``data.mean`` /
    ``data.std`` (one finite number per channel each, as many as the data set's own: three for colour
    images, one for grey ones; the std's > 0), e.g. the Manifold Mixup authors' 0.5 and 0.5 for SVHN;
    else a one-line ``ValueError``."""
    channels = len(own_mean)
    mean = tuple(own_mean if mean is None else mean)
    std = tuple(own_std if std is None else std)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (*mean, *std))
    finite = numbers and len(mean) == len(std) == channels and all(map(math.isfinite, (*mean, *std)))
    if not finite or min(std) <= 0:
        count = {1: "one finite number", 3: "three finite numbers"}.get(
            channels, f"{channels} finite numbers"
        )
        raise ValueError(
            f"data.mean={list(mean)} and data.std={list(std)} must be {count} each (one per channel of "
            "its images), the std's > 0"
        )
    return mean, std


class SmallImages(Dataset):
    """uint8 ``(N, C, H, W)`` images (CIFAR's and SVHN's 3x32x32, the MNIST family's 1x28x28) with the
    standard augmentation (a random crop of the image zero-padded by ``padding`` pixels, 4 by default,
    and, with ``flip``, a horizontal flip, from ``torchvision.transforms.v2``) when ``augment``, then
    per-channel normalization."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        mean,
        std,
        augment: bool = False,
        flip: bool = True,
        padding: int = 4,
    ):
        from torchvision.transforms import v2

        self.images, self.labels, self.flip, self.padding = images, labels, flip, padding
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)
        size = tuple(images.shape[-2:])
        steps = [v2.RandomCrop(size, padding=padding), *([v2.RandomHorizontalFlip()] if flip else [])]
        self.augment = v2.Compose(steps) if augment else None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i]
        if self.augment is not None:
            x = self.augment(x)
        return (x.float() / 255.0 - self.mean) / self.std, self.labels[i]


class DeviceBatches:
    """A CIFAR-format data set's batches made on ``device`` from one uint8 tensor of all its images:
    per batch, a gather of the batch's images, their padded random crop and flip
    (:func:`crop_and_flip`, when the data set augments) and the normalisation, with no worker process
    and no per-sample Python. Training (``sampler``: an :class:`EpochSampler`) follows the sampler's
    order and draws each sample's crop and flip from its (seed, epoch) seed
    (:func:`augmentation_draws`), so a resumed epoch sees exactly the batches it would have seen;
    evaluation goes through ``indices`` (default: all) in order, unaugmented. The batches are the
    per-sample pipeline's (:class:`SmallImages` in DataLoader workers) in distribution, not in value: the
    two turn a seed into a crop differently."""

    def __init__(
        self,
        data: SmallImages,
        batch_size: int,
        device: torch.device | str = "cpu",
        sampler: EpochSampler | None = None,
        indices: torch.Tensor | None = None,
    ):
        self.device = torch.device(device)
        self.images = data.images.to(self.device)
        self.labels = data.labels.to(self.device)
        self.mean = data.mean.to(self.device)
        self.std = data.std.to(self.device)
        self.augment = data.augment is not None and sampler is not None
        self.flip, self.padding = data.flip, data.padding
        self.batch_size, self.sampler = batch_size, sampler
        self.indices = torch.arange(len(data)) if indices is None else indices

    def __len__(self) -> int:
        """The number of batches left in this epoch."""
        size = len(self.sampler) if self.sampler is not None else len(self.indices)
        return -(-size // self.batch_size)

    def __iter__(self):
        if self.sampler is not None:
            order, seeds = self.sampler.plan()
            top, left, flip = augmentation_draws(seeds, self.padding)
            flip = flip if self.flip else torch.zeros_like(flip)  # (digits are not mirrored: SVHN, MNIST)
            draws = [d.to(self.device, non_blocking=True) for d in (top, left, flip)]
        else:
            order, draws = self.indices, None
        order = order.to(self.device, non_blocking=True)
        for start in range(0, len(order), self.batch_size):
            part = slice(start, start + self.batch_size)
            x = self.images[order[part]]
            if self.augment:
                x = crop_and_flip(x, *(d[part] for d in draws), padding=self.padding)
            yield (x.float() / 255.0 - self.mean) / self.std, self.labels[order[part]]


def small_images(
    train: tuple,
    test: tuple,
    own: tuple,
    num_classes: int,
    augment: bool,
    flip: bool = True,
    padding: int = 4,
    per_class: int | None = None,
    subset_seed: int = 0,
    mean: list | None = None,
    std: list | None = None,
    imbalance_ratio: float | None = None,
):
    """The training and test :class:`SmallImages` of ``(images, labels)`` sets of uint8 ``(N, C, H, W)``
    images (CIFAR, SVHN, the MNIST family) and their info: normalised with the set's ``own`` mean and std
    or the given ``mean``/``std``, the training set cut to ``per_class`` images of each class (drawn with
    ``subset_seed``) and then to a long tail (``imbalance_ratio``: :func:`long_tail_subset`, drawn with
    ``subset_seed``) before its digest, augmented (``augment``) with a ``padding``-pixel padded crop and,
    with ``flip``, a flip."""
    norm = normalization(*own, mean, std)
    train_x, train_y = train
    if per_class is not None:
        keep = per_class_subset(train_y, per_class, subset_seed)
        train_x, train_y = train_x[keep], train_y[keep]
    if imbalance_ratio is not None:
        keep = long_tail_subset(train_y, imbalance_ratio, subset_seed, num_classes)
        train_x, train_y = train_x[keep], train_y[keep]
    channels, size = train_x.shape[1], train_x.shape[-1]
    info = {"in_channels": channels, "num_classes": num_classes, "image_size": size, "train_labels": train_y}
    info["normalization"] = tuple(list(v) for v in norm)
    info["split_hash"] = digest(train_x, train_y, *test)
    training = SmallImages(train_x, train_y, *norm, augment=augment, flip=flip, padding=padding)
    return training, SmallImages(*test, *norm, flip=flip), info

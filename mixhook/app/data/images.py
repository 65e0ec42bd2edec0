"""Image sets held as one uint8 tensor (CIFAR, SVHN): augmented sample by sample in DataLoader workers
(:class:`CifarImages`) or batch by batch on the training device (:class:`DeviceBatches`); and the
per-channel normalisation every image set takes (:func:`normalization`)."""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset

from .augment import augmentation_draws, crop_and_flip
from .sampling import EpochSampler


def normalization(own_mean, own_std, mean: list | None, std: list | None) -> tuple:
    """The per-channel mean and std images are normalised with: the data set's own, or ``data.mean`` /
    ``data.std`` (three finite numbers each, the std's > 0), e.g. the Manifold Mixup authors' 0.5 and
    0.5 for SVHN; else a one-line ``ValueError``."""
    mean = tuple(own_mean if mean is None else mean)
    std = tuple(own_std if std is None else std)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (*mean, *std))
    finite = numbers and len(mean) == len(std) == 3 and all(map(math.isfinite, (*mean, *std)))
    if not finite or min(std) <= 0:
        raise ValueError(
            f"data.mean={list(mean)} and data.std={list(std)} must be three finite numbers each, the "
            "std's > 0"
        )
    return mean, std


class CifarImages(Dataset):
    """uint8 32x32 images (CIFAR, SVHN) with the standard augmentation (a random crop of the image
    zero-padded by ``padding`` pixels, 4 by default, and, with ``flip``, a horizontal flip, from
    ``torchvision.transforms.v2``) when ``augment``, then per-channel normalization."""

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
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)
        steps = [v2.RandomCrop(32, padding=padding), *([v2.RandomHorizontalFlip()] if flip else [])]
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
    per-sample pipeline's (:class:`CifarImages` in DataLoader workers) in distribution, not in value: the
    two turn a seed into a crop differently."""

    def __init__(
        self,
        data: CifarImages,
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
            flip = flip if self.flip else torch.zeros_like(flip)  # (SVHN's digits are not mirrored)
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

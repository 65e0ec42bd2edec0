"""Which samples a run sees, and in what order: the training order and each sample's augmentation seed
(:class:`EpochSampler`, :class:`SeededSamples`), and the training sets cut to fewer images
(:func:`long_tail_subset`, :func:`per_class_subset`).

The training order and the random augmentation are functions of (seed, epoch, position), not of a
stream that the run consumes: :class:`EpochSampler` draws each epoch's permutation and one augmentation
seed per sample from ``(seed, epoch)``, and :class:`SeededSamples` applies a sample's augmentation under
its own seed. So the same seed gives the same batches, whatever the number of loader workers, and a run
resumed at step k of an epoch sees exactly the batches it would have seen.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


class EpochSampler(Sampler):
    """The training order: epoch ``e``'s permutation and one augmentation seed per sample, drawn from a
    generator seeded by ``(seed, e)``; optionally this rank's share, as ``DistributedSampler`` shards
    (the permutation padded to a multiple of ``world_size``, then every ``world_size``-th index).

    With ``weights`` (one per sample) each epoch draws ``size`` samples with replacement, with probability
    by weight (the class-balanced sampler), instead of a permutation; ``stream`` (> 0) draws from a stream of
    its own (the partner batches'). Yields ``(index, augmentation seed)`` pairs for :class:`SeededSamples`.
    Call :meth:`set_epoch`
    before each epoch; ``start`` skips that many of this rank's samples (a resumed epoch), without
    loading them. With ``batch_size``, an epoch whose last batch would hold a single sample leaves that
    sample out (BatchNorm cannot train on one sample, nor can a mixer pair it): a different sample each
    epoch, since the order is drawn afresh.
    """

    def __init__(
        self,
        size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        batch_size: int | None = None,
        weights: torch.Tensor | None = None,
        stream: int = 0,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.weights, self.stream = weights, stream
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0
        share = -(-size // world_size)
        self.share = share - 1 if batch_size and share > 1 and share % batch_size == 1 else share

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return max(self.share - self.start, 0)

    def plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's indices for the rest of the epoch and each one's augmentation seed (int64)."""
        entropy = [self.seed, self.epoch] + ([self.stream] if self.stream else [])
        mixed = np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]
        g = torch.Generator().manual_seed(int(mixed))
        if self.weights is not None:  # drawn with replacement by the weights (data.sampler=balanced)
            order = torch.multinomial(self.weights, self.size, replacement=True, generator=g)
        else:
            order = torch.randperm(self.size, generator=g) if self.shuffle else torch.arange(self.size)
        seeds = torch.randint(2**62, (self.size,), generator=g)
        total = -(-self.size // self.world_size) * self.world_size
        order = torch.cat([order, order[: total - self.size]])[self.rank :: self.world_size]
        order = order[self.start : self.share]
        return order, seeds[order]

    def __iter__(self):
        order, seeds = self.plan()
        yield from zip(order.tolist(), seeds.tolist(), strict=True)


class SeededSamples(Dataset):
    """Wraps a data set so that sample ``(i, s)`` is ``dataset[i]`` computed under torch seed ``s``:
    random augmentation depends on the sample's seed only, never on the global stream, which it leaves
    as it was."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        index, seed = key
        with torch.random.fork_rng(devices=[]):
            # the CPU stream only: torch.manual_seed would also reseed every GPU's stream (left unrestored
            # by fork_rng(devices=[])), at 0.3 ms per sample
            torch.default_generator.manual_seed(seed)
            return self.dataset[index]


def long_tail_subset(labels: torch.Tensor, ratio: float, seed: int, num_classes: int) -> torch.Tensor:
    """The training indices of a long-tailed set (``data.imbalance_ratio``), as Cao et al. 2019 (LDAM-DRW,
    kaidic/LDAM-DRW ``imbalance_cifar.py``) cut CIFAR: class ``c`` keeps ``int(n_max * ratio ** (-c / (C -
    1)))`` images, ``n_max`` the set's size over its ``C`` classes (the largest class, 0, keeps ``n_max``;
    the smallest ``n_max / ratio``), each class's drawn by a NumPy shuffle seeded with ``seed`` (class by
    class, as theirs: the same images for the same set); in class order. A class with fewer images keeps
    all of them. The test set stays balanced."""
    if (
        isinstance(ratio, bool)
        or not isinstance(ratio, (int, float))
        or not (math.isfinite(ratio) and ratio >= 1)
    ):
        raise ValueError(
            f"data.imbalance_ratio must be a number >= 1 (the largest class over the smallest), got {ratio!r}"
        )
    labels_np = labels.numpy()
    n_max = len(labels_np) / num_classes
    rng = np.random.RandomState(seed)  # (LDAM's np.random.seed(rand_number), then np.random.shuffle)
    kept = []
    for c in range(num_classes):
        number = int(n_max * ((1 / ratio) ** (c / (num_classes - 1.0))))
        idx = np.where(labels_np == c)[0]
        rng.shuffle(idx)
        kept.append(idx[:number])
    kept = np.concatenate(kept)
    if not len(kept):
        raise ValueError(
            f"data.imbalance_ratio={ratio:g} leaves no training image: {len(labels_np)} images over "
            f"{num_classes} classes give the largest class fewer than one"
        )
    return torch.from_numpy(kept).to(torch.int64)


def per_class_subset(labels: torch.Tensor, per_class: int, seed: int) -> torch.Tensor:
    """The indices, in order, of at most ``per_class`` training images of each class (every image of a
    class that has fewer), drawn at random with ``seed`` (``data.subset_seed``), as the Manifold Mixup
    authors' code keeps ``--labels_per_class`` of each class (supervised/load_data.py, get_sampler)."""
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    kept = [order[labels[order] == c][:per_class] for c in labels.unique()]
    return torch.cat(kept).sort().values

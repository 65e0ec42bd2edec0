"""Data sets for the experiment app: scikit-learn's digits (offline, the default), CIFAR-10/100, SVHN,
ImageNet-format image folders (ImageNet, Tiny-ImageNet, any ``root/train/<class>/`` tree), and
scikit-learn's diabetes data (offline), a regression task.

:func:`build_data` returns a :class:`Data` bundle: train and test loaders and what the model needs to
know (channels, classes, image size).

The training order and the random augmentation are functions of (seed, epoch, position), not of a
stream that the run consumes: :class:`EpochSampler` draws each epoch's permutation and one augmentation
seed per sample from ``(seed, epoch)``, and :class:`SeededSamples` applies a sample's augmentation under
its own seed. So the same seed gives the same batches, whatever the number of loader workers, and a run
resumed at step k of an epoch sees exactly the batches it would have seen.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, TensorDataset

from mixhook.policies.partners import class_balanced_weights

from . import splits
from .provenance import digest

SAMPLERS = ("random", "balanced")  # data.sampler: each epoch a permutation, or classes drawn equally often
PIPELINES = ("auto", "device", "workers")  # data.pipeline: where CIFAR batches are made (see build_data)


class DataNotFoundError(FileNotFoundError):
    """A data set's files are not where the config says, and could not be downloaded."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class Data:
    """Loaders plus the shape facts a model is built from. ``train`` and ``test`` are ``DataLoader``s or,
    for CIFAR with ``pipeline="device"``, :class:`DeviceBatches` (the same interface: batches,
    ``len``, ``batch_size``, the training ``sampler``)."""

    name: str
    train: DataLoader | DeviceBatches
    test: DataLoader | DeviceBatches
    in_channels: int
    num_classes: int
    image_size: int
    split_hash: str | None = None  # provenance.digest of the train and test images and labels
    task: str = "classification"  # or "regression": float targets, MSE, RMSE (training.loop.TASKS)
    target_scale: float = 1.0  # regression: the std the targets were divided by (RMSE in their units)
    class_counts: list[int] | None = None  # classification: the training images of each class
    partners: DataLoader | DeviceBatches | None = None  # a class-balanced partner batch per step
    make_partners: Callable | None = field(default=None, repr=False)  # builds ``partners`` (partner_batches)

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
    """Build the data set ``name`` (``digits``, ``cifar10``, ``cifar100``, ``svhn``, ``imagefolder`` or
    ``diabetes``) with its ``options``.

    With ``world_size`` > 1 (data-parallel training) the loaders hold rank ``rank``'s share: every
    ``world_size``-th sample of each epoch's order for training, and a disjoint shard of the test set
    (the ranks' test metrics sum to the whole set's).

    ``pipeline`` (CIFAR, SVHN): ``"device"`` holds the images on ``device`` as one uint8 tensor and crops,
    flips and normalises each batch there (:class:`DeviceBatches`); ``"workers"`` augments sample by
    sample in DataLoader workers; ``"auto"`` is ``"device"`` (faster on CPU too: see the README's
    Performance section). Both draw a sample's augmentation from its (seed, epoch) seed, and both follow
    the same order.

    ``sampler``: ``"random"`` (each epoch a permutation of the training set) or ``"balanced"`` (each epoch
    as many samples, drawn with replacement so that every class comes equally often: a class-balanced
    sampler for long-tailed data). :meth:`Data.partner_batches` adds a second, class-balanced batch per
    step."""
    builders = {
        "digits": _digits, "cifar10": _cifar, "cifar100": _cifar, "svhn": _svhn, "imagefolder": _imagefolder,
        "diabetes": _diabetes,
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
    device_batches = isinstance(train_set, CifarImages) and pipeline in ("auto", "device")

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


class DeviceNormalized:
    """A DataLoader of uint8 image batches (``data.normalize=device``), each copied to ``device`` (queued,
    from page-locked memory on CUDA) and converted and normalised there with ``mean`` and ``std`` (by
    default ImageNet's), by the same torchvision functions the workers would apply to each image
    (elementwise: the same values).
    Its ``sampler``, ``batch_size``, ``dataset`` and length are the loader's."""

    def __init__(self, loader: DataLoader, device: torch.device | str, mean=None, std=None):
        self.loader, self.device = loader, torch.device(device)
        self.mean = list(IMAGENET_MEAN if mean is None else mean)
        self.std = list(IMAGENET_STD if std is None else std)
        self.sampler, self.batch_size, self.dataset = loader.sampler, loader.batch_size, loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        from torchvision.transforms.v2 import functional as F

        for x, y in self.loader:
            x = F.to_dtype(x.to(self.device, non_blocking=True), torch.float32, scale=True)
            yield F.normalize(x, self.mean, self.std), y


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


# ------------------------------------------------------------------------------------------- digits


def _digits(
    name: str,
    test_size: float = 0.2,
    split_seed: int = 0,
    train_size: int | None = None,
    num_workers: int = 0,
    imbalance_ratio: float | None = None,
):
    """scikit-learn's bundled handwritten digits: 1797 8x8 grey images of 0-9, shipped with the package.

    A stratified train/test split with ``split_seed``; ``train_size`` keeps only that many training
    images (a stratified subset, for studies where regularization matters); ``imbalance_ratio`` cuts the
    training set to a long tail (:func:`long_tail_subset`, drawn with ``split_seed``; the test set stays
    balanced); pixels scaled by the training set's mean and std.
    """
    if not 0.0 < float(test_size) < 1.0:
        raise ValueError(f"data.test_size must be in (0, 1), got {test_size!r}")
    images, y = splits.load_digits()
    x = images.astype(np.float32) / 16.0
    train, test = splits.stratified_split(y, *splits.sizes(len(y), test_size=test_size), int(split_seed))
    x_train, x_test, y_train, y_test = x[train], x[test], y[train], y[test]
    if train_size is not None:
        if (
            isinstance(train_size, bool)
            or not isinstance(train_size, int)
            or not 10 <= train_size <= len(y_train)
        ):
            raise ValueError(
                f"data.train_size must be an integer from 10 to {len(y_train)}, got {train_size!r}"
            )
        if train_size < len(y_train):
            keep, _ = splits.stratified_split(
                y_train, *splits.sizes(len(y_train), train_size=train_size), int(split_seed)
            )
            x_train, y_train = x_train[keep], y_train[keep]
    if imbalance_ratio is not None:
        keep = long_tail_subset(torch.from_numpy(y_train), imbalance_ratio, int(split_seed), 10).numpy()
        x_train, y_train = x_train[keep], y_train[keep]
    mean, std = x_train.mean(), x_train.std()

    def tensors(images, labels):
        images = torch.from_numpy((images - mean) / std).unsqueeze(1)
        return TensorDataset(images, torch.from_numpy(labels))

    info = {"in_channels": 1, "num_classes": 10, "image_size": 8, "train_labels": torch.from_numpy(y_train)}
    info["split_hash"] = digest(x_train, y_train, x_test, y_test)
    return tensors(x_train, y_train), tensors(x_test, y_test), info


def _diabetes(
    name: str,
    test_size: float = 0.2,
    split_seed: int = 0,
    train_size: int | None = None,
    num_workers: int = 0,
):
    """scikit-learn's bundled diabetes data: 442 patients, 10 baseline features, a quantitative measure
    of disease progression one year later (25 to 346) to regress.

    A random train/test split with ``split_seed``; ``train_size`` keeps that many training samples.
    Features and targets are standardised with the training set's mean and std (so a C-Mixup bandwidth
    is in standard deviations of the target); the target's std is ``target_scale``, by which the app
    reports RMSE in the target's own units.
    """
    if not 0.0 < float(test_size) < 1.0:
        raise ValueError(f"data.test_size must be in (0, 1), got {test_size!r}")
    x, y = splits.load_diabetes()
    x, y = x.astype(np.float32), y.astype(np.float32)
    train, test = splits.shuffle_split(len(y), *splits.sizes(len(y), test_size=test_size), int(split_seed))
    x_train, x_test, y_train, y_test = x[train], x[test], y[train], y[test]
    if train_size is not None:
        if (
            isinstance(train_size, bool)
            or not isinstance(train_size, int)
            or not 10 <= train_size <= len(y_train)
        ):
            raise ValueError(
                f"data.train_size must be an integer from 10 to {len(y_train)}, got {train_size!r}"
            )
        x_train, y_train = x_train[:train_size], y_train[:train_size]
    x_mean, x_std = x_train.mean(0), x_train.std(0)
    y_mean, y_std = float(y_train.mean()), float(y_train.std())

    def tensors(features, targets):
        return TensorDataset(
            torch.from_numpy((features - x_mean) / x_std), torch.from_numpy((targets - y_mean) / y_std)
        )

    info = {"in_channels": x.shape[1], "num_classes": 1, "image_size": 0, "task": "regression"}
    info["target_scale"] = y_std
    info["split_hash"] = digest(x_train, y_train, x_test, y_test)
    return tensors(x_train, y_train), tensors(x_test, y_test), info


# -------------------------------------------------------------------------------------------- CIFAR

_CIFAR = {
    "cifar10": {
        "title": "CIFAR-10",
        "folder": "cifar-10-batches-py",
        "train": [f"data_batch_{i}" for i in range(1, 6)],
        "test": ["test_batch"],
        "label_key": "labels",
        "num_classes": 10,
        "mean": (0.4914, 0.4822, 0.4465),
        "std": (0.2470, 0.2435, 0.2616),
        "archive": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    },
    "cifar100": {
        "title": "CIFAR-100",
        "folder": "cifar-100-python",
        "train": ["train"],
        "test": ["test"],
        "label_key": "fine_labels",
        "num_classes": 100,
        "mean": (0.5071, 0.4865, 0.4409),
        "std": (0.2673, 0.2564, 0.2762),
        "archive": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    },
}


def _cifar(
    name: str,
    root: str = "data",
    download: bool = False,
    augment: bool = True,
    num_workers: int = 2,
    **images,
):
    """CIFAR-10/100's python-format files under ``root``; ``images``: :func:`_small_images`' options."""
    spec = _CIFAR[name]
    folder = os.path.join(root, spec["folder"])
    missing = [f for f in spec["train"] + spec["test"] if not os.path.isfile(os.path.join(folder, f))]
    if missing and download:
        _download(name, root)
        missing = [f for f in spec["train"] + spec["test"] if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise DataNotFoundError(
            f"{spec['title']} not found: {os.path.join(folder, missing[0])} is missing. Extract "
            f"{spec['archive']} into data.root={root!r} (giving {folder}/), or set data.download=true"
        )
    train_x, train_y = load_cifar_files(folder, spec["train"], spec["label_key"])
    test_x, test_y = load_cifar_files(folder, spec["test"], spec["label_key"])
    own = (spec["mean"], spec["std"])
    return _small_images((train_x, train_y), (test_x, test_y), own, spec["num_classes"], augment, **images)


def _small_images(
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
    """The training and test :class:`CifarImages` of 32x32 ``(images, labels)`` sets (CIFAR, SVHN) and
    their info: normalised with the set's ``own`` mean and std or the given ``mean``/``std``, the
    training set cut to ``per_class`` images of each class (drawn with ``subset_seed``) and then to a long
    tail (``imbalance_ratio``: :func:`long_tail_subset`, drawn with ``subset_seed``) before its digest,
    augmented (``augment``) with a ``padding``-pixel padded crop and, with ``flip``, a flip."""
    norm = normalization(*own, mean, std)
    train_x, train_y = train
    if per_class is not None:
        keep = per_class_subset(train_y, per_class, subset_seed)
        train_x, train_y = train_x[keep], train_y[keep]
    if imbalance_ratio is not None:
        keep = long_tail_subset(train_y, imbalance_ratio, subset_seed, num_classes)
        train_x, train_y = train_x[keep], train_y[keep]
    info = {"in_channels": 3, "num_classes": num_classes, "image_size": 32, "train_labels": train_y}
    info["split_hash"] = digest(train_x, train_y, *test)
    training = CifarImages(train_x, train_y, *norm, augment=augment, flip=flip, padding=padding)
    return training, CifarImages(*test, *norm, flip=flip), info


def _download(name: str, root: str) -> None:
    import torchvision

    spec = _CIFAR[name]
    dataset = {"cifar10": torchvision.datasets.CIFAR10, "cifar100": torchvision.datasets.CIFAR100}[name]
    try:
        dataset(root=root, train=True, download=True)
    except Exception as err:  # no network, a proxy, a full disk: all end in the same advice
        raise DataNotFoundError(
            f"{spec['title']} is not under data.root={root!r} and downloading it failed "
            f"({type(err).__name__}: {err}). Extract {spec['archive']} there by hand"
        ) from err


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


def per_class_subset(labels: torch.Tensor, per_class: int, seed: int) -> torch.Tensor:
    """The indices, in order, of at most ``per_class`` training images of each class (every image of a
    class that has fewer), drawn at random with ``seed`` (``data.subset_seed``), as the Manifold Mixup
    authors' code keeps ``--labels_per_class`` of each class (supervised/load_data.py, get_sampler)."""
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    kept = [order[labels[order] == c][:per_class] for c in labels.unique()]
    return torch.cat(kept).sort().values


def load_cifar_files(folder: str, files: list[str], label_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Read CIFAR python-format batch files: ``uint8`` images ``(N, 3, 32, 32)`` and ``int64`` labels.

    The files are pickles, as the CIFAR distribution ships them (torchvision reads them the same way):
    read only files you trust.
    """
    images, labels = [], []
    for file in files:
        with open(os.path.join(folder, file), "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        images.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(entry[label_key], dtype=np.int64))
    return torch.from_numpy(np.concatenate(images)), torch.from_numpy(np.concatenate(labels))


# --------------------------------------------------------------------------------------------- SVHN

_SVHN = {
    "files": {"train": "train_32x32.mat", "test": "test_32x32.mat", "extra": "extra_32x32.mat"},
    "mean": (0.4377, 0.4438, 0.4728),  # the train split's per-channel mean and std
    "std": (0.1980, 0.2010, 0.1970),
}


def _svhn(
    name: str,
    root: str = "data/svhn",
    download: bool = False,
    augment: bool = False,
    extra: bool = False,
    num_workers: int = 2,
    **images,
):
    """SVHN's cropped digits (torchvision's files: ``train_32x32.mat``, ``test_32x32.mat`` and, with
    ``extra``, ``extra_32x32.mat`` joined to the training set), label 10 read as the digit 0, as
    torchvision reads it. ``augment``: the padded random crop, never a flip (a mirrored digit is another
    glyph); ``images``: :func:`_small_images`' options."""
    splits_ = ["train", "test", *(["extra"] if extra else [])]
    paths = {split: os.path.join(root, _SVHN["files"][split]) for split in splits_}
    missing = [path for path in paths.values() if not os.path.isfile(path)]
    if missing and download:
        _download_svhn(root, splits_)
        missing = [path for path in paths.values() if not os.path.isfile(path)]
    if missing:
        raise DataNotFoundError(
            f"SVHN not found: {missing[0]} is missing. Put torchvision's SVHN files (train_32x32.mat, "
            f"test_32x32.mat{', extra_32x32.mat' if extra else ''}) in data.root={root!r}, or set "
            "data.download=true"
        )
    loaded = {split: load_svhn_file(path) for split, path in paths.items()}
    train_x, train_y = loaded["train"]
    if extra:
        train_x, train_y = torch.cat([train_x, loaded["extra"][0]]), torch.cat([train_y, loaded["extra"][1]])
    own = (_SVHN["mean"], _SVHN["std"])
    return _small_images((train_x, train_y), loaded["test"], own, 10, augment, flip=False, **images)


def load_svhn_file(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One of SVHN's ``.mat`` files: ``uint8`` images ``(N, 3, 32, 32)`` and ``int64`` labels in 0..9;
    else a one-line ``ValueError`` naming the file."""
    from scipy.io import loadmat

    try:
        mat = loadmat(path)
        x, y = mat["X"], mat["y"]
    except Exception as err:  # not a MATLAB file, or one without SVHN's arrays
        raise ValueError(
            f"{path} is not an SVHN file (a MATLAB file with X (32, 32, 3, N) and y (N, 1)): "
            f"{type(err).__name__}: {err}"
        ) from None
    if x.ndim != 4 or x.shape[:3] != (32, 32, 3) or y.reshape(-1).shape[0] != x.shape[3]:
        raise ValueError(
            f"{path} is not an SVHN file: X has shape {x.shape} and y {y.shape}, not (32, 32, 3, N) and "
            "(N, 1)"
        )
    images = torch.from_numpy(np.ascontiguousarray(x.transpose(3, 2, 0, 1), dtype=np.uint8))
    labels = torch.from_numpy(y.reshape(-1).astype(np.int64) % 10)  # 10 is the digit 0
    return images, labels


def _download_svhn(root: str, splits_: list[str]) -> None:
    import torchvision

    try:
        for split in splits_:
            torchvision.datasets.SVHN(root=root, split=split, download=True)
    except Exception as err:  # no network, a proxy, a full disk: all end in the same advice
        raise DataNotFoundError(
            f"SVHN is not under data.root={root!r} and downloading it failed ({type(err).__name__}: {err}); "
            "put torchvision's SVHN files there by hand"
        ) from err


# ------------------------------------------------------------------------------ ImageNet-format folders

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
NORMALIZE = ("workers", "device")  # data.normalize (image folders): where a batch becomes normalised floats
CROPS = ("resized", "padded")  # data.crop (image folders): ImageNet's RandomResizedCrop, or a padded crop
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")  # image files Pillow reads
TINY_ANNOTATIONS = "val_annotations.txt"  # Tiny-ImageNet's val/: images/ and this file, not class folders


def _check_folder_pipeline(
    size, resize, color_jitter: float, lighting: float, normalize: str, crop: str, padding
) -> None:
    """Refuse, in one line, an image-folder pipeline that cannot be built (:func:`_imagefolder`'s
    arguments)."""
    if normalize not in NORMALIZE:
        raise ValueError(f"data.normalize={normalize!r} is not a choice; valid: {', '.join(NORMALIZE)}")
    if normalize == "device" and (color_jitter or lighting):
        raise ValueError(
            "data.normalize=device converts whole uint8 batches on the device, and data.color_jitter and "
            "data.lighting transform each image's floats in the workers: use data.normalize=workers with them"
        )
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or resize < size:
        raise ValueError(
            f"data.size and data.resize must be ints with 1 <= size <= resize, got {size}, {resize}"
        )
    if crop not in CROPS:
        raise ValueError(f"data.crop={crop!r} is not a crop; valid: {', '.join(CROPS)}")
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ValueError(f"data.padding must be an integer >= 0, got {padding!r}")
    if color_jitter < 0 or lighting < 0:
        raise ValueError(f"data.color_jitter and data.lighting must be >= 0, got {color_jitter}, {lighting}")


def _imagefolder(
    name: str,
    root: str = "data/imagenet",
    train: str = "train",
    val: str = "val",
    size: int = 224,
    resize: int = 256,
    augment: bool = True,
    color_jitter: float = 0.0,
    lighting: float = 0.0,
    num_workers: int = 8,
    normalize: str = "workers",
    crop: str = "resized",
    padding: int = 4,
    mean: list | None = None,
    std: list | None = None,
    imbalance_ratio: float | None = None,
    subset_seed: int = 0,
):
    """An image classification set in ImageNet's layout: ``root/<train>/<class>/<image>`` (images may sit
    deeper, as Tiny-ImageNet's ``<class>/images/``) and ``root/<val>/<class>/<image>``, or Tiny-ImageNet's
    ``root/<val>/images/`` with ``val_annotations.txt`` (file, class per line). Classes are the training
    folders' names, sorted. The standard pipelines (torchvision's v2 transforms on uint8 images decoded
    by Pillow): training ``RandomResizedCrop(size)`` and a horizontal flip (``augment``; else as
    evaluation), evaluation ``Resize(resize)`` and ``CenterCrop(size)``; both normalised with ImageNet's
    mean and std. ``color_jitter`` and ``lighting`` (> 0) add, to training images, the color augmentation
    of fb.resnet.torch that CutMix's ImageNet code uses (:class:`ResNetColor`). ``normalize="device"``: the
    workers stop at the uint8 crop, and each batch is converted and normalised on the training device
    (:class:`DeviceNormalized`: the same values, a quarter of the bytes to copy, less work per image in the
    workers); not with the color augmentation, which works on each image's floats. ``crop="padded"``: the
    small-image pipelines (Tiny-ImageNet's 64x64, as the Manifold Mixup authors train it): training a
    random ``size`` crop of the image zero-padded by ``padding`` and a flip, evaluation ``CenterCrop(size)``
    (the image itself at that size), without resizing. ``mean``/``std``: the normalisation instead of
    ImageNet's. ``imbalance_ratio``: the training images cut to a long tail (:func:`long_tail_subset`, by
    the sorted classes' order, drawn with ``subset_seed``). Bad layouts are refused before training, in one
    line each."""
    _check_folder_pipeline(size, resize, color_jitter, lighting, normalize, crop, padding)
    norm = normalization(IMAGENET_MEAN, IMAGENET_STD, mean, std)
    train_dir, val_dir = os.path.join(root, train), os.path.join(root, val)
    for split, folder in (("data.train", train_dir), ("data.val", val_dir)):
        if not os.path.isdir(folder):
            raise DataNotFoundError(
                f"data=imagefolder: {folder} is missing ({split}={os.path.basename(folder)!r} under "
                f"data.root={root!r}); the layout is root/train/<class>/<image> and root/val/<class>/<image>"
            )
    classes = sorted(e.name for e in os.scandir(train_dir) if e.is_dir())
    if not classes:
        raise ValueError(f"data=imagefolder: {train_dir} has no class folders (<class>/<image> under it)")
    train_samples = _folder_samples(train_dir, classes)
    if os.path.isfile(os.path.join(val_dir, TINY_ANNOTATIONS)):
        val_samples = _annotated_samples(val_dir, classes)
    else:
        val_classes = sorted(e.name for e in os.scandir(val_dir) if e.is_dir())
        if val_classes != classes:
            only_train = sorted(set(classes) - set(val_classes))[:3]
            only_val = sorted(set(val_classes) - set(classes))[:3]
            raise ValueError(
                f"data=imagefolder: {train_dir} and {val_dir} hold different classes (only in train: "
                f"{only_train or 'none'}; only in val: {only_val or 'none'})"
            )
        val_samples = _folder_samples(val_dir, classes)
    from torchvision.transforms import v2

    normalise = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(*norm)]
    if normalize == "device":  # (DeviceNormalized does both to each batch)
        normalise = []
    resized = crop == "resized"
    evaluate = v2.Compose([*([v2.Resize(resize, antialias=True)] if resized else []), v2.CenterCrop(size),
                           *normalise])  # fmt: skip
    color = [ResNetColor(color_jitter, lighting)] if color_jitter or lighting else []
    cropping = v2.RandomResizedCrop(size, antialias=True) if resized else v2.RandomCrop(size, padding=padding)
    training = (
        v2.Compose([cropping, v2.RandomHorizontalFlip(), *normalise[:1], *color, *normalise[1:]])
        if augment
        else evaluate
    )  # fmt: skip
    if imbalance_ratio is not None:
        labels = torch.tensor([y for _, y in train_samples], dtype=torch.int64)
        keep = long_tail_subset(labels, imbalance_ratio, subset_seed, len(classes)).tolist()
        train_samples = [train_samples[i] for i in keep]
    info = {"in_channels": 3, "num_classes": len(classes), "image_size": size,
            "train_labels": torch.tensor([y for _, y in train_samples], dtype=torch.int64)}  # fmt: skip
    if normalize == "device":
        info["normalized_on_device"] = norm
    listing = "\n".join(f"{os.path.relpath(p, root)}\t{y}" for p, y in (*train_samples, *val_samples))
    info["split_hash"] = digest(np.frombuffer(listing.encode(), dtype=np.uint8))
    return FolderImages(train_samples, training), FolderImages(val_samples, evaluate), info


def _folder_samples(folder: str, classes: list[str]) -> list[tuple[str, int]]:
    """``(path, label)`` of every image under ``folder/<class>/`` (any depth), sorted; a class folder
    without images or a file that is not an image is refused in one line."""
    samples = []
    for label, name in enumerate(classes):
        found = []
        for here, dirs, files in os.walk(os.path.join(folder, name)):
            dirs.sort()
            for file in sorted(files):
                path = os.path.join(here, file)
                if file.startswith("."):
                    continue
                if not file.lower().endswith(IMAGE_EXTENSIONS):
                    raise ValueError(
                        f"data=imagefolder: {path} is not an image ({', '.join(IMAGE_EXTENSIONS)}); move it "
                        "out of the class folders"
                    )
                found.append((path, label))
        if not found:
            raise ValueError(f"data=imagefolder: the class folder {os.path.join(folder, name)} has no images")
        samples += found
    return samples


def _annotated_samples(folder: str, classes: list[str]) -> list[tuple[str, int]]:
    """Tiny-ImageNet's validation split: ``folder/images/<file>``, each file's class in
    ``folder/val_annotations.txt`` (tab-separated: file, class, then its box)."""
    index = {name: label for label, name in enumerate(classes)}
    samples = []
    path = os.path.join(folder, TINY_ANNOTATIONS)
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 2 or parts[1] not in index:
                why = (
                    "has no class column"
                    if len(parts) < 2
                    else f"names class {parts[1]!r}, not a training class"
                )
                raise ValueError(f"data=imagefolder: {path} line {number} {why}")
            image = os.path.join(folder, "images", parts[0])
            if not os.path.isfile(image):
                raise DataNotFoundError(
                    f"data=imagefolder: {image} (listed in {path} line {number}) is missing"
                )
            samples.append((image, index[parts[1]]))
    if not samples:
        raise ValueError(f"data=imagefolder: {path} lists no images")
    return sorted(samples)


# AlexNet's PCA of ImageNet's RGB pixels, as fb.resnet.torch and CutMix's code (utils.py) give them
IMAGENET_EIGVAL = (0.2175, 0.0188, 0.0045)
IMAGENET_EIGVEC = ((-0.5675, 0.7192, 0.4009), (-0.5808, -0.0045, -0.8140), (-0.5836, -0.6948, 0.4203))


def jitter(image: torch.Tensor, order: list[str], alphas: list[float]) -> torch.Tensor:
    """fb.resnet.torch's color jitter on a float ``(3, H, W)`` image in [0, 1]: in ``order``, each of
    ``brightness`` (towards black), ``contrast`` (towards the grey image's mean) and ``saturation`` (towards
    the grey image) as ``image.lerp(target, alpha)`` with its ``alpha``."""
    for what, alpha in zip(order, alphas, strict=True):
        if what == "brightness":
            target = torch.zeros_like(image)
        else:
            grey = (0.299 * image[0] + 0.587 * image[1] + 0.114 * image[2]).expand_as(image)
            target = torch.full_like(image, float(grey[0].mean())) if what == "contrast" else grey
        image = image.lerp(target, alpha)
    return image


def pca_lighting(image: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """AlexNet's lighting noise: ``image`` plus ``eigvec @ (alpha * eigval)`` on every pixel."""
    eigval = torch.tensor(IMAGENET_EIGVAL, dtype=image.dtype)
    eigvec = torch.tensor(IMAGENET_EIGVEC, dtype=image.dtype)
    rgb = (eigvec * (alpha.to(image.dtype) * eigval).view(1, 3)).sum(1)
    return image + rgb.view(3, 1, 1)


class ResNetColor:
    """The color augmentation of fb.resnet.torch, as CutMix's ImageNet code uses it (``utils.ColorJitter``
    and ``utils.Lighting``): brightness, contrast and saturation in a random order, each moved by a
    uniform ``alpha`` in ``[-jitter, jitter]`` (:func:`jitter`), then the PCA lighting noise with
    ``alpha ~ N(0, lighting)`` per component (:func:`pca_lighting`). On float images in [0, 1], before the
    normalisation. The draws come from torch's generator (the sample's own seed in the app's loaders),
    where the authors' code takes Python's global ``random`` for the jitter."""

    def __init__(self, jitter: float = 0.4, lighting: float = 0.1):
        self.jitter, self.lighting = jitter, lighting

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if self.jitter:
            kinds = ["brightness", "contrast", "saturation"]
            order = [kinds[i] for i in torch.randperm(3).tolist()]
            alphas = ((torch.rand(3, dtype=torch.float64) * 2 - 1) * self.jitter).tolist()
            image = jitter(image, order, alphas)
        if self.lighting:
            image = pca_lighting(image, torch.randn(3, dtype=torch.float64) * self.lighting)
        return image

    def __repr__(self) -> str:
        return f"ResNetColor(jitter={self.jitter}, lighting={self.lighting})"


class FolderImages(Dataset):
    """Images read from files (Pillow, as RGB), made uint8 tensors (``v2.ToImage``) and transformed; a
    file that cannot be decoded is named in the error."""

    def __init__(self, samples: list[tuple[str, int]], transform):
        from torchvision.transforms import v2

        self.samples, self.transform, self.to_image = samples, transform, v2.ToImage()
        self.labels = torch.tensor([label for _, label in samples], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        path, _ = self.samples[i]
        try:
            with Image.open(path) as image:
                tensor = self.to_image(image.convert("RGB"))
        except OSError as err:  # PIL's UnidentifiedImageError, a truncated file
            raise ValueError(f"data=imagefolder: {path} cannot be decoded as an image: {err}") from None
        return self.transform(tensor), self.labels[i]


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


def crop_and_flip(
    images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor, padding: int = 4
):
    """A batch's padded random crop and horizontal flip, drawn per image: each ``(C, H, W)`` image
    zero-padded by ``padding``, cropped back to ``H x W`` at ``(top, left)`` of the padded image (each in
    ``[0, 2 * padding]``), then mirrored where ``flip``: ``v2.RandomCrop(H, padding=padding)`` followed
    by ``v2.RandomHorizontalFlip()`` with those draws, on the images' device, without a loop."""
    b, c, h, w = images.shape
    padded = F.pad(images, (padding,) * 4)
    rows = top[:, None] + torch.arange(h, device=images.device)  # (B, H) rows of the padded image
    cols = left[:, None] + torch.arange(w, device=images.device)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    batch = torch.arange(b, device=images.device)[:, None, None, None]
    channel = torch.arange(c, device=images.device)[None, :, None, None]
    return padded[batch, channel, rows[:, None, :, None], cols[:, None, None, :]]


def augmentation_draws(
    seeds: torch.Tensor, padding: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample's ``(top, left, flip)`` from its augmentation seed (uniform in ``[0, 2**62)``): top and
    left uniform in ``[0, 2 * padding]``, flip a fair coin, independent (the seed's digits in base
    ``2 * padding + 1``, then its parity; the bias of ``2**62`` not being a multiple is below 1e-16)."""
    n = 2 * padding + 1
    return seeds % n, (seeds // n) % n, (seeds // (n * n)) % 2 == 1


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

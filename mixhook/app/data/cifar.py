"""CIFAR-10/100 and SVHN from their files (CIFAR's python-format batches, torchvision's SVHN ``.mat``
files), downloaded on request, as 32x32 :class:`~mixhook.app.data.images.SmallImages`
(:func:`~mixhook.app.data.images.small_images`): cut to fewer images of each class or to a long tail,
normalised, augmented with a padded crop (and a flip, but for SVHN)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import torch

from ..errors import DataNotFoundError
from .images import small_images

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


def cifar(
    name: str,
    root: str = "data",
    download: bool = False,
    augment: bool = True,
    num_workers: int = 2,
    **images,
):
    """CIFAR-10/100's python-format files under ``root``; ``images``: the options of
    :func:`~mixhook.app.data.images.small_images`."""
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
    return small_images((train_x, train_y), (test_x, test_y), own, spec["num_classes"], augment, **images)


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


def svhn(
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
    glyph); ``images``: the options of :func:`~mixhook.app.data.images.small_images`."""
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
    return small_images((train_x, train_y), loaded["test"], own, 10, augment, flip=False, **images)


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

"""The MNIST family: MNIST, Fashion-MNIST and Kuzushiji-MNIST (KMNIST), 28x28 grey images in 10 classes
(60,000 training and 10,000 test images each), from their four IDX files (:func:`read_idx`), as
:class:`~mixhook.app.data.images.SmallImages` (:func:`~mixhook.app.data.images.small_images`): cut to
fewer images of each class or to a long tail, normalised, augmented with a padded crop (and, for
Fashion-MNIST, a flip) on the training device.

The four files (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``, each gzipped or not) are looked for in the first folder that holds all four:
``data.root`` itself, then torchvision's layout under it (``<root>/<FashionMNIST|MNIST|KMNIST>/raw/``,
where ``data.download=true`` puts them). With ``data.root`` left null, each set has folders of its own
(the three sets' files have the same names, so a shared folder would give one set's images to another):
``data/<FashionMNIST|MNIST|KMNIST>/raw/``, ``data/<fashion_mnist|mnist|kmnist>/``, and for Fashion-MNIST
Debian's package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``), found without any
setting where it is installed.

Each file is checked as it is read (its magic number, its size against its header, image and label
counts, labels in 0-9, square images): a file that is not what its name says is refused in one line
naming it; and a whole training set (60,000 images) whose mean pixel is another set's (MNIST 0.1307,
Fashion-MNIST 0.2860, KMNIST 0.1918) is refused as that set's files.
"""

from __future__ import annotations

import gzip
import logging
import os
import zlib

import numpy as np
import torch

from ..errors import DataNotFoundError
from .images import small_images

IMAGES, LABELS = 3, 1  # the dimensions of an IDX file of images (N, rows, columns) and of labels (N,)
_UNSIGNED_BYTE = 0x08  # the IDX type code of uint8 data
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_SETS = {  # ("mean": the whole training set's mean pixel, in [0, 1]: what tells the three sets' files apart)
    "mnist": {"title": "MNIST", "folder": "MNIST", "debian": None, "mean": 0.1307},
    "fashion_mnist": {
        "title": "Fashion-MNIST",
        "folder": "FashionMNIST",
        "debian": "/usr/share/datasets/fashion-mnist",
        "package": "dataset-fashion-mnist",
        "mean": 0.2860,
    },
    "kmnist": {"title": "Kuzushiji-MNIST", "folder": "KMNIST", "debian": None, "mean": 0.1918},
}
WHOLE = 60_000  # the training images of each of the three sets
CLASSES = 10

log = logging.getLogger("mixhook")


def read_idx(path: str, dims: int) -> torch.Tensor:
    """The uint8 array of an IDX file (LeCun's format: a magic number ``0x000008`` followed by the number
    of dimensions, each dimension's size as a big-endian 32-bit integer, then the data), gzipped or not
    (by its ``.gz`` name), as a tensor of the sizes its header gives; ``dims``: the dimensions it must
    have (:data:`IMAGES` or :data:`LABELS`). A file that is not one (its magic number), that holds fewer
    or more bytes than its header promises, or that is not a valid gzip file is refused in one
    ``ValueError`` line naming it."""
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            with open(path, "rb") as f:
                raw = f.read()
    except (OSError, EOFError, zlib.error) as err:  # a gzip file cut short or not gzip at all
        raise ValueError(f"{path} cannot be read as {'a gzip file' if path.endswith('.gz') else 'a file'}: "
                         f"{err}") from None  # fmt: skip
    expected = 0x0800 | dims
    what = "images" if dims == IMAGES else "labels"
    magic = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
    if magic != expected:
        found = (
            "it is shorter than its 4-byte magic number"
            if magic is None
            else f"its magic number is 0x{magic:08x}"
        )
        raise ValueError(
            f"{path} is not an IDX file of {what} ({found}, not 0x{expected:08x}: {dims} dimension"
            f"{'s' if dims > 1 else ''} of unsigned bytes)"
        )
    header = 4 + 4 * dims
    if len(raw) < header:
        raise ValueError(f"{path} is truncated: {len(raw)} bytes, shorter than its {header}-byte header")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    size = int(np.prod(shape, dtype=np.int64))
    held = len(raw) - header
    if held != size:
        state = "truncated" if held < size else "longer than its header says"
        raise ValueError(
            f"{path} is {state}: its header gives {' x '.join(map(str, shape))} = {size:,} bytes of {what}, "
            f"and it holds {held:,}"
        )
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape).copy())


def mnist(
    name: str,
    root: str | None = None,
    download: bool = False,
    augment: bool = True,
    flip: bool = False,
    num_workers: int = 2,
    **images,
):
    """MNIST, Fashion-MNIST or KMNIST (``name``: ``mnist``, ``fashion_mnist``, ``kmnist``) from their IDX
    files (see the module for where they are looked for), normalised by the training set's own mean and
    std (``data.mean``/``data.std`` to set them: Random Erasing's Fashion-MNIST code takes MNIST's 0.1307
    and 0.3081); ``augment``: the padded random crop, and with ``flip`` a horizontal flip; ``images``: the
    options of :func:`~mixhook.app.data.images.small_images`."""
    spec = _SETS[name]
    folder = find(name, root)
    if folder is None and download:
        _download(name, root or "data")
        folder = find(name, root)
    if folder is None:
        raise DataNotFoundError(_not_found(name, root))
    train = _split(folder, "train")
    test = _split(folder, "test")
    if train[0].shape[-1] != train[0].shape[-2]:
        raise ValueError(
            f"{spec['title']} in {folder}: its images are {tuple(train[0].shape[-2:])}, not square; the "
            "MNIST family's are 28x28"
        )
    if train[0].shape[1:] != test[0].shape[1:]:
        raise ValueError(
            f"{spec['title']} in {folder}: the training images are {tuple(train[0].shape[2:])} and the test "
            f"images {tuple(test[0].shape[2:])}; both splits must have one size"
        )
    pixels = train[0].to(torch.float64) / 255.0  # (the full training split's, before any subset)
    own = ((pixels.mean().item(),), (pixels.std().item(),))
    _check_which(name, folder, len(train[0]), own[0][0])
    log.info("data: %s from %s", spec["title"], folder)
    return small_images(train, test, own, CLASSES, augment, flip=flip, **images)


def find(name: str, root: str | None) -> str | None:
    """The first folder holding all four IDX files of data set ``name`` (each gzipped or not), or ``None``."""
    for folder in _folders(name, root):
        if all(_file(folder, stem) is not None for split in _FILES.values() for stem in split):
            return folder
    return None


def _folders(name: str, root: str | None) -> list[str]:
    """Where data set ``name``'s files are looked for, in order (see the module)."""
    spec = _SETS[name]
    if root is not None:
        return [root, os.path.join(root, spec["folder"], "raw")]
    found = [os.path.join("data", spec["folder"], "raw"), os.path.join("data", name)]
    return found + ([spec["debian"]] if spec["debian"] else [])


def _check_which(name: str, folder: str, count: int, mean: float) -> None:
    """Refuse a whole training set whose mean pixel is another set's (its files put where ``name``'s were
    looked for: the three sets' files have the same names)."""
    if count != WHOLE:
        return
    nearest = min(_SETS, key=lambda other: abs(_SETS[other]["mean"] - mean))
    if nearest != name:
        spec, other = _SETS[name], _SETS[nearest]
        raise ValueError(
            f"{folder} holds {other['title']}'s training images, not {spec['title']}'s (their mean pixel is "
            f"{mean:.4f}: {other['title']}'s is {other['mean']}, {spec['title']}'s {spec['mean']}); put "
            f"{spec['title']}'s files in a folder of their own and name it with data.root"
        )


def _file(folder: str, stem: str) -> str | None:
    """``folder/stem`` or ``folder/stem.gz`` (the uncompressed one first), whichever exists."""
    for path in (os.path.join(folder, stem), os.path.join(folder, f"{stem}.gz")):
        if os.path.isfile(path):
            return path
    return None


def _split(folder: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A split's ``(N, 1, H, W)`` uint8 images and int64 labels, checked to agree and to be in 0-9."""
    image_file, label_file = (_file(folder, stem) for stem in _FILES[split])
    images, labels = read_idx(image_file, IMAGES), read_idx(label_file, LABELS)
    if len(images) != len(labels):
        raise ValueError(
            f"{image_file} holds {len(images):,} images and {label_file} {len(labels):,} labels: the "
            f"{split} split's files do not belong together"
        )
    if len(labels) and int(labels.max()) >= CLASSES:
        bad = int(labels.max())
        raise ValueError(f"{label_file} holds label {bad}, outside the data set's classes 0-{CLASSES - 1}")
    return images.unsqueeze(1), labels.to(torch.int64)


def _not_found(name: str, root: str | None) -> str:
    """Where data set ``name`` was looked for, and every way to get it, in one line."""
    spec = _SETS[name]
    looked = ", ".join(_folders(name, root))
    where = f"data.root={root!r}" if root is not None else f"data/{name}/ (or data.root=<folder>)"
    ways = [f"put its four IDX files (train-images-idx3-ubyte, ..., gzipped or not) in {where}"]
    if spec["debian"]:
        ways.insert(0, f"apt-get install {spec['package']} (Debian's, found in {spec['debian']})")
    ways.append("set data.download=true (torchvision downloads it)")
    return f"{spec['title']} not found (looked in {looked}); get it: " + "; or ".join(ways)


def _download(name: str, root: str) -> None:
    import torchvision

    spec = _SETS[name]
    dataset = getattr(torchvision.datasets, spec["folder"])
    try:
        for train in (True, False):
            dataset(root=root, train=train, download=True)
    except Exception as err:  # no network, a proxy, a full disk: all end in the same advice
        others = "apt-get install dataset-fashion-mnist, or " if spec["debian"] else ""
        raise DataNotFoundError(
            f"{spec['title']} is not under data.root={root!r} and downloading it failed "
            f"({type(err).__name__}: {err}); {others}put its four IDX files there by hand"
        ) from err

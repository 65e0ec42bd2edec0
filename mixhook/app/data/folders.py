"""ImageNet-format image folders (ImageNet, Tiny-ImageNet, any ``root/train/<class>/`` tree): the
samples found in the folders (or in Tiny-ImageNet's annotations), the standard pipelines, the images read
by Pillow in DataLoader workers (:class:`FolderImages`), and batches normalised on the device
(:class:`DeviceNormalized`)."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..errors import DataNotFoundError
from ..provenance import digest
from .augment import ResNetColor
from .images import normalization
from .sampling import long_tail_subset

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
NORMALIZE = ("workers", "device")  # data.normalize (image folders): where a batch becomes normalised floats
CROPS = ("resized", "padded")  # data.crop (image folders): ImageNet's RandomResizedCrop, or a padded crop
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")  # image files Pillow reads
TINY_ANNOTATIONS = "val_annotations.txt"  # Tiny-ImageNet's val/: images/ and this file, not class folders


def _check_folder_pipeline(
    size, resize, color_jitter: float, lighting: float, normalize: str, crop: str, padding
) -> None:
    """Refuse, in one line, an image-folder pipeline that cannot be built (:func:`imagefolder`'s
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


def imagefolder(
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
    info["normalization"] = tuple(list(v) for v in norm)
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

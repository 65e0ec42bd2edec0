"""The augmentations the app computes itself (torchvision's transforms do the rest): the device
pipeline's padded crop and flip of a whole batch, drawn from each sample's seed (:func:`crop_and_flip`,
:func:`augmentation_draws`), and fb.resnet.torch's color augmentation (:class:`ResNetColor`:
:func:`jitter`, :func:`pca_lighting`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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

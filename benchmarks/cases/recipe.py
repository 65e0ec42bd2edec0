"""Cases 8 and 9: what a paper reproduction costs end to end, through the app's own data and loop.

8. ``data_pipelines``: images/s of the two CIFAR pipelines over one epoch of CIFAR-format images
   (synthetic content): batches made on the device from one uint8 tensor (``data.pipeline=device``)
   against per-sample augmentation in DataLoader workers (``data.pipeline=workers``), each batch moved
   to the device as the loop moves it.
9. ``recipe``: the training throughput of Verma et al. 2019's CIFAR-10 recipe (PreActResNet-18, batch
   100, SGD 0.1 Nesterov, weight decay 1e-4, BCE on the softmax; Manifold Mixup alpha 2 at input,
   layer1, layer2) through ``train_one_epoch``, with Manifold Mixup against without, each with the
   default optimizer (the loss read on the host every step) and with ``optim.fused=true`` (the check
   kept on the device, read every 100 steps); and the projected wall time of the paper's 1,200 epochs
   of 50,000 images, each followed by an evaluation of 10,000.
"""

from __future__ import annotations

import copy
import os
import statistics

import torch
from torch.utils.data import DataLoader

from benchmarks import cases
from benchmarks.timing import ratio
from mixhook import ManifoldMixup
from mixhook.app.data import _CIFAR, DeviceBatches, EpochSampler, SeededSamples, SmallImages
from mixhook.app.training.evaluation import evaluate
from mixhook.app.training.finite import LAZY_EVERY, FiniteCheck
from mixhook.app.training.loop import Training, train_one_epoch
from mixhook.app.training.task import Classification

PAPER_EPOCHS, TRAIN_IMAGES, TEST_IMAGES = 1200, 50_000, 10_000


def synthetic_cifar(images: int, augment: bool, seed: int = 0) -> SmallImages:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (images, 3, 32, 32), dtype=torch.uint8, generator=g)
    spec = _CIFAR["cifar10"]
    return SmallImages(x, torch.randint(0, 10, (images,), generator=g), spec["mean"], spec["std"], augment)


def data_pipelines(
    device, timer, reps: int, images: int, batch: int = 100, workers: int | None = None
) -> dict:
    data = synthetic_cifar(images, augment=True)
    workers = workers if workers is not None else min(8, os.cpu_count() or 1)
    on_device = DeviceBatches(data, batch, device, sampler=EpochSampler(images, seed=0, batch_size=batch))
    per_sample = DataLoader(
        SeededSamples(data), batch_size=batch, sampler=EpochSampler(images, seed=0, batch_size=batch),
        num_workers=workers, persistent_workers=workers > 0,
    )  # fmt: skip

    def epoch(loader):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return x

    times = timer.side_by_side(
        {"device": lambda: epoch(on_device), "workers": lambda: epoch(per_sample)},
        reps=reps,
        inner=1,
        warmup=1,
    )
    return {
        "images": images,
        "batch": batch,
        "workers": workers,
        "images_per_second": {k: images / statistics.median(v) for k, v in times.items()},
        "device_vs_workers": ratio(times, "device", "workers"),
    }


def recipe(device, timer, reps: int, steps: int | None = None, batch: int = 100, size: int = 32) -> dict:
    """One timed repetition is one epoch of ``steps`` batches (default: the whole 50,000 images)."""
    images = TRAIN_IMAGES if steps is None else steps * batch
    data = synthetic_cifar(images, augment=True)
    loader = DeviceBatches(data, batch, device, sampler=EpochSampler(images, seed=0, batch_size=batch))
    test_images = min(TEST_IMAGES, images)
    test = DeviceBatches(synthetic_cifar(test_images, augment=False, seed=1), 500, device)
    if size != 32:  # the quick form: smaller images through the same loop
        loader.images = loader.images[..., :size, :size].contiguous()
        test.images = test.images[..., :size, :size].contiguous()
    torch.manual_seed(0)
    base = cases.preact_resnet18()
    epochs = {}
    for name in ("none", "mixup", "none_fused", "mixup_fused"):
        model = copy.deepcopy(base).to(device)
        fused = name.endswith("_fused")
        opt = torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, fused=fused or None
        )
        mixup = None
        if name.startswith("mixup"):
            mixup = ManifoldMixup(
                ["input", "layer1", "layer2"], alpha=2.0, generator=torch.Generator().manual_seed(0)
            )
            mixup.attach(model)
        finite = FiniteCheck(LAZY_EVERY if fused else 1, opt)
        training = Training(
            model, opt, device, mixup, task=Classification("bce_softmax"), finite=finite, progress_bar=False
        )
        epochs[name] = lambda training=training: train_one_epoch(training, loader)
    epochs["eval"] = lambda: evaluate(model, test, device)
    times = timer.side_by_side(epochs, reps=reps, inner=1, warmup=1)
    seconds = {k: statistics.median(v) for k, v in times.items()}
    per_image = {k: v / (test_images if k == "eval" else images) for k, v in seconds.items()}
    projected = {
        k: PAPER_EPOCHS * (per_image[k] * TRAIN_IMAGES + per_image["eval"] * TEST_IMAGES) / 3600
        for k in per_image
        if k != "eval"
    }
    return {
        "images_per_epoch": images,
        "batch": batch,
        "image_size": size,
        "images_per_second": {k: 1 / v for k, v in per_image.items()},
        "mixup_vs_none": ratio(times, "mixup", "none"),
        "mixup_fused_vs_none_fused": ratio(times, "mixup_fused", "none_fused"),
        "fused_lazy_vs_default": ratio(times, "mixup_fused", "mixup"),
        "projected_hours_1200_epochs": projected,
    }

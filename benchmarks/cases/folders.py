"""Case 8b (with ``data``): what the ImageNet pipeline of ``data=imagefolder`` delivers per loader worker.

A folder of JPEGs at ImageNet's typical size (500x375, quality 90, synthetic content) in ImageNet's layout,
read through the app's own ``build_data("imagefolder", ...)``: the training pipeline (Pillow's decode,
``RandomResizedCrop(224)``, a flip, the float conversion and ImageNet's normalisation) timed over one pass
in the main process (one worker's rate), its decode alone, the pass through ``workers`` DataLoader
workers, and one worker's rate with ``data.normalize=device`` (it stops at the uint8 crop; the batch is
converted and normalised where it trains, which on a GPU is a few elementwise kernels per batch). What a
GPU step needs is the images/s it trains at: divided by the per-worker rate, that is the number of workers
(CPU cores) that keep it fed.
"""

from __future__ import annotations

import os
import statistics
import tempfile

import numpy as np
import torch

from mixhook.app.data import build_data


def write_folder(root: str, images: int, classes: int = 10, size: tuple[int, int] = (375, 500)) -> None:
    """``images`` JPEGs (``size`` = height, width) in ``root/{train,val}/<class>/``, smooth synthetic
    content (noise compresses worse than photographs)."""
    from PIL import Image

    g = np.random.default_rng(0)
    h, w = size
    base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * np.ones((h, 1, 3), np.float32)
    for split, count in (("train", images), ("val", max(classes, images // 10))):
        for i in range(count):
            folder = os.path.join(root, split, f"class{i % classes:03d}")
            os.makedirs(folder, exist_ok=True)
            pixels = (base + g.normal(0, 12, (h, w, 3))).clip(0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(os.path.join(folder, f"{i:06d}.jpg"), quality=90)


def folder_pipeline(timer, reps: int, images: int, workers: int, batch: int = 32, device=None) -> dict:
    """The pipeline's images/s (see the module's text); with ``device``, also torchvision's
    ``decode_jpeg`` of the same files' bytes in batches of ``batch`` there (nvJPEG on a GPU: what
    ``decode_jpeg`` on the device would take off the loader workers)."""
    with tempfile.TemporaryDirectory() as root:
        write_folder(root, images)

        def loader(num_workers: int, normalize: str = "workers"):
            data = build_data(
                "imagefolder", batch_size=batch, root=root, num_workers=num_workers, normalize=normalize
            )
            return data.train

        one, many = loader(0), loader(workers)
        uint8 = loader(0, "device").loader  # (the workers' part: the uint8 batches, before the device)
        dataset = one.dataset.dataset  # (SeededSamples -> FolderImages)

        def decode_only():
            from PIL import Image

            for path, _ in dataset.samples:
                with Image.open(path) as image:
                    dataset.to_image(image.convert("RGB"))

        def epoch(data_loader):
            batches = 0
            for _ in data_loader:
                batches += 1
            return batches

        variants = {
            "decode": decode_only,
            "pipeline_one_worker": lambda: epoch(one),
            "pipeline_workers": lambda: epoch(many),
            "uint8_one_worker": lambda: epoch(uint8),
        }
        if device is not None:
            from torchvision.io import decode_jpeg, read_file

            files = [read_file(path) for path, _ in dataset.samples]

            def decode_torchvision():
                for start in range(0, len(files), batch):
                    decode_jpeg(files[start : start + batch], device=device)

            variants[f"decode_torchvision_{torch.device(device).type}"] = decode_torchvision
        times = timer.side_by_side(variants, reps=reps, inner=1, warmup=1)
        x, _ = next(iter(one))
    per_second = {k: images / statistics.median(v) for k, v in times.items()}
    return {
        "images": images,
        "image_size": "500x375 JPEG, quality 90",
        "batch": batch,
        "workers": workers,
        "output": list(x.shape[1:]),
        "images_per_second": per_second,
        "workers_per_1000_images_per_second": 1000 / per_second["pipeline_one_worker"],
        "workers_per_1000_images_per_second_uint8": 1000 / per_second["uint8_one_worker"],
        "bytes_per_image": {"float32": 4 * int(np.prod(x.shape[1:])), "uint8": int(np.prod(x.shape[1:]))},
        "threads": torch.get_num_threads(),
    }

"""Case 11, augmix: AugMix's two views of a batch made by mixhook's hook on the batch's device against timm's
data-loader AugMix (``augment_and_mix_transform("augmix-m3-w3")``, depth 1 to 3, on PIL images, twice per
image, then ``to_tensor``: what one DataLoader worker does for timm's ``--aug-splits 3``), side by side in
one process. One worker's time per batch over the hook's is the number of workers (CPU cores) a loader
would need to keep up with it. Both make the authors' defaults (severity 3, width 3, depth 1 to 3); timm's
operations are its own (it adds level noise and fill colours), so the comparison is of throughput, not of
pixels."""

from __future__ import annotations

import statistics

import torch
from torch import nn

from benchmarks.timing import ratio


def augmix(device, timer, reps: int, batch: int, size: int) -> dict:
    from mixhook import AugMix

    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (batch, 3, size, size), generator=g, dtype=torch.uint8)
    x = (pixels.float() / 255).to(device)
    model = nn.Sequential(nn.Identity()).train()
    mixer = AugMix(generator=torch.Generator().manual_seed(1))
    mixer.attach(model)

    def hook():
        model(x)  # (the clean rows and the two views: 3B rows)

    variants = {"mixhook_hook": hook}
    notes = {}
    try:
        from PIL import Image
        from timm.data.auto_augment import augment_and_mix_transform
        from torchvision.transforms.functional import to_tensor

        transform = augment_and_mix_transform("augmix-m3-w3")  # (depth -1, its default: 1 to 3)
        images = [Image.fromarray(p.permute(1, 2, 0).numpy()) for p in pixels]

        def worker():
            for image in images:
                to_tensor(transform(image)), to_tensor(transform(image))

        variants["timm_loader_worker"] = worker
    except ImportError as err:
        notes["timm_loader_worker"] = f"not measured: {err}"
    times = timer.side_by_side(variants, reps, 1, warmup=1)
    mixer.remove()
    seconds = {name: statistics.median(t) for name, t in times.items()}
    found = {
        "batch": batch,
        "image_size": size,
        "seconds_per_batch": seconds,
        "images_per_second": {name: batch / s for name, s in seconds.items()},
        "notes": notes,
    }
    if "timm_loader_worker" in times:
        found["hook_vs_timm_worker"] = ratio(times, "mixhook_hook", "timm_loader_worker")
        found["workers_to_match_hook"] = seconds["timm_loader_worker"] / seconds["mixhook_hook"]
    return found

"""Case 2: peers (torchvision's v2.MixUp, timm's Mixup when installed) against ManifoldMixup("input"): an
input-mixup training step of PreActResNet-18 each, in host time and (``device_time``) in device time with
the kernels per step.

Each step starts from its own copy of the batch, as a loader hands a fresh one: timm's ``Mixup`` blends
it in place, so every variant pays the same copy (timm alone paid one before, 2026-11-27). A GPU times
``inner`` steps per repetition (one step alone is launch jitter: the 2026-11-27 figure timed one)."""

from __future__ import annotations

import copy
import statistics

import torch
import torch.nn.functional as F

from benchmarks import cases
from benchmarks.timing import kernels_apart, per_step, ratio
from mixhook import ManifoldMixup


def peers(device, timer, reps, inner, batch, size, device_time: bool = False) -> dict:
    torch.manual_seed(0)
    base = cases.preact_resnet18().to(device).train()
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    variants, notes = {}, {}

    def soft_ce(logits, soft):
        return torch.sum(-soft * F.log_softmax(logits, dim=-1), dim=-1).mean()

    def make(transform=None, hook=None):
        model = copy.deepcopy(base)
        if hook is not None:
            hook.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            xb = x.clone()  # the loader's batch
            if transform is not None:
                xs, soft = transform(xb, y)
                loss = soft_ce(model(xs), soft)
            else:
                loss = hook.loss(F.cross_entropy, model(xb), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        return step

    variants["mixhook_input"] = make(hook=ManifoldMixup("input", alpha=1.0))
    from torchvision.transforms import v2

    tv_mixup = v2.MixUp(alpha=1.0, num_classes=10)
    variants["torchvision_v2_MixUp"] = make(transform=lambda a, b: tv_mixup(a, b))
    try:
        from timm.data import Mixup

        timm_mixup = Mixup(mixup_alpha=1.0, cutmix_alpha=0.0, num_classes=10, label_smoothing=0.0)
        variants["timm_Mixup"] = make(transform=timm_mixup)
    except ImportError:
        notes["timm_Mixup"] = "not installed (pip install -e '.[bench]')"
    times = timer.side_by_side(variants, reps=reps, inner=inner, warmup=2)
    found = {
        "model": "preact_resnet18",
        "batch": batch,
        "image_size": size,
        "steps_per_rep": inner,
        "seconds_per_step": {k: statistics.median(v) for k, v in times.items()},
        "vs_mixhook_input": {k: ratio(times, k, "mixhook_input") for k in times if k != "mixhook_input"},
        "notes": notes,
    }
    if "timm_Mixup" in times:
        found["mixhook_vs_timm"] = ratio(times, "mixhook_input", "timm_Mixup")
    if device_time:
        device, kernels = timer.device_side_by_side(variants, reps, inner)
        found.update(per_step(device, kernels))
        if "timm_Mixup" in device:
            found["device_mixhook_vs_timm"] = ratio(device, "mixhook_input", "timm_Mixup")
            extra, fewer = kernels_apart(kernels, "mixhook_input", "timm_Mixup")
            found["kernels_mixhook_not_timm"], found["kernels_timm_not_mixhook"] = extra, fewer
    return found

"""Case 2: peers (torchvision's v2.MixUp, timm's Mixup when installed) against ManifoldMixup("input"): an
input-mixup training step of PreActResNet-18 each."""

from __future__ import annotations

import copy
import statistics

import torch
import torch.nn.functional as F

from benchmarks import cases
from benchmarks.timing import ratio
from mixhook import ManifoldMixup


def peers(device, timer, reps, inner, batch, size) -> dict:
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
            if transform is not None:
                xs, soft = transform(x, y)
                loss = soft_ce(model(xs), soft)
            else:
                loss = hook.loss(F.cross_entropy, model(x), y)
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
        variants["timm_Mixup"] = make(transform=lambda a, b: timm_mixup(a.clone(), b))
    except ImportError:
        notes["timm_Mixup"] = "not installed (pip install -e '.[bench]')"
    times = timer.side_by_side(variants, reps=reps, inner=inner, warmup=2)
    return {
        "model": "preact_resnet18",
        "batch": batch,
        "image_size": size,
        "seconds_per_step": {k: statistics.median(v) for k, v in times.items()},
        "vs_mixhook_input": {k: ratio(times, k, "mixhook_input") for k in times if k != "mixhook_input"},
        "notes": notes,
    }

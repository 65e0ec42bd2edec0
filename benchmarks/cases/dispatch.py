"""Case 3: dispatch: microseconds per module call without, with an inactive and with an active hook, and
an eval forward of PreActResNet-18 with inactive hooks against none."""

from __future__ import annotations

import copy
import statistics

import torch
from torch import nn

from benchmarks import cases
from benchmarks.timing import ratio
from mixhook import ManifoldMixup


def dispatch(device, timer, reps, calls, eval_batch, size) -> dict:
    x = torch.randn(4, 8, device=device)
    variants = {}
    for name in ("no_hook", "inactive_hook", "active_hook"):
        model = nn.Sequential(nn.Identity()).to(device)
        if name != "no_hook":
            ManifoldMixup("0").attach(model)
        model.train(name == "active_hook")

        def call(model=model):
            for _ in range(calls):
                model(x)

        variants[name] = call
    times = timer.side_by_side(variants, reps=reps, inner=1, warmup=1)
    micro = {k: 1e6 * statistics.median(v) / calls for k, v in times.items()}

    torch.manual_seed(0)
    plain = cases.preact_resnet18().to(device).eval()
    hooked = copy.deepcopy(plain)
    ManifoldMixup(["input", "layer1", "layer2", "layer3"]).attach(hooked)
    batch = torch.randn(eval_batch, 3, size, size, device=device)
    with torch.no_grad():
        fwd = timer.side_by_side(
            {"unhooked": lambda: plain(batch), "inactive_hooks": lambda: hooked(batch)},
            reps=reps,
            inner=2,
            warmup=1,
        )
    return {
        "microseconds_per_call": micro,
        "hook_overhead_us": {k: micro[k] - micro["no_hook"] for k in ("inactive_hook", "active_hook")},
        "eval_forward_inactive_vs_unhooked": ratio(fwd, "inactive_hooks", "unhooked"),
        "eval_forward": {"model": "preact_resnet18", "batch": eval_batch, "image_size": size},
    }

"""Case 1: a training step (forward + backward + SGD) of PreActResNet-18 or a torchvision ResNet with each
hook, against no hook and against the papers' hand-edited forward; eager, compiled or under bf16 autocast."""

from __future__ import annotations

import copy
import statistics
from functools import partial

import numpy as np
import torch
import torch._dynamo
import torch.nn.functional as F
import torchvision
from torch import nn

from benchmarks import cases
from benchmarks.timing import kernels_apart, per_step, ratio
from mixhook import CutMix, GradScale, InputScale, ManifoldMixup

VARIANTS = (
    "none", "mixup_input", "mixup_layer1", "mixup_layer2", "mixup_layer3", "mixup_random", "hand_layer2",
    "cutmix_input", "gradscale_layer3", "inputscale_layer2", "fullhook_scale_layer3",
)  # fmt: skip


def hand_edited_forward(model: nn.Module, x, lam: float, index, where: str) -> torch.Tensor:
    """The papers' way: the blend written into forward() (PreActResNet-18 or torchvision ResNet)."""
    if isinstance(model, torchvision.models.ResNet):
        out = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        stages, head = [model.layer1, model.layer2, model.layer3, model.layer4], None
    else:
        out = model.conv1(x)
        stages, head = [model.layer1, model.layer2, model.layer3, model.layer4], True
    for i, stage in enumerate(stages, start=1):
        out = stage(out)
        if where == f"layer{i}":
            out = lam * out + (1 - lam) * out[index]
    if head:
        return model.linear(F.adaptive_avg_pool2d(out, 1).flatten(1))
    return model.fc(torch.flatten(model.avgpool(out), 1))


class FullBackwardHookScale:
    """GradScale done with ``register_full_backward_hook`` (the mechanism GradScale does not use):
    for comparison only; it fails on a layer whose output is then modified in place."""

    def __init__(self, layer: str, factor: float):
        self.layer, self.factor = layer, factor

    def attach(self, model):
        def hook(module, grad_input, grad_output):
            return tuple(None if g is None else g * self.factor for g in grad_input)

        return model.get_submodule(self.layer).register_full_backward_hook(hook)


def per_sample_ce(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


def training_steps(
    model_name: str,
    batch: int,
    size: int,
    device,
    timer,
    reps,
    inner,
    variants_wanted,
    compile_: bool = False,
    autocast: bool = False,
    channels_last: bool = False,
    device_time: bool = False,
) -> dict:
    # Dynamo does not guard on module hooks by default, so two compiled instances of one class, one hooked
    # and one not, would share compiled code: guard on them here, for every variant alike.
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=not compile_):
        return _training_steps(
            model_name,
            batch,
            size,
            device,
            timer,
            reps,
            inner,
            variants_wanted,
            compile_,
            autocast,
            channels_last,
            device_time,
        )


def _training_steps(
    model_name,
    batch,
    size,
    device,
    timer,
    reps,
    inner,
    variants_wanted,
    compile_,
    autocast,
    channels_last,
    device_time,
):
    torch.manual_seed(0)
    if model_name == "preact_resnet18":
        base = cases.preact_resnet18()
    else:
        base = torchvision.models.get_model(model_name, num_classes=10)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    base = base.to(device, memory_format=layout).train()
    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=layout)
    y = torch.randint(0, 10, (batch,), device=device)
    rng = np.random.default_rng(0)

    def hooks_for(name):
        return {
            "none": None,
            "mixup_input": ManifoldMixup("input"),
            "mixup_layer1": ManifoldMixup("layer1"),
            "mixup_layer2": ManifoldMixup("layer2"),
            "mixup_layer3": ManifoldMixup("layer3"),
            "mixup_random": ManifoldMixup(["input", "layer1", "layer2"]),
            "hand_layer2": None,
            "cutmix_input": CutMix("input"),
            "gradscale_layer3": GradScale("layer3", 0.5),
            "fullhook_scale_layer3": FullBackwardHookScale("layer3", 0.5),
            "inputscale_layer2": InputScale("layer2", 0.5),
        }[name]

    steps = {}
    for name in variants_wanted:
        model = copy.deepcopy(base)
        hook = hooks_for(name)
        if hook is not None:
            hook.attach(model)
        if name == "hand_layer2":  # compiled too, with lam as a tensor so that no value is specialised on
            runner = partial(hand_edited_forward, model, where="layer2")
        else:
            runner = model
        runner = torch.compile(runner) if compile_ else runner
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        mixer = hook if hasattr(hook, "loss") else None

        def step(runner=runner, opt=opt, mixer=mixer, name=name, model=model):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                if name == "hand_layer2":  # the reference code's draws: numpy's beta, torch's randperm
                    lam = float(rng.beta(2.0, 2.0))
                    index = torch.randperm(batch, device=device)
                    logits = runner(x, torch.tensor(lam, device=device) if compile_ else lam, index)
                    loss = (
                        lam * per_sample_ce(logits, y) + (1 - lam) * per_sample_ce(logits, y[index])
                    ).mean()
                else:
                    logits = runner(x)
                    loss = (
                        mixer.loss(per_sample_ce, logits, y) if mixer else per_sample_ce(logits, y)
                    ).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        steps[name] = step
        if mixer is not None:  # warm up on every layer, so that no compile happens while timing
            for layer in mixer.layers:
                mixer.pin(layer=layer)
                step()
    times = timer.side_by_side(steps, reps=reps, inner=inner, warmup=3 if compile_ else 2)
    result = {
        "model": model_name,
        "batch": batch,
        "image_size": size,
        "compiled": compile_,
        "autocast_bf16": autocast,
        "channels_last": channels_last,
        "hook_guards": "torch._dynamo.config.skip_nnmodule_hook_guards=False" if compile_ else None,
        "seconds_per_step": {k: statistics.median(v) for k, v in times.items()},
        "vs_none": {k: ratio(times, k, "none") for k in times if k != "none"},
    }
    if "hand_layer2" in times and "mixup_layer2" in times:
        result["mixup_layer2_vs_hand_layer2"] = ratio(times, "mixup_layer2", "hand_layer2")
    if device_time:
        result.update(device_figures(timer, steps, reps, inner))
    return result


def device_figures(timer, steps: dict, reps: int, inner: int) -> dict:
    """The device's side of a case's steps (:meth:`~benchmarks.timing.Timer.device_side_by_side`): device
    seconds per step and their ratios (to ``none``; Manifold Mixup's to the hand-edited forward), the
    kernels per step, and the kernels one variant runs that the other does not (mixhook's mix at
    ``layer2`` against the hand-edited forward's; a compiled graph's extra kernels are named there)."""
    times, kernels = timer.device_side_by_side(steps, reps, inner)
    out = per_step(times, kernels)
    if "none" in times:
        out["device_vs_none"] = {k: ratio(times, k, "none") for k in times if k != "none"}
    if "hand_layer2" in times and "mixup_layer2" in times:
        out["device_mixup_layer2_vs_hand_layer2"] = ratio(times, "mixup_layer2", "hand_layer2")
        extra, fewer = kernels_apart(kernels, "mixup_layer2", "hand_layer2")
        out["kernels_mixup_layer2_not_hand"], out["kernels_hand_not_mixup_layer2"] = extra, fewer
    return out

"""What mixhook's hooks cost: ratios measured side by side in one run.

    python benchmarks/run.py [--device cuda|cpu] [--quick] [--out benchmarks/results]

Every figure is a ratio (or a rate next to its physical limit) measured in the same process: the
variants of a case run in alternating order, repetition after repetition, after a warm-up, and the
median and the spread (min..max) of the per-repetition ratios are reported. Results go to
``<out>/<device>-<date>.json`` and ``.md``, with the device, torch version and settings.

Cases: 1. training step (forward + backward + SGD) of PreActResNet-18 and torchvision ResNet-50 at CIFAR
size with each hook, against no hook and against the paper's hand-edited forward (eager; compiled; bf16
on CUDA); 2. peers (torchvision's v2.MixUp, timm's Mixup when installed) against
ManifoldMixup("input"); 3. dispatch: microseconds per module call without, with an inactive and with
an active hook, and an eval forward with inactive hooks; 4. the blend's forward + backward as GB/s next
to the device's copy bandwidth; 5. recompiles of a compiled model over many steps with changing lam
and layer; 6. peak memory of a training step (CUDA).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch._dynamo
import torch.nn.functional as F
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixhook import CutMix, GradScale, InputScale, ManifoldMixup, blend  # noqa: E402
from mixhook.app.models import PreActResNet18  # noqa: E402
from mixhook.mixers import inverse_permutation  # noqa: E402

CASES = ("eager", "compiled", "bf16", "peers", "dispatch", "blend", "recompiles", "memory")

GOALS = {
    "mixup_vs_none": 1.02,  # active Manifold Mixup eager step / no-mixup step
    "mixup_vs_hand": 1.01,  # ... / the hand-edited forward
    "inactive_vs_unhooked": 1.01,  # eval forward with inactive hooks / unhooked
    "compiled_mixup_vs_compiled": 1.02,
    "recompiles_after_warmup": 0,
    "blend_vs_copy_bandwidth": 0.80,  # on a GPU
    "gradscale_vs_none": 1.02,
}


# ------------------------------------------------------------------------------------------ timing


class Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def side_by_side(self, variants: dict, reps: int, inner: int, warmup: int) -> dict[str, list[float]]:
        """Seconds per call of each variant, per repetition; the order alternates every repetition."""
        for fn in variants.values():
            for _ in range(warmup):
                fn()
        self.sync()
        times: dict[str, list[float]] = {name: [] for name in variants}
        items = list(variants.items())
        for rep in range(reps):
            for name, fn in items if rep % 2 == 0 else reversed(items):
                self.sync()
                start = time.perf_counter()
                for _ in range(inner):
                    fn()
                self.sync()
                times[name].append((time.perf_counter() - start) / inner)
        return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> dict:
    """Median and spread of ``a / b`` over repetitions (each pair timed in the same repetition)."""
    per_rep = [x / y for x, y in zip(times[a], times[b], strict=True)]
    return {"median": statistics.median(per_rep), "min": min(per_rep), "max": max(per_rep), "n": len(per_rep)}


def fmt(r: dict) -> str:
    return f"{r['median']:.3f} ({r['min']:.3f}..{r['max']:.3f})"


# ------------------------------------------------------------------------------ 1. training steps


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
) -> dict:
    # Dynamo does not guard on module hooks by default, so two compiled instances of one class, one hooked
    # and one not, would share compiled code: guard on them here, for every variant alike.
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=not compile_):
        return _training_steps(
            model_name, batch, size, device, timer, reps, inner, variants_wanted, compile_, autocast
        )


def _training_steps(model_name, batch, size, device, timer, reps, inner, variants_wanted, compile_, autocast):
    torch.manual_seed(0)
    if model_name == "preact_resnet18":
        base = PreActResNet18(in_channels=3, num_classes=10)
    else:
        base = torchvision.models.get_model(model_name, num_classes=10)
    base = base.to(device).train()
    x = torch.randn(batch, 3, size, size, device=device)
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
        "hook_guards": "torch._dynamo.config.skip_nnmodule_hook_guards=False" if compile_ else None,
        "seconds_per_step": {k: statistics.median(v) for k, v in times.items()},
        "vs_none": {k: ratio(times, k, "none") for k in times if k != "none"},
    }
    if "hand_layer2" in times and "mixup_layer2" in times:
        result["mixup_layer2_vs_hand_layer2"] = ratio(times, "mixup_layer2", "hand_layer2")
    return result


# ----------------------------------------------------------------------------------------- 2. peers


def peers(device, timer, reps, inner, batch, size) -> dict:
    torch.manual_seed(0)
    base = PreActResNet18(in_channels=3, num_classes=10).to(device).train()
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


# -------------------------------------------------------------------------------------- 3. dispatch


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
    plain = PreActResNet18(in_channels=3, num_classes=10).to(device).eval()
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


# ----------------------------------------------------------------------------------------- 4. blend


def blend_bandwidth(device, timer, reps, shape) -> dict:
    torch.manual_seed(0)
    h = torch.randn(*shape, device=device, requires_grad=True)
    grad = torch.randn(*shape, device=device)
    index = torch.randperm(shape[0], device=device)
    inverse = inverse_permutation(index)
    lam = torch.tensor(0.3, device=device)
    src, dst = torch.randn(*shape, device=device), torch.empty(*shape, device=device)

    def formula():
        torch.autograd.grad(lam * h + (1 - lam) * h[index], h, grad)

    def mixhook_blend():
        torch.autograd.grad(blend(h, lam, index, inverse), h, grad)  # as the hooks call it

    def lerp():
        torch.autograd.grad(torch.lerp(h[index], h, lam), h, grad)

    def copy_():
        dst.copy_(src)

    times = timer.side_by_side(
        {"formula": formula, "lerp": lerp, "mixhook_blend": mixhook_blend, "copy": copy_},
        reps=reps,
        inner=3,
        warmup=2,
    )
    nbytes = h.numel() * h.element_size()
    # the least traffic a blend forward + backward can do: read h, write out; read grad, write grad_h
    rates = {k: 4 * nbytes / statistics.median(v) / 1e9 for k, v in times.items() if k != "copy"}
    copy_rate = 2 * nbytes / statistics.median(times["copy"]) / 1e9
    return {
        "shape": list(shape),
        "megabytes": nbytes / 1e6,
        "GBps": rates,
        "copy_GBps": copy_rate,
        "fraction_of_copy": {k: v / copy_rate for k, v in rates.items()},
    }


# ------------------------------------------------------------------------------------- 5. recompiles


def recompiles(device, steps, warmup, batch, size, small: bool) -> dict:
    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    torch.manual_seed(0)
    if small:
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.Flatten(),
            nn.LazyLinear(10),
        )
        layers = ["input", "0", "2"]
    else:
        model = PreActResNet18(in_channels=3, num_classes=10)
        layers = ["input", "layer1", "layer2"]
    model = model.to(device).train()
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    model(x)  # materialise lazy modules
    mix = ManifoldMixup(layers, generator=torch.Generator().manual_seed(0))
    mix.attach(model)
    compiled = torch.compile(model, backend=counting_backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    per_step, seen_layers, lams = [], set(), set()
    for _ in range(steps):
        loss = mix.loss(F.cross_entropy, compiled(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        per_step.append(len(graphs))
        seen_layers.add(mix.last.layer)
        lams.add(round(float(mix.last.lam), 6))
    return {
        "model": "small CNN" if small else "preact_resnet18",
        "steps": steps,
        "warmup_steps": warmup,
        "layers": layers,
        "distinct_layers_mixed": len(seen_layers),
        "distinct_lams": len(lams),
        "graphs_compiled_total": len(graphs),
        "graphs_compiled_after_warmup": len(graphs) - per_step[warmup - 1],
        "backend": "a counting backend (dynamo tracing and guards as with any backend)",
    }


# ----------------------------------------------------------------------------------------- 6. memory


def memory(device, batch, size) -> dict:
    if device.type != "cuda":
        return {"note": "CUDA only (max_memory_allocated)"}
    torch.manual_seed(0)
    out = {}
    for name, hook in (("none", None), ("mixup_layer2", ManifoldMixup("layer2"))):
        model = PreActResNet18(in_channels=3, num_classes=10).to(device).train()
        if hook:
            hook.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(batch, 3, size, size, device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        for _ in range(2):
            torch.cuda.reset_peak_memory_stats(device)
            logits = model(x)
            loss = hook.loss(F.cross_entropy, logits, y) if hook else F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        out[name] = torch.cuda.max_memory_allocated(device) / 2**20
        del model, opt
    return {"peak_MiB": out, "mixup_vs_none": out["mixup_layer2"] / out["none"], "batch": batch}


# ------------------------------------------------------------------------------------------- report


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def goals(results: dict, device) -> list[dict]:
    rows = []
    eager = results.get("training_step", [])
    compiled = results.get("training_step_compiled", [])

    def add(goal, measured, limit, where, lower_is_better=True):
        ok = measured <= limit if lower_is_better else measured >= limit
        rows.append({"goal": goal, "measured": measured, "limit": limit, "where": where, "met": ok})

    for run in eager:
        tag = f"{run['model']} eager"
        add("mixup_vs_none", run["vs_none"]["mixup_random"]["median"], GOALS["mixup_vs_none"], tag)
        if "mixup_layer2_vs_hand_layer2" in run:
            add("mixup_vs_hand", run["mixup_layer2_vs_hand_layer2"]["median"], GOALS["mixup_vs_hand"], tag)
        if "gradscale_layer3" in run["vs_none"]:
            add(
                "gradscale_vs_none",
                run["vs_none"]["gradscale_layer3"]["median"],
                GOALS["gradscale_vs_none"],
                tag,
            )
    for run in compiled:
        add(
            "compiled_mixup_vs_compiled",
            run["vs_none"]["mixup_random"]["median"],
            GOALS["compiled_mixup_vs_compiled"],
            f"{run['model']} compiled",
        )
    if "dispatch" in results:
        add(
            "inactive_vs_unhooked",
            results["dispatch"]["eval_forward_inactive_vs_unhooked"]["median"],
            GOALS["inactive_vs_unhooked"],
            "preact_resnet18 eval forward",
        )
    if "recompiles" in results:
        rc = results["recompiles"]
        add(
            "recompiles_after_warmup",
            rc["graphs_compiled_after_warmup"],
            0,
            f"{rc['model']}, {rc['steps']} steps",
        )
    if device.type == "cuda" and "blend" in results:
        add(
            "blend_vs_copy_bandwidth",
            results["blend"]["fraction_of_copy"]["mixhook_blend"],
            GOALS["blend_vs_copy_bandwidth"],
            "blend fwd+bwd",
            lower_is_better=False,
        )
    return rows


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [
        f"# mixhook benchmark: {meta['device']}",
        "",
        f"{meta['date']}, torch {meta['torch']}, torchvision {meta['torchvision']}, Python {meta['python']}, "
        f"`{meta['command']}`{' (quick)' if meta['quick'] else ''}.",
        "",
        "Ratios: median (min..max) over alternating repetitions in this run; below 1 is faster.",
        "",
    ]
    lines += [f"- {note}" for note in meta.get("notes", [])] + ([""] if meta.get("notes") else [])
    lines += [
        "## Goals",
        "",
        "| goal | measured | limit | where | met |",
        "| --- | --- | --- | --- | --- |",
    ]
    for g in results["goals"]:
        measured = g["measured"] if isinstance(g["measured"], int) else f"{g['measured']:.3f}"
        lines.append(
            f"| {g['goal']} | {measured} | {g['limit']} | {g['where']} | {'yes' if g['met'] else 'NO'} |"
        )
    for key, title in (
        ("training_step", "Training step, eager"),
        ("training_step_compiled", "Training step, compiled"),
        ("training_step_bf16", "Training step, bf16 autocast"),
    ):
        for run in results.get(key, []):
            lines += [
                "",
                f"## {title}: {run['model']}, batch {run['batch']}, {run['image_size']}x{run['image_size']}",
                "",
            ]
            lines += ["| variant | s/step | vs none |", "| --- | --- | --- |"]
            for name, sec in run["seconds_per_step"].items():
                rel = fmt(run["vs_none"][name]) if name in run["vs_none"] else "1"
                lines.append(f"| {name} | {sec:.4f} | {rel} |")
            if "mixup_layer2_vs_hand_layer2" in run:
                lines += ["", f"mixup_layer2 / hand_layer2: {fmt(run['mixup_layer2_vs_hand_layer2'])}"]
    if "peers" in results:
        p = results["peers"]
        lines += [
            "",
            f"## Peers: input mixup step, {p['model']}, batch {p['batch']}",
            "",
            "| variant | s/step | vs mixhook |",
        ]
        lines += ["| --- | --- | --- |"]
        for name, sec in p["seconds_per_step"].items():
            rel = fmt(p["vs_mixhook_input"][name]) if name in p["vs_mixhook_input"] else "1"
            lines.append(f"| {name} | {sec:.4f} | {rel} |")
        for name, note in p["notes"].items():
            lines.append(f"| {name} | {note} | |")
    if "dispatch" in results:
        d = results["dispatch"]
        lines += ["", "## Dispatch", "", "| module call | µs |", "| --- | --- |"]
        lines += [f"| {k} | {v:.2f} |" for k, v in d["microseconds_per_call"].items()]
        lines += [
            "",
            f"Eval forward with inactive hooks / unhooked: {fmt(d['eval_forward_inactive_vs_unhooked'])}",
        ]
    if "blend" in results:
        b = results["blend"]
        lines += ["", f"## Blend forward + backward, {b['shape']} float32 ({b['megabytes']:.0f} MB)", ""]
        lines += ["| variant | GB/s | of copy |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v:.1f} | {b['fraction_of_copy'][k]:.2f} |" for k, v in b["GBps"].items()]
        lines += [f"| copy (limit) | {b['copy_GBps']:.1f} | 1 |"]
    if "recompiles" in results:
        rc = results["recompiles"]
        lines += [
            "",
            "## Recompiles",
            "",
            f"{rc['model']}, {rc['steps']} compiled training steps, ManifoldMixup over "
            f"{rc['layers']} ({rc['distinct_layers_mixed']} layers and {rc['distinct_lams']} lams drawn): "
            f"{rc['graphs_compiled_total']} graphs compiled, {rc['graphs_compiled_after_warmup']} after the "
            f"{rc['warmup_steps']} warm-up steps.",
        ]
    if "memory" in results:
        lines += ["", "## Memory", "", json.dumps(results["memory"])]
    if results.get("misses"):
        lines += ["", "## Goals missed: by how much and why", ""] + [f"- {m}" for m in results["misses"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (seconds)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--reps", type=int, default=None, help="repetitions per case (>= 5)")
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated subset of {','.join(CASES)} (default: all); the file name gains the subset",
    )
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        parser.error(f"--cases {args.cases!r}: unknown {unknown}; valid: {','.join(CASES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here; use --device cpu")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    reps = args.reps or (5 if args.quick else 9)
    if reps < 5:
        parser.error(f"--reps must be at least 5, got {reps}")
    timer = Timer(device)
    torch.backends.cudnn.benchmark = True
    # Steps per timed repetition: a GPU step of these models takes milliseconds, and one step alone is
    # mostly launch jitter.
    inner = 10 if cuda and not args.quick else 1

    everything = [
        "none",
        "mixup_input",
        "mixup_layer1",
        "mixup_layer2",
        "mixup_layer3",
        "mixup_random",
        "hand_layer2",
        "cutmix_input",
        "gradscale_layer3",
        "inputscale_layer2",
        "fullhook_scale_layer3",
    ]
    if args.quick:
        plan = [
            (
                "preact_resnet18",
                8,
                16,
                ["none", "mixup_random", "mixup_layer2", "hand_layer2", "gradscale_layer3"],
            )
        ]
        compiled_plan, bf16_plan = [], []
    elif cuda:
        plan = [("preact_resnet18", 128, 32, everything), ("resnet50", 128, 32, everything)]
        compiled_plan = [
            ("preact_resnet18", 128, 32, ["none", "mixup_random", "mixup_layer2", "hand_layer2"]),
            ("resnet50", 128, 32, ["none", "mixup_random", "mixup_layer2", "hand_layer2"]),
        ]
        bf16_plan = [("preact_resnet18", 128, 32, ["none", "mixup_random", "mixup_layer2", "hand_layer2"])]
    else:
        plan = [("preact_resnet18", 16, 32, everything), ("resnet50", 16, 32, everything)]
        compiled_plan = [("preact_resnet18", 16, 32, ["none", "mixup_random", "hand_layer2"])]
        bf16_plan = []

    results: dict = {
        "meta": {
            "device": device_name(device),
            "device_type": device.type,
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "python": platform.python_version(),
            "date": datetime.date.today().isoformat(),
            "quick": args.quick,
            "reps": reps,
            "steps_per_rep": inner,
            "command": " ".join(["python benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]),
        }
    }

    def log(msg):
        print(msg, flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    subset = "" if set(cases) == set(CASES) else "-" + "_".join(cases)
    stem = f"{device.type}-{results['meta']['date']}{'-quick' if args.quick else ''}{subset}"
    results["meta"]["cases"] = cases

    def checkpoint():
        # What has run so far, in case the rest is cut off (a device lease ends): the final files replace it.
        (out / f"{stem}.partial.json").write_text(json.dumps(results, indent=2) + "\n")

    if "eager" in cases:
        results["training_step"] = []
        for model_name, batch, size, variants in plan:
            log(f"training step: {model_name} batch {batch} {size}x{size} eager ...")
            results["training_step"].append(
                training_steps(model_name, batch, size, device, timer, reps, inner, variants)
            )
            checkpoint()
    if compiled_plan and "compiled" in cases:
        results["training_step_compiled"] = []
        for model_name, batch, size, variants in compiled_plan:
            log(f"training step: {model_name} batch {batch} compiled (inductor; compiling takes a while) ...")
            results["training_step_compiled"].append(
                training_steps(model_name, batch, size, device, timer, reps, inner, variants, compile_=True)
            )
            checkpoint()
    if bf16_plan and "bf16" in cases:
        log("training step: bf16 autocast ...")
        results["training_step_bf16"] = [
            training_steps(m, b, s, device, timer, reps, inner, v, autocast=True) for m, b, s, v in bf16_plan
        ]
        checkpoint()
    if "peers" in cases:
        log("peers ...")
        results["peers"] = peers(
            device, timer, reps, 1, *((8, 16) if args.quick else ((128, 32) if cuda else (16, 32)))
        )
        checkpoint()
    if "dispatch" in cases:
        log("dispatch ...")
        results["dispatch"] = dispatch(
            device,
            timer,
            reps,
            200 if args.quick else 2000,
            *((8, 16) if args.quick else ((256, 32) if cuda else (32, 32))),
        )
        checkpoint()
    if "blend" in cases:
        log("blend ...")
        shape = (16, 32, 16, 16) if args.quick else ((128, 256, 32, 32) if cuda else (64, 64, 32, 32))
        results["blend"] = blend_bandwidth(device, timer, reps, shape)
        checkpoint()
    if "recompiles" in cases:
        log("recompiles ...")
        results["recompiles"] = recompiles(
            device,
            30 if args.quick else 100,
            10,
            8 if args.quick else 16,
            8 if args.quick else 32,
            small=args.quick,
        )
        checkpoint()
    if "memory" in cases:
        results["memory"] = memory(device, 128, 32)
    results["goals"] = goals(results, device)
    results["misses"] = [
        f"{g['goal']} ({g['where']}): {g['measured']:.3f} against {g['limit']}"
        for g in results["goals"]
        if not g["met"]
    ]

    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(results))
    (out / f"{stem}.partial.json").unlink(missing_ok=True)
    print(markdown(results))
    print(f"wrote {out / stem}.json and .md")
    return results


if __name__ == "__main__":
    main()

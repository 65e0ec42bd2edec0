"""What mixhook's hooks cost: ratios measured side by side in one run.

    python benchmarks/run.py [--device cuda|cpu] [--quick] [--out benchmarks/results]

Every figure is a ratio (or a rate next to its physical limit) measured in the same process: the
variants of a case run in alternating order, repetition after repetition, after a warm-up, and the
median and the spread (min..max) of the per-repetition ratios are reported. Results go to
``<out>/cpu-<date>.json`` and ``.md`` (``cuda-<gpu>-<date>``, e.g. ``cuda-h100-2026-11-23``, on a GPU),
with the device, torch version and settings. Nothing beyond torch, torchvision and numpy is needed (timm
where installed): run it from a checkout with ``PYTHONPATH=.`` on a machine without the app's Hydra.

Cases: 1. training step (forward + backward + SGD) of PreActResNet-18 and torchvision ResNet-50 at CIFAR
size with each hook, against no hook and against the paper's hand-edited forward (eager; compiled; bf16
on CUDA); 2. peers (torchvision's v2.MixUp, timm's Mixup when installed) against
ManifoldMixup("input"); 3. dispatch: microseconds per module call without, with an inactive and with
an active hook, and an eval forward with inactive hooks; host: an active mix's host time, aten ops,
copies and host reads against a minimal hand-written hook's; 4. the blend's forward + backward as GB/s next
to the device's copy bandwidth; 5. recompiles of a compiled model over many steps with changing lam
and layer; 6. memory: what every method keeps between steps, by what it belongs to, and (CUDA) the
peak of its step against no mixing and Manifold Mixup's against the hand-edited forward's; 7. methods:
every mixing method's training step at layer2 of PreActResNet-18 against no mixing and against Manifold
Mixup (the saliency methods with each source); 8. data: images/s of the CIFAR batches made on the device
against per-sample augmentation in DataLoader workers; imagenet: ResNet-50's step at 224x224 against the
imagefolder loader's images/s (and torchvision's decode_jpeg on the device); 9. recipe: Verma et al. 2019's
CIFAR-10 recipe through the app's loop, mixup against none, and its 1,200 epochs projected; 10. llm: a Llama's
training step with NEFTune against HuggingFace's NEFTune and none, with Manifold Mixup against none and a
hand-written blend hook (transformers where installed); 11. augmix: AugMix's views of a batch made by the
hook on the device against timm's data-loader AugMix in one worker (where timm is installed); 12. vit: the
methods that read a ViT's attention (TransMix, MixPro, TL-Align, SMMix) in a training step of timm's
ViT-Tiny against none and CutMix. Each case is a module of ``benchmarks/cases/``;
``timing.py`` times variants side by side, ``report.py`` turns results into goals and Markdown, and
this file is the runner: the plan per device, the order, the files.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.cases as case_modules  # noqa: E402
from benchmarks.cases.augmix import augmix  # noqa: E402
from benchmarks.cases.baseline import baseline  # noqa: E402
from benchmarks.cases.blend import blend_bandwidth  # noqa: E402
from benchmarks.cases.dispatch import dispatch  # noqa: E402
from benchmarks.cases.folders import folder_pipeline  # noqa: E402
from benchmarks.cases.host import host  # noqa: E402
from benchmarks.cases.language_model import language_model  # noqa: E402
from benchmarks.cases.memory import memory  # noqa: E402
from benchmarks.cases.methods import methods  # noqa: E402
from benchmarks.cases.peers import peers  # noqa: E402
from benchmarks.cases.recipe import data_pipelines, recipe  # noqa: E402
from benchmarks.cases.recompiles import recompiles  # noqa: E402
from benchmarks.cases.sftmix import sftmix, sftmix_memory  # noqa: E402
from benchmarks.cases.training_step import VARIANTS, training_steps  # noqa: E402
from benchmarks.cases.vit import vit_methods  # noqa: E402
from benchmarks.report import device_name, device_slug, goals, markdown  # noqa: E402
from benchmarks.timing import Timer  # noqa: E402
from mixhook.app.records import torch_messages_to_log  # noqa: E402

CASES = (
    "eager", "compiled", "bf16", "peers", "methods", "dispatch", "host", "blend", "recompiles", "memory",
    "data", "imagenet", "recipe", "llm", "sftmix", "sftmix_memory", "augmix", "vit",
)  # fmt: skip
OPT_IN = ("baseline",)  # run only when named (it needs --baseline)


def main(argv=None) -> dict:
    parser, args, cases = _arguments(argv)
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
    case_modules.PREACT_WIDTH = 0.25 if args.quick else 1.0

    plans = _plans(args.quick, cuda)
    device_time = cuda or args.device_time

    results: dict = {
        "meta": {
            "device": device_name(device),
            "device_type": device.type,
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "python": platform.python_version(),
            "date": datetime.date.today().isoformat(),
            "quick": args.quick,
            "preact_width": case_modules.PREACT_WIDTH,
            "reps": reps,
            "steps_per_rep": inner,
            "device_time": (
                "the sum of the GPU's kernel durations (torch.profiler, CUPTI)"
                if cuda
                else "the CPU twin: the self time of the aten ops (torch.profiler)"
            )
            if device_time
            else None,
            "command": " ".join(["python benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]),
        }
    }

    def log(msg):
        print(msg, flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    subset = f"-{args.suffix}" if args.suffix else "" if set(cases) == set(CASES) else "-" + "_".join(cases)
    stem = f"{device_slug(device)}-{results['meta']['date']}{'-quick' if args.quick else ''}{subset}"
    results["meta"]["cases"] = cases

    def checkpoint():
        # What has run so far, in case the rest is cut off (a device lease ends): the final files replace it.
        (out / f"{stem}.partial.json").write_text(json.dumps(results, indent=2) + "\n")

    # what torch and Python warn about while the cases run (dynamo, "No CUDA runtime is found") goes to
    # <stem>.log beside the results, and the terminal gets a count
    run = Case(
        device, timer, reps, inner, args.quick, cuda, log, parser, args.baseline, args.methods, device_time
    )
    started = time.monotonic()

    def in_budget(what: str) -> bool:
        """Whether ``what`` may start: always, unless --budget's seconds are spent (then it is named)."""
        if args.budget is None or time.monotonic() - started < args.budget:
            return True
        results["meta"].setdefault("skipped_over_budget", []).append(what)
        log(f"skipped (over --budget {args.budget:g} s): {what}")
        return False

    def timed(what: str, fn: Callable):
        """``fn()``, its seconds kept under ``meta.seconds[what]`` (where a lent GPU's minutes went)."""
        begun = time.monotonic()
        try:
            return fn()
        finally:
            results["meta"].setdefault("seconds", {})[what] = round(time.monotonic() - begun, 1)

    with torch_messages_to_log(out / f"{stem}.log", say=log):
        _training_steps(
            results, cases, plans, device, timer, reps, inner, log, checkpoint, device_time, in_budget, timed
        )
        for case, (key, runner) in RUNNERS.items():
            if case in cases and in_budget(case):
                results[key] = timed(case, functools.partial(runner, run))
                checkpoint()
    results["goals"] = goals(results, device)
    results["misses"] = [
        f"{g['goal']} ({g['where']}): {g['measured']:.3f} against {g['limit']}"
        + (
            ", not resolved: the median's 95% interval "
            f"[{g['interval'][0]:.3f}, {g['interval'][1]:.3f}] holds the limit"
            if g.get("verdict") == "not resolved"
            else ""
        )
        + (f"; {g['why']}" if g.get("why") else "")
        for g in results["goals"]
        if not g["met"]
    ]

    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(results))
    (out / f"{stem}.partial.json").unlink(missing_ok=True)
    print(markdown(results))
    print(f"wrote {out / stem}.json and .md")
    return results


@dataclass
class Case:
    """What each case's runner is given: the device and timer, the repetitions, the steps per repetition,
    whether the run is quick and on CUDA, where to log, the parser (for a one-line error) and the
    baseline revision."""

    device: torch.device
    timer: Timer
    reps: int
    inner: int
    quick: bool
    cuda: bool
    log: Callable
    parser: argparse.ArgumentParser
    baseline: str | None
    methods: list[str] | None = None  # --methods: the methods case's subset (with ManifoldMixup)
    device_time: bool = False  # the cases that can: device time too (always on CUDA; --device-time)

    def size(self, quick: tuple, cuda: tuple, cpu: tuple) -> tuple:
        """A case's sizes: the quick run's, a GPU's, a CPU's."""
        return quick if self.quick else cuda if self.cuda else cpu


def _augmix(c: Case) -> dict:
    c.log("AugMix: the hook's views against timm's loader AugMix ...")
    return augmix(c.device, c.timer, c.reps, *c.size((8, 16), (128, 32), (32, 32)))


def _vit(c: Case) -> dict:
    c.log("ViT: the attention methods' training step ...")
    sizes = c.size((4, 32, 2), (128, 32, 12), (16, 32, 6))  # batch, image side (MixPro: 2x2 cells), blocks
    return vit_methods(c.device, c.timer, c.reps, c.inner, *sizes)


def _peers(c: Case) -> dict:
    c.log("peers ...")
    sizes = c.size((8, 16), (128, 32), (16, 32))
    return peers(c.device, c.timer, c.reps, c.inner, *sizes, device_time=c.device_time)


def _methods(c: Case) -> dict:
    c.log("methods ...")
    wanted = ["ManifoldMixup", "CutMix", "SaliencyMix", "SaliencyMix_gradient"] if c.quick else None
    if c.methods:
        wanted = ["ManifoldMixup", *c.methods]
    return methods(c.device, c.timer, c.reps, c.inner, *c.size((8, 32), (128, 32), (16, 32)), wanted=wanted)


def _dispatch(c: Case) -> dict:
    c.log("dispatch ...")
    calls = 200 if c.quick else 2000
    return dispatch(c.device, c.timer, c.reps, calls, *c.size((8, 16), (256, 32), (32, 32)))


def _host(c: Case) -> dict:
    c.log("host cost against a hand-written hook ...")
    return host(c.device, c.timer, 5 if c.quick else 21, 50 if c.quick else 400)


def _baseline(c: Case) -> dict:
    c.log(f"this checkout against {c.baseline} ...")
    calls = 200 if c.quick else 2000
    try:
        return baseline(c.device, c.timer, c.reps, c.baseline, calls, *c.size((8, 16), (128, 32), (16, 32)))
    except ValueError as err:
        c.parser.error(str(err))


def _blend(c: Case) -> dict:
    c.log("blend ...")
    # a GPU: 134 MB, beyond an H200's 50 MB L2 (the 2026-11-26 figure's shape)
    shape = c.size((16, 32, 16, 16), (128, 256, 32, 32), (64, 64, 32, 32))
    return blend_bandwidth(c.device, c.timer, c.reps, shape)


def _recompiles(c: Case) -> dict:
    c.log("recompiles ...")
    steps, layers_batch = (30, (8, 8)) if c.quick else (100, (16, 32))
    return recompiles(c.device, steps, 10, *layers_batch, small=c.quick)


def _memory(c: Case) -> dict:
    """What each method keeps between steps (everywhere), and the peak of its step on CUDA."""
    wanted = ["ManifoldMixup", "CutMix", "PuzzleMix_input", "AutoMix_input"] if c.quick else None
    batch, size = c.size((8, 16), (128, 32), (32, 32))
    return memory(c.device, batch, size, wanted)


def _data(c: Case) -> dict:
    c.log("data pipelines ...")
    images, workers = c.size((500, 0), (50_000, None), (10_000, 2))
    found = data_pipelines(c.device, c.timer, c.reps, images, workers=workers)
    c.log("ImageNet-format folder pipeline ...")
    images, workers = (32, 0) if c.quick else (512, min(8, os.cpu_count() or 1))
    found["imagefolder"] = folder_pipeline(c.timer, c.reps, images, workers)
    return found


def _imagenet(c: Case) -> dict:
    """ResNet-50's training step at 224x224 (channels-last; bf16 autocast on a GPU) with no mix, Manifold
    Mixup at layer2 and the hand-edited one, and CutMix at the input, against what the ``data=imagefolder``
    loader delivers: the images/s a step trains at over one worker's rate is the workers that feed it."""
    c.log("ImageNet scale: ResNet-50 at 224x224 against the imagefolder loader ...")
    batch = c.size((4,), (128,), (8,))[0]
    variants = ["none", "mixup_layer2", "hand_layer2", "cutmix_input"]
    step = training_steps(
        "resnet50", batch, 64 if c.quick else 224, c.device, c.timer, c.reps, c.inner, variants,
        autocast=c.cuda, channels_last=True, device_time=c.device_time,
    )  # fmt: skip
    images, workers = (32, 0) if c.quick else (512, min(8, os.cpu_count() or 1))
    loader = folder_pipeline(c.timer, c.reps, images, workers, device=c.device)
    rates = {k: batch / v for k, v in step["seconds_per_step"].items()}
    per_worker = loader["images_per_second"]["pipeline_one_worker"]
    return {
        "step": step,
        "loader": loader,
        "step_images_per_second": rates,
        "workers_to_feed": {k: v / per_worker for k, v in rates.items()},
    }


def _recipe(c: Case) -> dict:
    c.log("Verma et al. 2019 recipe ...")
    if c.quick:
        return recipe(c.device, c.timer, c.reps, steps=2, batch=8, size=16)
    return recipe(c.device, c.timer, min(c.reps, 5), steps=None if c.cuda else 3)  # (a CPU: a few steps)


def _llm(c: Case) -> dict:
    c.log("language model: NEFTune and Manifold Mixup on a Llama ...")
    return language_model(
        c.device, c.timer, c.reps, c.inner, *c.size((4, 32, 64), (16, 512, 512), (8, 128, 128))
    )


def _sftmix(c: Case) -> dict:
    c.log("SFTMix: its step against a hand-written one, and the scoring ...")
    return sftmix(c.device, c.timer, c.reps, c.inner, *c.size((4, 32, 64), (16, 512, 512), (8, 128, 128)))


def _sftmix_memory(c: Case) -> dict:
    c.log("SFTMix: the peak memory of its step at Llama-3.1-8B's vocabulary ...")
    # (batch, tokens: Llama-3.1-8B's 4 rows of 2,048 on a GPU; a CPU's peaks are a quarter of the tokens)
    return sftmix_memory(c.device, *c.size((4, 64, 64, 4096), (4, 2048), (4, 512)))


# each case after the training steps: its key in the results and its runner, in the order they run
RUNNERS = {
    "peers": ("peers", _peers),
    "methods": ("methods", _methods),
    "dispatch": ("dispatch", _dispatch),
    "host": ("host", _host),
    "baseline": ("baseline", _baseline),
    "blend": ("blend", _blend),
    "recompiles": ("recompiles", _recompiles),
    "memory": ("memory", _memory),
    "data": ("data", _data),
    "imagenet": ("imagenet", _imagenet),
    "recipe": ("recipe", _recipe),
    "llm": ("language_model", _llm),
    "sftmix": ("sftmix", _sftmix),
    "sftmix_memory": ("sftmix_memory", _sftmix_memory),
    "augmix": ("augmix", _augmix),
    "vit": ("vit", _vit),
}


def _training_steps(
    results, cases, plans, device, timer, reps, inner, log, checkpoint, device_time, in_budget, timed
) -> None:
    """The training-step cases (eager, compiled, bf16) of ``plans`` into ``results`` (each with its device
    time where ``device_time``; each started only ``in_budget``, each ``timed``)."""
    plan, compiled_plan, bf16_plan = plans
    measure = functools.partial(
        training_steps, device=device, timer=timer, reps=reps, inner=inner, device_time=device_time
    )
    if "eager" in cases:
        results["training_step"] = []
        for model_name, batch, size, variants, *layout in plan:
            what = f"eager {model_name} b{batch}{' channels-last' if layout else ''}"
            if not in_budget(what):
                continue
            log(f"training step: {model_name} batch {batch} {size}x{size} eager ...")
            run = functools.partial(
                measure, model_name, batch, size, variants_wanted=variants, channels_last=bool(layout)
            )
            results["training_step"].append(timed(what, run))
            checkpoint()
    if compiled_plan and "compiled" in cases:
        results["training_step_compiled"] = []
        for model_name, batch, size, variants in compiled_plan:
            what = f"compiled {model_name} b{batch}"
            if not in_budget(what):
                continue
            log(f"training step: {model_name} batch {batch} compiled (inductor; compiling takes a while)")
            run = functools.partial(measure, model_name, batch, size, variants_wanted=variants, compile_=True)
            results["training_step_compiled"].append(timed(what, run))
            checkpoint()
    if bf16_plan and "bf16" in cases and in_budget("bf16"):
        log("training step: bf16 autocast ...")
        results["training_step_bf16"] = [
            timed(f"bf16 {m} b{b}", functools.partial(measure, m, b, s, variants_wanted=v, autocast=True))
            for m, b, s, v in bf16_plan
        ]
        checkpoint()


def _arguments(argv) -> tuple:
    """The parser, the parsed arguments and the cases to run; bad arguments exit 2 in one line."""
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
        help=f"comma-separated subset of {','.join(CASES + OPT_IN)} (default: all but {','.join(OPT_IN)}); "
        "the file name gains the subset",
    )
    parser.add_argument(
        "--device-time",
        action="store_true",
        help="also the training steps' device time from torch.profiler (always on CUDA; on the CPU its "
        "twin: the aten ops' self time, kernel lists and counts)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds: no case starts after them (those left are named in the results); for a leased GPU",
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated: the methods case measures these (beside ManifoldMixup) instead of all",
    )
    parser.add_argument("--suffix", default=None, help="the results' name ends with it instead of the cases'")
    parser.add_argument(
        "--baseline",
        default=None,
        help="a git revision: the baseline case times this checkout's hot path against that revision's",
    )
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES + OPT_IN]
    if unknown or not cases:
        parser.error(f"--cases {args.cases!r}: unknown {unknown}; valid: {','.join(CASES + OPT_IN)}")
    if args.methods is not None:
        from benchmarks.cases.methods import method_variants

        known = method_variants()
        args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in args.methods if m not in known]
        if unknown or not args.methods:
            parser.error(f"--methods: unknown {unknown}; valid: {','.join(known)}")
    if args.suffix is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", args.suffix):
        parser.error(f"--suffix {args.suffix!r}: letters, digits, '.', '_' and '-' only")
    if args.budget is not None and not args.budget > 0:
        parser.error(f"--budget must be a number of seconds > 0, got {args.budget:g}")
    if ("baseline" in cases) != (args.baseline is not None):
        parser.error("--cases baseline and --baseline REV go together (the revision to compare with)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here; use --device cpu")
    return parser, args, cases


def _plans(quick: bool, cuda: bool) -> tuple[list, list, list]:
    """The training-step runs (model, batch, image size, variants[, channels-last]): eager, compiled, bf16."""
    everything = list(VARIANTS)
    if quick:
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
        key = ["none", "mixup_random", "mixup_layer2", "hand_layer2"]
        plan = [  # issue 72's goals first: eager, channels-last and (below) bf16 on both models
            ("preact_resnet18", 128, 32, everything),
            ("preact_resnet18", 128, 32, key, True),  # channels-last
            ("resnet50", 256, 32, key),
            ("resnet50", 256, 32, key, True),
            ("preact_resnet18", 100, 32, key),  # Verma et al.'s batch
        ]
        compiled_plan = [("preact_resnet18", 128, 32, key), ("resnet50", 128, 32, key)]
        bf16_plan = [("preact_resnet18", 128, 32, key), ("resnet50", 256, 32, key)]
    else:
        plan = [("preact_resnet18", 16, 32, everything), ("resnet50", 16, 32, everything)]
        compiled_plan = [("preact_resnet18", 16, 32, ["none", "mixup_random", "mixup_layer2", "hand_layer2"])]
        bf16_plan = []

    return plan, compiled_plan, bf16_plan


if __name__ == "__main__":
    main()

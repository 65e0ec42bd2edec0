"""Case: baseline: this checkout's hot path against another revision's, side by side in one process.

``python benchmarks/run.py --cases baseline --baseline HEAD~1`` unpacks that revision's library core
(``git archive <rev> mixhook``, without the app) into a temporary folder as the package
``mixhook_baseline`` and times the same calls through both, alternating repetition after repetition: a
module call with an inactive mixer (eval, no gradients), with an active mix (training), a forward and
``loss`` on a Linear (an output with gradients), and a PreActResNet-18 training step with Manifold Mixup at
``layer2``. Absolute times drift on a shared machine; the ratios of one run do not."""

from __future__ import annotations

import atexit
import importlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import cases
from benchmarks.timing import ratio

ROOT = Path(__file__).resolve().parents[2]


def load_baseline(rev: str):
    """The library core at git revision ``rev``, imported as ``mixhook_baseline`` (``ValueError`` for a
    revision git does not know)."""
    folder = Path(tempfile.mkdtemp(prefix="mixhook-baseline-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    archive = folder / "core.tar"
    result = subprocess.run(
        ["git", "archive", "--format=tar", "-o", str(archive), rev, "mixhook"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise ValueError(f"--baseline {rev!r}: git archive failed: {result.stderr.strip()}")
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    shutil.rmtree(folder / "mixhook" / "app", ignore_errors=True)  # the core only: it imports torch alone
    (folder / "mixhook").rename(folder / "mixhook_baseline")
    for source in (folder / "mixhook_baseline").rglob("*.py"):  # its custom operators in a namespace of
        text = source.read_text()  # their own: registered as mixhook::..., they would replace this
        if "mixhook::" in text:  # checkout's, whose compiled graphs would then call the baseline's hosts
            source.write_text(text.replace("mixhook::", "mixhook_baseline::"))
    sys.path.insert(0, str(folder))
    return importlib.import_module("mixhook_baseline")


def baseline(device, timer, reps, rev: str, calls: int, batch: int, size: int) -> dict:
    import mixhook

    libraries = {"this": mixhook, "baseline": load_baseline(rev)}
    x = torch.randn(4, 8, device=device)
    y = torch.randint(0, 4, (4,), device=device)

    def module_call(lib, training):
        model = nn.Sequential(nn.Identity()).to(device).train(training)
        lib.ManifoldMixup("0").attach(model)

        def call():
            with torch.no_grad() if not training else torch.enable_grad():
                for _ in range(calls):
                    model(x)

        return call

    def forward_and_loss(lib):
        model = nn.Sequential(nn.Linear(8, 4)).to(device).train()
        mix = lib.ManifoldMixup("0")
        mix.attach(model)

        def call():
            for _ in range(calls):
                mix.loss(F.cross_entropy, model(x), y)

        return call

    def training_step(lib):
        torch.manual_seed(0)
        model = cases.preact_resnet18().to(device).train()
        mix = lib.ManifoldMixup("layer2")
        mix.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        xb = torch.randn(batch, 3, size, size, device=device)
        yb = torch.randint(0, 10, (batch,), device=device)

        def call():
            loss = mix.loss(F.cross_entropy, model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()

        return call

    rows = {
        "module call, inactive mixer (eval, no gradients)": (lambda lib: module_call(lib, False), calls),
        "module call, active mix": (lambda lib: module_call(lib, True), calls),
        "Linear forward and loss(), active mix": (forward_and_loss, calls),
        f"PreActResNet-18 training step, batch {batch}, ManifoldMixup at layer2": (training_step, 1),
    }
    out = {"baseline": rev, "rows": {}}
    for name, (make, per_call) in rows.items():
        times = timer.side_by_side(
            {key: make(lib) for key, lib in libraries.items()}, reps=reps, inner=1, warmup=2
        )
        out["rows"][name] = {
            "this_us": 1e6 * sorted(times["this"])[len(times["this"]) // 2] / per_call,
            "baseline_us": 1e6 * sorted(times["baseline"])[len(times["baseline"]) // 2] / per_call,
            "this_vs_baseline": ratio(times, "this", "baseline"),
        }
    return out

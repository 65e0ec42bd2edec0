"""Small shared pieces for the tests: models no library code was written for, hook counting, and
running the benchmark script."""

import contextlib
import importlib
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def mlp(seed: int = 0) -> nn.Sequential:
    """Linear(6,16) - ReLU - Linear(16,16) - Tanh - Linear(16,4), float64."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).double()


class SmallCNN(nn.Module):
    """conv(3->8) - ReLU - conv(8->8) - pool - linear: a (B, C, H, W) model of its own."""

    def __init__(self, channels: int = 3, classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.conv2(self.act(self.conv1(x))).mean((2, 3)))


def hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(m._backward_pre_hooks)
        for m in model.modules()
    )


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def grads(model: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# A bare GPU machine has torch, torchvision, timm, transformers, numpy, tqdm and matplotlib, not the app's
# Hydra: the benchmark runs as if these could not be imported.
WITHOUT_APP_DEPENDENCIES = (
    "import sys; sys.modules.update(hydra=None, omegaconf=None, submitit=None, optuna=None)"
)


def fused_off_and_on(monkeypatch, step) -> tuple[list, list]:
    """``step()`` (a training step that returns a gradient) run with ``mixhook.fused`` off, then on, the
    switch turned off again after each: the two gradients, and the fused op's calls (counted by wrapping
    it where ``blend`` finds it)."""
    from mixhook import fused

    calls, real = [], fused.gather_lerp
    monkeypatch.setattr(fused, "gather_lerp", lambda *a: calls.append(a) or real(*a))
    grads = []
    for on in (False, True):
        fused.use(on)
        try:
            grads.append(step())
        finally:
            fused.use(False)
    return grads, calls


def run_bench(*args, cwd=ROOT):
    """``python benchmarks/run.py *args`` where Hydra, OmegaConf, submitit and Optuna cannot be imported:
    the completed process."""
    script = str(ROOT / "benchmarks" / "run.py")
    run = f"{WITHOUT_APP_DEPENDENCIES}; import runpy; sys.argv = [{script!r}, *sys.argv[1:]]; "
    run += f"runpy.run_path({script!r}, run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", run, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


@contextlib.contextmanager
def lightning_ddp():
    """Around an in-process Lightning DDP fit (strategy="ddp" or "ddp_spawn"): Lightning leaves its
    process group and writes MASTER_PORT, LOCAL_RANK, OMP_NUM_THREADS, ... into this process's
    environment; both are undone, so the next test of this worker starts clean (a stale MASTER_PORT made
    the next DDP fit bind a port still in use)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


class Lazy:
    """A module imported at its first use rather than when the test module is collected: every xdist worker
    collects every test module, and lightning (about 5 s) and timm (about 3 s) were imported by both
    although one worker runs their tests. ``timm = Lazy("timm")``, then ``timm.create_model(...)``."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # pytest's collection asks every module attribute for _pytest* and __test__
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


def assert_same_step(first: tuple, second: tuple) -> None:
    """Two runs of one training step, each ``(loss, gradients)``, equal in float64: a plain run and one
    whose forward is recomputed in backward (activation checkpointing)."""
    (a, grads_a), (b, grads_b) = first, second
    torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)


def attending_vit(**kwargs) -> nn.Module:
    """A 3-block timm ViT (float64, training mode) on 16x16 images, a 4x4 grid of 4-pixel patches, whose
    attention is far from uniform: at timm's initialisation every token attends nearly evenly, and what
    the attention weighs (TL-Align's labels, SMMix's scores) would hardly depend on it. ``kwargs``: timm's
    (``class_token=False, global_pool="avg"``)."""
    torch.manual_seed(0)
    model = importlib.import_module("timm").create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=16, patch_size=4, embed_dim=12,
        depth=3, num_heads=2, **kwargs,
    ).double().train()  # fmt: skip
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.normal_(0, 0.6)
    return model


def gen(seed: int = 0) -> torch.Generator:
    """A CPU generator seeded with ``seed``: a pinned draw."""
    return torch.Generator().manual_seed(seed)


def per_sample_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per sample (``reduction="none"``): the criterion ``loss()`` takes."""
    return torch.nn.functional.cross_entropy(logits, y, reduction="none")


def exact(actual, expected, rtol: float = 1e-12, atol: float = 1e-12) -> None:
    """Equal in float64 up to rounding (a file whose computation reorders sums states its own tolerance)."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def one_line(error) -> str:
    """The message of a ``pytest.raises`` error, asserted to be one line."""
    message = str(error.value)
    assert "\n" not in message
    return message


class StemHead(nn.Module):
    """Linear(6, 8) - tanh - Linear(8, 4): a model whose layers ``stem`` and ``head`` a mix can name."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.stem(x)))

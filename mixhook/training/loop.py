"""The training loop: read it top to bottom.

:func:`train` runs the epochs, appends one row per epoch to ``metrics.csv`` and, only once every epoch
has finished, writes ``summary.json`` atomically (a temporary file, then a rename), so a run that dies
never leaves a summary that looks like a success.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from ..mixing import Mixer, smooth_one_hot

log = logging.getLogger("mixhook")

METRICS = ["epoch", "train_loss", "test_loss", "test_acc", "lr", "seconds"]
LOSSES = ("ce", "bce_softmax")


def train_one_epoch(
    model: nn.Module,
    loader,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    mixup: Mixer | None = None,
    desc: str = "train",
    progress_bar: bool = True,
    loss: str = "ce",
) -> float:
    """One pass over ``loader``; returns the mean training loss (the mixed loss when mixing).

    ``loss="ce"``: cross-entropy, mixed by the mixer's ``loss``. ``loss="bce_softmax"``: binary
    cross-entropy between the softmax and the mixer's soft ``targets``, averaged over samples and
    classes, as the Manifold Mixup reference code trains (``nn.BCELoss()(softmax(out), target)``)."""
    model.train()
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = 0
    # disable=None: a bar only where stderr is a terminal, so logs and CI output stay clean
    bar = tqdm(loader, desc=desc, leave=False, disable=None if progress_bar else True, dynamic_ncols=True)
    for x, y in bar:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        if loss == "bce_softmax":
            classes = logits.shape[1]
            soft = mixup.targets(y, classes) if mixup is not None else smooth_one_hot(y, classes)
            value = F.binary_cross_entropy(F.softmax(logits, dim=1), soft.to(logits.dtype))
        else:  # per-sample losses, so that a mixer with one lam per sample (mode="elem") weights each one
            per_sample = (
                mixup.loss(_per_sample_ce, logits, y) if mixup is not None else _per_sample_ce(logits, y)
            )
            value = per_sample.mean()
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        total += value.detach() * y.shape[0]
        count += y.shape[0]
    return float(total) / max(count, 1)


def _per_sample_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target, reduction="none")


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device) -> tuple[float, float]:
    """Mean cross-entropy (test NLL) and accuracy (a fraction) of ``model`` in eval mode."""
    model.eval()
    nll = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros((), device=device, dtype=torch.int64)
    count = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        nll += F.cross_entropy(logits, y, reduction="sum")
        correct += (logits.argmax(1) == y).sum()
        count += y.shape[0]
    return float(nll) / count, int(correct) / count


def train(
    model: nn.Module,
    data,
    optimizer: torch.optim.Optimizer,
    scheduler,
    epochs: int,
    device: torch.device,
    out_dir: str | os.PathLike,
    mixup: Mixer | None = None,
    settings: dict | None = None,
    progress_bar: bool = True,
    loss: str = "ce",
) -> dict:
    """Train for ``epochs`` epochs; write ``metrics.csv`` and ``summary.json`` into ``out_dir``.

    Returns the summary: ``test_acc``, ``test_nll``, ``best_test_acc``, ``best_epoch``, ``epochs``,
    ``seconds``, ``train_loss`` and whatever ``settings`` holds (the mixup settings, seed, ...).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(device)
    start = time.perf_counter()
    best_acc, best_epoch = -1.0, 0
    with open(out_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=METRICS)
        writer.writeheader()
        for epoch in range(1, epochs + 1):
            t0 = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]
            desc = f"epoch {epoch}/{epochs}"
            train_loss = train_one_epoch(
                model, data.train, optimizer, device, mixup, desc, progress_bar=progress_bar, loss=loss
            )
            if not math.isfinite(train_loss):
                raise FloatingPointError(f"the training loss became {train_loss} in epoch {epoch}; stopping")
            if scheduler is not None:
                scheduler.step()
            test_loss, test_acc = evaluate(model, data.test, device)
            row = {
                "epoch": epoch,
                "train_loss": train_loss,
                "test_loss": test_loss,
                "test_acc": test_acc,
                "lr": lr,
                "seconds": time.perf_counter() - t0,
            }
            writer.writerow(row)
            f.flush()
            if test_acc > best_acc:
                best_acc, best_epoch = test_acc, epoch
            log.info(
                "epoch %d/%d  train_loss %.4f  test_loss %.4f  test_acc %.2f%%  lr %.4g  %.1fs",
                epoch, epochs, train_loss, test_loss, 100 * test_acc, lr, row["seconds"],
            )  # fmt: skip
    summary = {
        "test_acc": test_acc,
        "test_nll": test_loss,
        "best_test_acc": best_acc,
        "best_epoch": best_epoch,
        "train_loss": train_loss,
        "epochs": epochs,
        "seconds": time.perf_counter() - start,
        **(settings or {}),
    }
    write_json_atomic(out_dir / "summary.json", summary)
    return summary


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as JSON to a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

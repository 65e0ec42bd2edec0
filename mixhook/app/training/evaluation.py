"""The test set's figures: :func:`evaluate` (classification: NLL, accuracy, calibration, each class's
accuracy) and :func:`evaluate_regression` (the mean squared error), in eval mode, over every rank's
shard."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mixhook.sharding import sharded

from .calibration import Calibration
from .distributed import Dist
from .forward import PRECISIONS, forward, per_sample_se


class Evaluation(NamedTuple):
    """The test figures of one evaluation: mean cross-entropy (NLL), accuracy (a fraction), the top-1
    confidence calibration (:class:`~mixhook.app.training.calibration.Calibration`, 15 bins) and each
    class's accuracy (its recall; NaN for a class the test set lacks)."""

    nll: float
    acc: float
    calibration: Calibration
    per_class: tuple[float, ...] = ()

    @property
    def balanced_acc(self) -> float:
        """The mean of the accuracies of the classes in the test set (balanced accuracy, as scikit-learn's
        ``balanced_accuracy_score``)."""
        present = [a for a in self.per_class if not math.isnan(a)]
        return sum(present) / len(present) if present else math.nan


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader,
    device: torch.device,
    precision: str = "32",
    channels_last: bool = False,
    dist: Dist | None = None,
) -> Evaluation:
    """Test NLL, accuracy and calibration of ``model`` in eval mode; with ``dist``, over the union of
    the ranks' shards."""
    dtype = PRECISIONS[precision]
    model.eval()
    nll = torch.zeros((), device=device, dtype=torch.float64)
    calibration = Calibration()  # its bins count the samples and the correct top-1 predictions
    seen = hits = None  # per class: the test samples and the correct ones
    for x, y in _batches(loader, model, dist):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        _, logits = forward(model, x, dtype, channels_last)
        if len(y):
            nll += F.cross_entropy(logits, y, reduction="sum")
            calibration.update(logits, y)
            k = logits.shape[1]
            if seen is None:
                seen = torch.zeros(k, device=device, dtype=torch.float64)
                hits = torch.zeros(k, device=device, dtype=torch.float64)
            seen += torch.bincount(y, minlength=k)[:k]
            hits += torch.bincount(y, weights=(logits.argmax(1) == y).double(), minlength=k)[:k]
    per = [] if seen is None else [*seen.tolist(), *hits.tolist()]
    nll, *per = (dist or Dist()).sum([float(nll), *per])
    calibration.reduce(dist or Dist())
    count, correct = int(calibration.count.sum()), round(float(calibration.correct.sum()))
    k = len(per) // 2
    per_class = tuple(h / n if n else math.nan for n, h in zip(per[:k], per[k:], strict=True))
    return Evaluation(nll / count, correct / count, calibration, per_class)


@torch.no_grad()
def evaluate_regression(
    model: nn.Module,
    loader,
    device: torch.device,
    precision: str = "32",
    dist: Dist | None = None,
) -> float:
    """The test mean squared error of ``model``'s one output in eval mode (in the standardised target's
    units); with ``dist``, over the union of the ranks' shards."""
    dtype = PRECISIONS[precision]
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = 0
    for x, y in _batches(loader, model, dist):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        _, output = forward(model, x, dtype, False)
        total += per_sample_se(output, y).sum()
        count += y.shape[0]
    total, count = (dist or Dist()).sum([float(total), float(count)])
    return total / count


def _batches(loader, model: nn.Module, dist: Dist | None):
    """``loader``'s batches; for a model sharded over the ranks (``trainer.strategy=fsdp``), then as many
    empty ones (the last batch's first zero rows) as another rank has more: a sharded model's forward takes
    every rank, and the ranks' shards of the test set may differ by a batch."""
    dist = dist or Dist()
    if not (dist.enabled and sharded(model)):
        yield from loader
        return
    most, empty = dist.max(len(loader)), None
    for x, y in loader:
        empty = x[:0], y[:0]
        yield x, y
    if most > len(loader) and empty is None:
        raise RuntimeError(
            f"rank {dist.rank} has no test batch while another has {most}: the test set is smaller than "
            "the number of processes"
        )
    for _ in range(most - len(loader)):
        yield empty

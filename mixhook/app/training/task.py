"""What a run learns, decided once: its :class:`Task`, made from the data when the run is made
(:func:`task_for`), owns everything that differs between classification and regression: the training
loss, what a training step counts besides it, the test set's evaluation, ``metrics.csv``'s columns, the
score the best epoch and a sweep maximise, the epoch's log line and the run's summary. The loop never
asks which task it runs, as HuggingFace's sequence-classification heads read ``config.problem_type`` in
one place to pick the loss.

:class:`Classification` (``trainer.loss``: cross-entropy or the BCE of the softmax; a long-tailed
training set adds the balanced accuracy to the epoch line) and :class:`Regression` (the squared error of
one output, RMSE in the target's units).
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mixhook.mixers import MixingHook, smooth_one_hot

from ..errors import ConfigError
from ..files import write_json_atomic
from . import evaluation
from .distributed import Dist
from .forward import per_sample_se
from .state import RunState, Totals

log = logging.getLogger("mixhook")

LOSSES = ("ce", "bce_softmax")


class Task(ABC):
    """What the loop asks of a run's task (:class:`Classification`, :class:`Regression`).

    ``columns``: ``metrics.csv``'s columns. :meth:`training_loss` is one step's loss under the mix of the
    forward that produced ``logits``; :meth:`tally` adds what the step counts besides its loss to the
    epoch's :class:`~mixhook.app.training.state.Totals`; :meth:`evaluate` puts an epoch's test figures
    (and its training accuracy, where the task has one) into its row and returns what the summary needs
    of the last evaluation; :meth:`score` is the figure the best epoch and a sweep maximise, of a row or a
    summary; :meth:`log_epoch` and :meth:`log_done` are the epoch's and the run's lines in the log;
    :meth:`summary` writes ``summary.json``."""

    columns: list[str]

    @abstractmethod
    def training_loss(self, logits: torch.Tensor, y: torch.Tensor, mixup: MixingHook | None) -> torch.Tensor:
        """One step's training loss (before ``trainer.mixed_loss_weight``)."""

    @abstractmethod
    def tally(self, totals: Totals, logits: torch.Tensor, y: torch.Tensor, mixup: MixingHook | None) -> None:
        """What one training step counts besides its loss, into the epoch's ``totals``."""

    @abstractmethod
    def evaluate(self, row: dict, net, data, device, opts, dist: Dist, train_acc: float):
        """``net`` evaluated on ``data``'s test set into ``row``; what the summary needs of it."""

    @abstractmethod
    def score(self, figures: dict) -> float:
        """The figure to maximise, of a ``metrics.csv`` row or a summary."""

    @abstractmethod
    def log_epoch(self, row: dict, epochs: int) -> None:
        """The epoch's line in the log, from its ``metrics.csv`` row."""

    @abstractmethod
    def summary(self, run, state: RunState, out_dir: Path, net, found, start: float, dist: Dist) -> dict:
        """The run's summary (``found``: what the last :meth:`evaluate` returned; ``start``: when the run
        began, by ``perf_counter``, less the time of the part before a resume), written atomically to
        ``summary.json`` by rank 0."""

    @abstractmethod
    def log_done(self, summary: dict, out_dir) -> None:
        """The run's last line in the log, from its summary."""


@dataclass
class Classification(Task):
    """Classification (``Data.task="classification"``) into ``num_classes`` classes.

    ``loss="ce"``: cross-entropy, mixed by the mixer's ``loss`` (per-sample losses, so that a mixer with
    one lam per sample, ``mode="elem"``, weights each one). ``loss="bce_softmax"``: binary cross-entropy
    between the softmax and the mixer's soft ``targets``, averaged over samples and classes, as the
    Manifold Mixup reference code trains (``nn.BCELoss()(softmax(out), target)``). A training step counts
    its lam-weighted correct predictions (a mixed sample counts lam for its own label, 1 - lam for its
    partner's: ``train_acc``). ``long_tailed``: the epoch lines show the balanced accuracy beside the
    accuracy (:func:`_long_tailed`)."""

    loss: str = "ce"  # one of LOSSES
    num_classes: int = 0
    long_tailed: bool = False
    # metrics.csv's columns, then test_acc_c0, test_acc_c1, ...: train_acc is the lam-weighted accuracy of
    # the training forwards (a mixed sample counts lam for its own label, 1 - lam for its partner's)
    COLUMNS = [
        "epoch", "train_loss", "train_acc", "test_loss", "test_acc", "test_ece", "lr", "seconds",
        "test_balanced_acc",  # the mean of the classes' accuracies
    ]  # fmt: skip

    @classmethod
    def of(cls, data, loss: str = "ce") -> Classification:
        return cls(loss, data.num_classes, _long_tailed(data))

    @property
    def columns(self) -> list[str]:
        """``metrics.csv``'s columns: :attr:`COLUMNS`, then each class's test accuracy (``test_acc_c0``,
        ``test_acc_c1``, ...)."""
        return self.COLUMNS + [f"test_acc_c{c}" for c in range(self.num_classes)]

    def training_loss(self, logits: torch.Tensor, y: torch.Tensor, mixup: MixingHook | None) -> torch.Tensor:
        if self.loss == "bce_softmax":
            classes = logits.shape[1]
            soft = (  # in the logits' dtype (the autocast one must not change it)
                mixup.targets(y, classes, dtype=logits.dtype, logits=logits)
                if mixup is not None
                else smooth_one_hot(y, classes, dtype=logits.dtype)
            )
            return F.binary_cross_entropy(F.softmax(logits, dim=1), soft)
        # per-sample losses, so that a mixer with one lam per sample (mode="elem") weights each one
        per_sample = mixup.loss(_per_sample_ce, logits, y) if mixup is not None else _per_sample_ce(logits, y)
        return per_sample.mean()

    def tally(self, totals: Totals, logits: torch.Tensor, y: torch.Tensor, mixup: MixingHook | None) -> None:
        """The step's lam-weighted correct predictions (``Mixer.weigh``) and its rows."""
        correct = mixup.weigh(_correct, logits, y) if mixup is not None else _correct(logits, y)
        totals.correct += correct.detach().sum()
        totals.rows += correct.shape[0]

    def evaluate(self, row: dict, net, data, device, opts, dist: Dist, train_acc: float):
        """Evaluate ``net`` on the test set into ``row``, with ``train_acc``; its calibration (what the
        summary draws)."""
        found = evaluation.evaluate(net, data.test, device, opts.precision, opts.channels_last, dist)
        row.update(
            train_acc=train_acc,
            test_loss=found.nll,
            test_acc=found.acc,
            test_ece=found.calibration.ece(),
            test_balanced_acc=found.balanced_acc,
            **{f"test_acc_c{c}": acc for c, acc in enumerate(found.per_class)},
        )
        return found.calibration

    def score(self, figures: dict) -> float:
        """The test accuracy."""
        return figures["test_acc"]

    def log_epoch(self, row: dict, epochs: int) -> None:
        """The epoch's line in the log: its ``metrics.csv`` row (long-tailed: with the balanced accuracy)."""
        log.info(
            "epoch %d/%d  train_loss %.4f  train_acc %.2f%%  test_loss %.4f  test_acc %.2f%%  %s"
            "test_ece %.2f%%  lr %.4g  %.1fs", row["epoch"], epochs, row["train_loss"],
            100 * row["train_acc"], row["test_loss"], 100 * row["test_acc"],
            f"test_balanced_acc {100 * row['test_balanced_acc']:.2f}%  " if self.long_tailed else "",
            100 * row["test_ece"], row["lr"], row["seconds"],
        )  # fmt: skip

    def summary(self, run, state: RunState, out_dir: Path, net, found, start: float, dist: Dist) -> dict:
        """The run's summary from its last epoch's row and ``found``, the last evaluation's calibration
        (``None``: resumed after the last epoch, evaluated again); written by rank 0 after the
        reliability diagram (a summary.json means the run's files are all there)."""
        last = state.rows[-1]
        calibration = found
        if calibration is None:  # resumed after the last epoch: the same model evaluates to the same figures
            opts = run.settings
            calibration = evaluation.evaluate(
                net, run.data.test, run.device, opts.precision, opts.channels_last, dist
            ).calibration
        summary = {
            "task": "classification",
            "test_acc": last["test_acc"],
            "test_nll": last["test_loss"],
            "test_ece": calibration.ece(),
            "test_balanced_acc": last.get("test_balanced_acc"),
            "test_class_acc": [last.get(f"test_acc_c{c}") for c in range(self.num_classes)],
            "best_test_acc": state.best[0],
            "best_epoch": state.best[1],
            "train_loss": last["train_loss"],
            "train_acc": last.get("train_acc"),
            "epochs": run.settings.epochs,
            "seconds": time.perf_counter() - start,
            "calibration": calibration.table(),
            **run.summary,
        }
        if dist.main:  # the picture first: a summary.json means the run's files are all there
            calibration.plot(out_dir / "reliability.png", f"test set, epoch {run.settings.epochs}")
            write_json_atomic(out_dir / "summary.json", summary)
        return summary

    def log_done(self, summary: dict, out_dir) -> None:
        log.info(
            "done: test_acc %.2f%%  best %.2f%% (epoch %d)  test_nll %.4f  test_ece %.2f%%  %.0fs  "
            "-> %s/summary.json",
            100 * summary["test_acc"], 100 * summary["best_test_acc"], summary["best_epoch"],
            summary["test_nll"], 100 * summary["test_ece"], summary["seconds"], out_dir,
        )  # fmt: skip


@dataclass
class Regression(Task):
    """Regression (``Data.task="regression"``): the squared error of the model's one output, mixed by the
    mixer's ``loss`` (``lam * (p - y)^2 + (1 - lam) * (p - y[index])^2``, whose gradient is that of the
    squared error to the mixed label; ``trainer.loss`` must be ``"ce"``, which it then stands for), tested
    by the mean squared error and the RMSE in the target's own units (``target_scale``: the std the
    targets were divided by). The best epoch has the lowest RMSE; there is no calibration."""

    target_scale: float = 1.0
    columns = ["epoch", "train_loss", "test_loss", "test_rmse", "lr", "seconds"]  # test_rmse: target's units

    @classmethod
    def of(cls, data, loss: str = "ce") -> Regression:
        if loss != "ce":
            raise ConfigError(
                f"trainer.loss={loss} trains on class probabilities, but data={data.name} is a regression "
                "task (trained with the squared error); use trainer.loss=ce"
            )
        return cls(data.target_scale)

    def training_loss(self, logits: torch.Tensor, y: torch.Tensor, mixup: MixingHook | None) -> torch.Tensor:
        per_sample = mixup.loss(per_sample_se, logits, y) if mixup is not None else per_sample_se(logits, y)
        return per_sample.mean()

    def tally(self, totals: Totals, logits: torch.Tensor, y: torch.Tensor, mixup: MixingHook | None) -> None:
        """Nothing: a regression step counts its loss alone."""

    def evaluate(self, row: dict, net, data, device, opts, dist: Dist, train_acc: float):
        """Evaluate ``net`` on the test set into ``row`` (its MSE and RMSE); nothing for the summary."""
        test_loss = evaluation.evaluate_regression(net, data.test, device, opts.precision, dist)
        row.update(test_loss=test_loss, test_rmse=math.sqrt(test_loss) * self.target_scale)
        return None

    def score(self, figures: dict) -> float:
        """Minus the test RMSE (so that maximising it still means better)."""
        return -figures["test_rmse"]

    def log_epoch(self, row: dict, epochs: int) -> None:
        log.info(
            "epoch %d/%d  train_loss %.4f  test_mse %.4f  test_rmse %.3f  lr %.4g  %.1fs",
            row["epoch"], epochs, row["train_loss"], row["test_loss"], row["test_rmse"], row["lr"],
            row["seconds"],
        )  # fmt: skip

    def summary(self, run, state: RunState, out_dir: Path, net, found, start: float, dist: Dist) -> dict:
        """The run's summary from its last epoch's row, written by rank 0."""
        last = state.rows[-1]
        summary = {
            "task": "regression",
            "test_rmse": last["test_rmse"],
            "test_mse": last["test_loss"],
            "best_test_rmse": -state.best[0],
            "best_epoch": state.best[1],
            "train_loss": last["train_loss"],
            "epochs": run.settings.epochs,
            "seconds": time.perf_counter() - start,
            **run.summary,
        }
        if dist.main:
            write_json_atomic(out_dir / "summary.json", summary)
        return summary

    def log_done(self, summary: dict, out_dir) -> None:
        log.info(
            "done: test_rmse %.3f  best %.3f (epoch %d)  %.0fs  -> %s/summary.json", summary["test_rmse"],
            summary["best_test_rmse"], summary["best_epoch"], summary["seconds"], out_dir,
        )  # fmt: skip


TASKS = {"classification": Classification, "regression": Regression}  # Data.task -> its Task


def task_for(data, loss: str = "ce") -> Task:
    """The task of ``data`` (its ``task``: ``"classification"``, the default, or ``"regression"``), trained
    with ``loss`` (``trainer.loss``, one of :data:`LOSSES`)."""
    return TASKS[getattr(data, "task", "classification")].of(data, loss)


def _long_tailed(data) -> bool:
    """Whether the training set's largest class has at least twice the images of its smallest (a
    ``data.imbalance_ratio`` run): its epoch lines show the balanced accuracy beside the accuracy."""
    counts = getattr(data, "class_counts", None)
    return bool(counts) and max(counts) >= 2 * max(min(counts), 1)


def _per_sample_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target, reduction="none")


def _correct(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1.0 where the top class is the label, else 0.0 (float64, one per row)."""
    return (logits.argmax(1) == target).to(torch.float64)

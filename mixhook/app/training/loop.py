"""The training loop: read it top to bottom.

:func:`train` runs the epochs, appends one row per epoch to ``metrics.csv``, keeps ``last.pt`` (see
:mod:`mixhook.app.training.checkpoint`) at the end of every epoch and every ``checkpoint_every`` steps, and,
only once every epoch has finished, writes ``summary.json`` atomically (a temporary file, then a
rename), so a run that dies never leaves a summary that looks like a success.

It stops early, keeping the last good checkpoint, in two cases: SIGTERM or SIGINT (what SLURM, submitit
and Ctrl-C send), after finishing the current step and writing a checkpoint (:class:`Interrupted`);
and a non-finite loss, before that step updates anything, naming the first layer whose output is
non-finite (:class:`NonFiniteLoss`).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from mixhook.mixers import MixingHook, smooth_one_hot
from mixhook.sharding import sharded

from ..files import atomic_write
from . import checkpoint as ckpt
from .calibration import Calibration
from .distributed import Dist
from .finite import FiniteCheck, NonFiniteLoss, check_every
from .logging import save_feature_maps
from .state import RunState
from .warmup import Warmup

log = logging.getLogger("mixhook")

# metrics.csv's columns per task (Data.task): train_acc is the lam-weighted accuracy of the training
# forwards (a mixed sample counts lam for its own label, 1 - lam for its partner's), test_rmse the RMSE in
# the target's own units
METRICS = {
    "classification": [
        "epoch", "train_loss", "train_acc", "test_loss", "test_acc", "test_ece", "lr", "seconds",
        "test_balanced_acc",  # the mean of the classes' accuracies; then test_acc_c0, test_acc_c1, ...
    ],
    "regression": ["epoch", "train_loss", "test_loss", "test_rmse", "lr", "seconds"],
}  # fmt: skip
TASKS = tuple(METRICS)
LOSSES = ("ce", "bce_softmax")
PRECISIONS = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # autocast dtype per setting


class Interrupted(RuntimeError):
    """SIGTERM/SIGINT arrived: the step finished, the checkpoint was written, the run stops."""

    def __init__(self, signum: int, path: Path, epoch: int, step: int):
        self.signum, self.path, self.epoch, self.step = signum, path, epoch, step
        where = f"in epoch {epoch} after step {step}" if step else f"at the end of epoch {epoch}"
        super().__init__(
            f"stopped by {signal.Signals(signum).name} {where}; checkpoint "
            f"written to {path}; continue with trainer.resume=auto (same run directory) or "
            f"trainer.resume={path}"
        )


def _zero() -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64)


@dataclass
class Totals:
    """An epoch's running sums over its training steps, carried over from a checkpoint in a resumed
    epoch: ``loss`` each step's loss times its batch size, summed, and ``samples`` how many; ``correct``
    the lam-weighted correct predictions of the training forwards (classification: ``Mixer.weigh``) and
    ``rows`` how many rows they had; ``steps`` the steps taken. The sums are float64 tensors on the
    training device (adding to them needs no host sync); a checkpoint holds them as the list
    :meth:`saved` gives (``[loss, samples, steps, correct, rows]``)."""

    loss: torch.Tensor = field(default_factory=_zero)
    samples: int = 0
    steps: int = 0
    correct: torch.Tensor = field(default_factory=_zero)
    rows: int = 0

    @classmethod
    def restored(cls, saved: list) -> Totals:
        """From a checkpoint's list (one written before the accuracy was counted has three entries: its
        accuracy counts from here)."""
        totals = cls(saved[0].clone(), int(saved[1]), int(saved[2]))
        if len(saved) >= 5:
            totals.correct, totals.rows = saved[3].clone(), int(saved[4])
        return totals

    def saved(self) -> list:
        """What a checkpoint holds: ``[loss, samples, steps, correct, rows]``, the sums on the CPU."""
        return [self.loss.detach().cpu(), self.samples, self.steps, self.correct.detach().cpu(), self.rows]


@dataclass
class Training:
    """What every training step of a run uses, the same from step to step: :func:`train_one_epoch` takes
    it with the epoch's own things (its loader, its running totals, what runs around each step).

    ``task="regression"``: the squared error of the model's one output, mixed by the mixer's ``loss``
    (``lam * (p - y)^2 + (1 - lam) * (p - y[index])^2``, whose gradient is that of the squared error to the
    mixed label); ``loss`` must be ``"ce"``, which it then stands for. Classification: ``loss="ce"``:
    cross-entropy, mixed by the mixer's ``loss``. ``loss="bce_softmax"``: binary cross-entropy between
    the softmax and the mixer's soft ``targets``, averaged over samples and classes, as the Manifold Mixup
    reference code trains (``nn.BCELoss()(softmax(out), target)``). ``mixed_loss_weight``: the loss of a
    step whose batch was mixed is multiplied by it (the PatchUp authors' code trains with twice the BCE on
    mixed batches: 2.0 reproduces it); unmixed steps keep 1.

    ``precision``: ``"32"``, or ``"bf16"``/``"fp16"`` for a forward under ``torch.autocast`` (the loss is
    computed in float32 from the logits); ``scaler``: a ``torch.amp.GradScaler`` for fp16;
    ``channels_last``: image batches in NHWC. ``dist``: the data-parallel job this process is part of (a
    single process by default). ``finite`` (a :class:`~mixhook.app.training.finite.FiniteCheck`) says when
    the host looks at the loss (by default before each step's backward). ``progress_bar``: a tqdm bar
    where stderr is a terminal."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    mixup: MixingHook | None = None
    loss: str = "ce"
    task: str = "classification"
    mixed_loss_weight: float = 1.0
    precision: str = "32"
    scaler: object = None
    channels_last: bool = False
    dist: Dist = field(default_factory=Dist)
    finite: FiniteCheck | None = None
    progress_bar: bool = True


def train_one_epoch(
    training: Training,
    loader,
    totals: Totals | None = None,
    desc: str = "train",
    before_step=None,
    after_step=None,
    partners=None,
) -> float:
    """One pass over ``loader`` as ``training`` says; returns the mean training loss (the mixed loss when
    mixing). ``partners``: a loader of as many batches, whose each batch the mixer gets as the step's
    partner batch (``mixup.use_partners``; :meth:`~mixhook.app.data.Data.partner_batches`).

    ``totals``: the :class:`Totals` of the part of the epoch already done (a resumed epoch), updated in
    place (a new one by default). ``before_step(done)`` runs before each step (``done``: the epoch's steps
    already taken; the mix schedule), ``after_step(totals)`` after each. Raises :class:`NonFiniteLoss` for
    a step whose loss is not finite, which is never applied."""
    t = training
    model, optimizer, device, mixup, scaler = t.model, t.optimizer, t.device, t.mixup, t.scaler
    dtype = PRECISIONS[t.precision]
    model.train()
    totals = totals if totals is not None else Totals()
    totals.loss, totals.correct = totals.loss.to(device), totals.correct.to(device)
    # disable=None: a bar only where stderr is a terminal, so logs and CI output stay clean
    bar = tqdm(loader, desc=desc, leave=False, disable=None if t.progress_bar else True, dynamic_ncols=True)
    finite = t.finite or FiniteCheck(dist=t.dist)
    finite.for_epoch(model, mixup, dtype, before_step)
    partner_batches = iter(partners) if partners is not None else None
    for x, y in bar:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        done = totals.steps  # the steps of this epoch already done
        if before_step is not None:
            before_step(done)
        finite.before_forward(done)
        if mixup is not None:
            mixup.use_targets(y)  # for a method that needs the labels to mix (gradient saliency)
        if partner_batches is not None:  # (as many batches as the epoch has: the same sampler's length)
            xp, yp = (t.to(device, non_blocking=True) for t in next(partner_batches))
            if t.channels_last and xp.ndim == 4:
                xp = xp.contiguous(memory_format=torch.channels_last)
            mixup.use_partners(xp, yp)
        x, logits = _forward(model, x, dtype, t.channels_last)
        value = _loss(t, logits, y)
        finite.after_loss(value, x, y, done)  # raises here when the host reads every step
        optimizer.zero_grad(set_to_none=True)
        (value if scaler is None else scaler.scale(value)).backward()
        finite.step(optimizer, scaler)  # skipped on the device after a non-finite loss (lazily)
        totals.loss += value.detach() * y.shape[0]
        totals.samples += y.shape[0]
        totals.steps += 1
        if t.task == "classification":
            correct = mixup.weigh(_correct, logits, y) if mixup is not None else _correct(logits, y)
            totals.correct += correct.detach().sum()
            totals.rows += correct.shape[0]
        if finite.due(totals.steps):
            finite.read()  # the device's flag, lazily (nothing to read when checked every step)
        if after_step is not None:
            after_step(totals)
    finite.read()
    return float(totals.loss) / max(totals.samples, 1)


def _loss(t: Training, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step's training loss, under the mix of the forward that produced ``logits`` (see
    :class:`Training`)."""
    mixup = t.mixup
    if t.task == "regression":
        per_sample = mixup.loss(_per_sample_se, logits, y) if mixup is not None else _per_sample_se(logits, y)
        value = per_sample.mean()
    elif t.loss == "bce_softmax":
        classes = logits.shape[1]
        soft = (  # in the logits' dtype (the autocast one must not change it)
            mixup.targets(y, classes, dtype=logits.dtype, logits=logits)
            if mixup is not None
            else smooth_one_hot(y, classes, dtype=logits.dtype)
        )
        value = F.binary_cross_entropy(F.softmax(logits, dim=1), soft)
    else:  # per-sample losses, so that a mixer with one lam per sample (mode="elem") weights each one
        per_sample = mixup.loss(_per_sample_ce, logits, y) if mixup is not None else _per_sample_ce(logits, y)
        value = per_sample.mean()
    if t.mixed_loss_weight != 1.0 and mixup is not None and mixup.state_for(logits) is not None:
        value = value * t.mixed_loss_weight
    return value


def _forward(
    model: nn.Module, x: torch.Tensor, dtype, channels_last: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch as the model gets it (NHWC when ``channels_last``) and its logits in float32 or wider
    (a float64 model keeps float64), the forward under autocast in ``dtype`` (``None``: none)."""
    if channels_last and x.ndim == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        logits = model(x)
    return x, logits.to(torch.promote_types(logits.dtype, torch.float32))


def _per_sample_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target, reduction="none")


def _per_sample_se(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The squared error of each sample's one output."""
    return (output.squeeze(-1) - target.to(output.dtype)).square()


def _correct(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1.0 where the top class is the label, else 0.0 (float64, one per row)."""
    return (logits.argmax(1) == target).to(torch.float64)


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
        _, logits = _forward(model, x, dtype, channels_last)
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
        _, output = _forward(model, x, dtype, False)
        total += _per_sample_se(output, y).sum()
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


@contextmanager
def stop_signals():
    """Within the block, SIGTERM and SIGINT only set ``flag[0]`` (to the signal number); the loop
    stops at the next step boundary. The previous handlers come back afterwards. Outside the main
    thread (where Python cannot install handlers) nothing is installed."""
    flag = [0]
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        flag[0] = signum

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@dataclass
class Settings:
    """How to train: the ``trainer`` keys the loop reads (ranges checked by the app's schema)."""

    epochs: int
    loss: str = "ce"  # one of LOSSES
    precision: str = "32"  # one of PRECISIONS
    compile: bool = False
    channels_last: bool = False
    progress_bar: bool = True
    checkpoint_every: int = 0
    mixed_loss_weight: float = 1.0  # the loss of a mixed step times this (PatchUp's authors: 2)
    check_finite_every: int | None = None  # host reads of the finite check (finite.check_every)
    warmup_epochs: int = 0  # a linear warm-up of the learning rate over these first epochs (warmup.Warmup)
    warmup_start_factor: float = 1.0  # its first step's rate over the scheduled one


@dataclass
class Run:
    """Everything one run trains with: built and checked by :func:`mixhook.app.build.build`, or by hand.

    ``hooks``: every hook attached to ``model`` (their generators are checkpointed); ``mixup`` the one
    mixing regularizer among them, if any; ``handles``: what their ``attach()`` returned (removing them
    detaches everything). ``summary``: copied into ``summary.json`` (the mixup settings, seed, ...);
    ``config``: saved in the checkpoint for a resuming run to compare with its own.
    ``feature_maps``: ``(layers, batch, labels)`` to draw after every epoch into ``feature_maps/``."""

    model: nn.Module
    data: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    device: torch.device
    settings: Settings
    mixup: MixingHook | None = None
    hooks: list = field(default_factory=list)
    handles: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    config: dict | None = None
    feature_maps: tuple | None = None
    schedule: object = None  # a mixhook.MixSchedule, set before every training step


def train(
    run: Run,
    out_dir: str | os.PathLike,
    resume: dict | None = None,
    dist: Dist | None = None,
    logger=None,
) -> dict:
    """Train ``run`` for ``run.settings.epochs`` epochs; write ``metrics.csv``, ``last.pt`` and
    ``summary.json`` into ``out_dir``.

    ``resume``: a checkpoint from :func:`mixhook.app.training.checkpoint.load`; training continues
    exactly where it was written. ``run.settings``: ``precision`` ``"32"``, ``"bf16"`` or ``"fp16"``
    (autocast; fp16 with a grad scaler); ``compile``: train and evaluate through
    ``torch.compile(model)`` (the hooks, attached before, are compiled with it; the checkpoint holds the
    model's own state); ``channels_last``: model and image batches in NHWC. ``dist``: the data-parallel
    job (see :mod:`mixhook.app.training.distributed`): the model is wrapped in
    ``DistributedDataParallel`` here, after the hooks were attached to it, and only rank 0 writes.
    ``logger``: a :class:`~mixhook.app.training.logging.RunLogger` for probe rows and TensorBoard.

    Returns the summary: ``test_acc``, ``test_nll``, ``test_ece`` (15 bins) and ``calibration`` (the
    reliability diagram's numbers, also drawn into ``reliability.png``) of the last epoch,
    ``best_test_acc``, ``best_epoch``, ``epochs``, ``seconds``, ``train_loss``, ``train_acc`` and whatever
    ``run.summary`` holds. For a regression task (``run.data.task``): ``test_rmse`` (in the target's
    units), ``test_mse`` (standardised), ``best_test_rmse``, ``best_epoch`` (the lowest RMSE) and the
    rest, without calibration.
    """
    data, optimizer, opts = run.data, run.optimizer, run.settings
    regression = getattr(data, "task", "classification") == "regression"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dist = dist or Dist()
    net = _network(run.model, run.device, opts, dist)
    scaler = torch.amp.GradScaler(run.device.type) if opts.precision == "fp16" else None
    finite = FiniteCheck(check_every(opts.check_finite_every, optimizer, run.device), optimizer, dist)
    if finite.lazy:
        log.info(
            "the loss is checked on the device, read every %d steps (trainer.check_finite_every)",
            finite.every,
        )
    state = RunState()
    if resume is not None:
        state = RunState.restore(resume, run, scaler, dist)
        log.info("resuming after epoch %d, step %d of the next", state.epoch, state.step)
    saves = Checkpoints(run, state, out_dir / ckpt.FILE, scaler, dist, logger)
    training = Training(
        net, optimizer, run.device, run.mixup, loss=opts.loss, task=getattr(data, "task", "classification"),
        mixed_loss_weight=opts.mixed_loss_weight, precision=opts.precision, scaler=scaler,
        channels_last=opts.channels_last, dist=dist, finite=finite, progress_bar=opts.progress_bar,
    )  # fmt: skip
    calibration = None
    metrics_file = out_dir / "metrics.csv" if dist.main else os.devnull  # only rank 0 writes
    with open(metrics_file, "w", newline="") as f, stop_signals() as stop:
        writer = csv.DictWriter(
            f, fieldnames=metric_columns(training.task, data.num_classes), extrasaction="ignore"
        )
        writer.writeheader()
        writer.writerows(state.rows)  # the epochs before the checkpoint (none when starting)
        f.flush()
        epoch_steps = EpochSteps(run, state, finite, saves, dist, stop)
        for epoch in range(state.epoch + 1, opts.epochs + 1):
            t0 = time.perf_counter()
            lr = epoch_steps.start(epoch)  # (the rate of its first step)
            train_loss, train_acc = epoch_steps.train(training, epoch)
            row = {"epoch": epoch, "train_loss": train_loss, "lr": lr}
            if run.scheduler is not None:
                run.scheduler.step()
            score, calibration = _tested(
                row, net, data, run.device, opts, dist, None if regression else train_acc
            )
            row["seconds"] = time.perf_counter() - t0
            writer.writerow(row)
            f.flush()
            _kept(run, state, row, score, out_dir, logger, dist, saves.probes)
            saves.save(epoch, 0, None)
            if dist.any(bool(stop[0])) and epoch < opts.epochs:
                raise Interrupted(stop[0] or signal.SIGTERM, saves.path, epoch, 0)
    return _summary(run, state, out_dir, net, calibration, saves.start, dist, regression)


class Checkpoints:
    """Where :func:`train` keeps ``last.pt``: :meth:`save` writes the run's state (its model, optimizer,
    random streams, metrics rows and, mid-epoch, the epoch's running sums) after ``epoch_done`` whole
    epochs and ``step`` steps of the next. ``start``: when the run began (``perf_counter``), less the time
    of the part before a resume."""

    def __init__(self, run: Run, state: RunState, path: Path, scaler, dist: Dist, logger):
        self.run, self.state, self.path, self.scaler, self.dist, self.logger = (
            run,
            state,
            path,
            scaler,
            dist,
            logger,
        )
        self.start = time.perf_counter() - state.seconds
        self.probes = [h for h in run.hooks if hasattr(h, "paused")]
        for probe in self.probes:  # probe steps are the run's training steps
            probe.step = state.global_step

    def save(self, epoch_done: int, step: int, totals: Totals | None) -> None:
        state = self.state
        state.epoch, state.step = epoch_done, step
        state.totals = None if totals is None else totals.saved()
        state.seconds = time.perf_counter() - self.start
        state.save(self.path, self.run, self.scaler, self.dist)
        if self.logger is not None and self.dist.main:
            self.logger.probe_rows(epoch_done + (1 if step else 0))


class EpochSteps:
    """The training steps of one epoch of :func:`train`, and what runs around each: the mix schedule and
    the warm-up before it; after it, the step counted, a stop asked for by a signal (on any rank: a
    checkpoint, then :class:`Interrupted`) and the ``checkpoint_every`` checkpoints."""

    def __init__(
        self, run: Run, state: RunState, finite: FiniteCheck, saves: Checkpoints, dist: Dist, stop: list
    ):
        self.run, self.state, self.finite, self.saves, self.dist = run, state, finite, saves, dist
        self.stop = stop  # (stop_signals(): the signal asked for, if any)
        opts = run.settings
        self.warmup = Warmup(opts.warmup_epochs, opts.warmup_start_factor)  # (0 epochs: a factor of 1)
        self.partners = getattr(
            run.data, "partners", None
        )  # (Data.partner_batches: a partner batch per step)
        self.epoch, self.skip, self.steps = 0, 0, 0

    def start(self, epoch: int) -> float:
        """Set the samplers to ``epoch`` (a resumed epoch from the step it stopped after); the learning
        rate of its first step."""
        state, loader = self.state, self.run.data.train
        self.epoch, self.skip = epoch, state.step if epoch == state.epoch + 1 else 0
        loader.sampler.set_epoch(epoch)
        self.steps = len(loader)  # the whole epoch's steps (a resumed epoch's loader has fewer left)
        loader.sampler.set_epoch(epoch, start=self.skip * loader.batch_size)
        if self.partners is not None:  # (the same steps of its own class-balanced order)
            self.partners.sampler.set_epoch(epoch, start=self.skip * loader.batch_size)
        lr = self.run.optimizer.param_groups[0]["lr"]
        return lr * self.warmup.factor(state.global_step - self.skip, self.steps)

    def train(self, training: Training, epoch: int) -> tuple[float, float]:
        """The epoch's training steps: its mean loss and its lam-weighted accuracy, over every rank's
        samples."""
        totals = Totals.restored(self.state.totals) if self.skip else Totals()
        try:
            train_loss = train_one_epoch(
                training, self.run.data.train, totals, f"epoch {epoch}/{self.run.settings.epochs}",
                before_step=self.before, after_step=self.after, partners=self.partners,
            )  # fmt: skip
        except NonFiniteLoss as err:
            path = self.saves.path
            note = f"the last good checkpoint is {path}" if path.exists() else "no checkpoint yet"
            raise NonFiniteLoss(f"epoch {epoch}, step {err.step}: {err}; {note}", err.step) from None
        correct, rows = float(totals.correct), totals.rows
        if self.dist.enabled:  # the epoch's means over every rank's samples
            loss_sum, count, correct, rows = self.dist.sum(
                [float(totals.loss), float(totals.samples), correct, rows]
            )
            train_loss = loss_sum / max(count, 1)
        return train_loss, correct / max(rows, 1)

    def before(self, done: int) -> None:
        if self.run.schedule is not None:
            self.run.schedule.set(self.epoch, done / self.steps)
        self.warmup.apply(self.run.optimizer, self.state.global_step, self.steps)

    def after(self, totals: Totals) -> None:
        self.warmup.restore(self.run.optimizer)  # (before a checkpoint: it holds the scheduled rate)
        state, finite, stop = self.state, self.finite, self.stop
        state.global_step += 1
        # a signal on any rank stops all of them after this step (asked where the host reads anyway: the
        # question is a collective, a host sync, under DDP)
        if (not self.dist.enabled or finite.due(totals.steps)) and self.dist.any(bool(stop[0])):
            finite.read()  # no checkpoint holds a non-finite step
            self.saves.save(self.epoch - 1, totals.steps, totals)
            raise Interrupted(stop[0] or signal.SIGTERM, self.saves.path, self.epoch, totals.steps)
        every = self.run.settings.checkpoint_every
        if every and state.global_step % every == 0:
            finite.read()
            self.saves.save(self.epoch - 1, totals.steps, totals)


def _kept(
    run: Run, state: RunState, row: dict, score: float, out_dir: Path, logger, dist: Dist, probes
) -> None:
    """An epoch's ``metrics.csv`` row kept: in the run's state, TensorBoard and the log; its feature maps
    drawn (the ``probes`` paused); the best epoch so far."""
    state.rows.append(row)
    if logger is not None:
        logger.epoch(row)
    if run.feature_maps is not None and dist.main:
        folder = out_dir / "feature_maps"
        folder.mkdir(exist_ok=True)
        layers, batch, labels = run.feature_maps
        save_feature_maps(
            run.model, run.mixup, layers, batch.to(run.device), folder / f"epoch{row['epoch']:03d}",
            pause=probes, targets=labels.to(run.device),
        )  # fmt: skip
    if score > state.best[0] or state.best[1] == 0:
        state.best = (score, row["epoch"])
    _log_epoch(row, run.settings.epochs, _long_tailed(run.data))


def metric_columns(task: str, num_classes: int) -> list[str]:
    """``metrics.csv``'s columns: :data:`METRICS` of the task, then, for classification, each class's test
    accuracy (``test_acc_c0``, ``test_acc_c1``, ...)."""
    per_class = [f"test_acc_c{c}" for c in range(num_classes)] if task == "classification" else []
    return METRICS[task] + per_class


def _network(model: nn.Module, device: torch.device, opts: Settings, dist: Dist) -> nn.Module:
    """What the loop calls: ``model`` on ``device`` (channels-last where asked), in
    ``DistributedDataParallel`` for a data-parallel job (after the hooks were attached to ``model``), and
    through ``torch.compile`` where asked."""
    if sharded(model):  # (on its device since it was sharded, its hooks attached)
        return model
    model.to(device, memory_format=torch.channels_last if opts.channels_last else torch.preserve_format)
    net = model
    if dist.enabled:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    return torch.compile(net) if opts.compile else net


def _tested(row: dict, net, data, device, opts: Settings, dist: Dist, train_acc: float | None) -> tuple:
    """Evaluate ``net`` on the test set into ``row`` (and ``train_acc`` for classification; ``None``: a
    regression task): the epoch's score (higher is better; state.best keeps the highest) and its
    calibration (``None`` for regression)."""
    if train_acc is None:
        test_loss = evaluate_regression(net, data.test, device, opts.precision, dist)
        row.update(test_loss=test_loss, test_rmse=math.sqrt(test_loss) * data.target_scale)
        return -row["test_rmse"], None
    found = evaluate(net, data.test, device, opts.precision, opts.channels_last, dist)
    row.update(
        train_acc=train_acc,
        test_loss=found.nll,
        test_acc=found.acc,
        test_ece=found.calibration.ece(),
        test_balanced_acc=found.balanced_acc,
        **{f"test_acc_c{c}": acc for c, acc in enumerate(found.per_class)},
    )
    return found.acc, found.calibration


def _long_tailed(data) -> bool:
    """Whether the training set's largest class has at least twice the images of its smallest (a
    ``data.imbalance_ratio`` run): its epoch lines show the balanced accuracy beside the accuracy."""
    counts = getattr(data, "class_counts", None)
    return bool(counts) and max(counts) >= 2 * max(min(counts), 1)


def _log_epoch(row: dict, epochs: int, balanced: bool = False) -> None:
    """The epoch's line in the log: its ``metrics.csv`` row (``balanced``: with the balanced accuracy)."""
    if "test_rmse" in row:
        log.info(
            "epoch %d/%d  train_loss %.4f  test_mse %.4f  test_rmse %.3f  lr %.4g  %.1fs",
            row["epoch"], epochs, row["train_loss"], row["test_loss"], row["test_rmse"], row["lr"],
            row["seconds"],
        )  # fmt: skip
    else:
        log.info(
            "epoch %d/%d  train_loss %.4f  train_acc %.2f%%  test_loss %.4f  test_acc %.2f%%  %s"
            "test_ece %.2f%%  lr %.4g  %.1fs", row["epoch"], epochs, row["train_loss"],
            100 * row["train_acc"], row["test_loss"], 100 * row["test_acc"],
            f"test_balanced_acc {100 * row['test_balanced_acc']:.2f}%  " if balanced else "",
            100 * row["test_ece"], row["lr"], row["seconds"],
        )  # fmt: skip


def _summary(
    run: Run, state: RunState, out_dir: Path, net, calibration, start: float, dist: Dist, regression: bool
) -> dict:
    """The run's summary from its last epoch's row (``start``: when the run began, by ``perf_counter``,
    less the time of the part before a resume), written atomically to ``summary.json`` by rank 0 (for
    classification after the reliability diagram: a summary.json means the run's files are all there)."""
    last = state.rows[-1]
    if regression:
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
    if calibration is None:  # resumed after the last epoch: the same model evaluates to the same figures
        opts = run.settings
        calibration = evaluate(
            net, run.data.test, run.device, opts.precision, opts.channels_last, dist
        ).calibration
    summary = {
        "test_acc": last["test_acc"],
        "test_nll": last["test_loss"],
        "test_ece": calibration.ece(),
        "test_balanced_acc": last.get("test_balanced_acc"),
        "test_class_acc": [last.get(f"test_acc_c{c}") for c in range(run.data.num_classes)],
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


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (:func:`~mixhook.app.files.atomic_write`)."""
    with atomic_write(path) as f:
        json.dump(obj, f, indent=2)
        f.write("\n")

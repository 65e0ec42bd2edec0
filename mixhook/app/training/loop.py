"""The training loop: read it top to bottom.

:func:`train` runs the epochs, appends one row per epoch to ``metrics.csv``, keeps ``last.pt`` (see
:mod:`mixhook.app.training.checkpoint`) at the end of every epoch and every ``checkpoint_every`` steps, and,
only once every epoch has finished, writes ``summary.json`` atomically (a temporary file, then a
rename), so a run that dies never leaves a summary that looks like a success. What differs between
classification and regression (the loss, the test figures, the columns, the log lines, the summary) is
the run's :class:`~mixhook.app.training.task.Task`'s: the loop never asks which it is.

It stops early, keeping the last good checkpoint, in two cases: SIGTERM or SIGINT (what SLURM, submitit
and Ctrl-C send), after finishing the current step and writing a checkpoint (:class:`Interrupted`);
and a non-finite loss, before that step updates anything, naming the first layer whose output is
non-finite (:class:`NonFiniteLoss`).
"""

from __future__ import annotations

import csv
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from mixhook.mixers import MixingHook
from mixhook.sharding import sharded

from . import checkpoint as ckpt
from .distributed import Dist
from .finite import FiniteCheck, NonFiniteLoss, check_every
from .forward import PRECISIONS, forward
from .logging import save_feature_maps
from .settings import Run, Settings
from .signals import Interrupted, stop_signals
from .state import Checkpoints, RunState, Totals
from .task import Classification, Task
from .warmup import Warmup

log = logging.getLogger("mixhook")


@dataclass
class Training:
    """What every training step of a run uses, the same from step to step: :func:`train_one_epoch` takes
    it with the epoch's own things (its loader, its running totals, what runs around each step).

    ``task``: what each step's loss is and what it counts besides (:class:`~mixhook.app.training.task.Task`;
    by default classification with cross-entropy). ``mixed_loss_weight``: the loss of a step whose batch
    was mixed is multiplied by it (the PatchUp authors' code trains with twice the BCE on mixed batches:
    2.0 reproduces it); unmixed steps keep 1.

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
    task: Task = field(default_factory=Classification)
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
        x, logits = forward(model, x, dtype, t.channels_last)
        value = _loss(t, logits, y)
        finite.after_loss(value, x, y, done)  # raises here when the host reads every step
        optimizer.zero_grad(set_to_none=True)
        (value if scaler is None else scaler.scale(value)).backward()
        finite.step(optimizer, scaler)  # skipped on the device after a non-finite loss (lazily)
        totals.loss += value.detach() * y.shape[0]
        totals.samples += y.shape[0]
        totals.steps += 1
        t.task.tally(totals, logits, y, mixup)  # (classification: the lam-weighted correct predictions)
        if finite.due(totals.steps):
            finite.read()  # the device's flag, lazily (nothing to read when checked every step)
        if after_step is not None:
            after_step(totals)
    finite.read()
    return float(totals.loss) / max(totals.samples, 1)


def _loss(t: Training, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step's training loss, under the mix of the forward that produced ``logits`` (see
    :class:`Training`)."""
    value = t.task.training_loss(logits, y, t.mixup)
    if t.mixed_loss_weight != 1.0 and t.mixup is not None and t.mixup.state_for(logits) is not None:
        value = value * t.mixed_loss_weight
    return value


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

    Returns the summary (``run.task``'s: :class:`~mixhook.app.training.task.Classification`'s
    ``test_acc``, ``test_nll``, ``test_ece`` (15 bins) and ``calibration`` (the reliability diagram's
    numbers, also drawn into ``reliability.png``) of the last epoch, ``best_test_acc``, ``best_epoch``,
    ``epochs``, ``seconds``, ``train_loss``, ``train_acc``; a
    :class:`~mixhook.app.training.task.Regression`'s ``test_rmse`` (in the target's units), ``test_mse``
    (standardised), ``best_test_rmse``, ``best_epoch`` (the lowest RMSE) and the rest, without
    calibration), with whatever ``run.summary`` holds.
    """
    data, optimizer, opts, task = run.data, run.optimizer, run.settings, run.task
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
        net, optimizer, run.device, run.mixup, task=task, mixed_loss_weight=opts.mixed_loss_weight,
        precision=opts.precision, scaler=scaler, channels_last=opts.channels_last, dist=dist, finite=finite,
        progress_bar=opts.progress_bar,
    )  # fmt: skip
    found = None  # what the last evaluation leaves the summary (classification: its calibration)
    metrics_file = out_dir / "metrics.csv" if dist.main else os.devnull  # only rank 0 writes
    with open(metrics_file, "w", newline="") as f, stop_signals() as stop:
        writer = csv.DictWriter(f, fieldnames=task.columns, extrasaction="ignore")
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
            if tested(epoch, opts):
                found = task.evaluate(row, net, data, run.device, opts, dist, train_acc)
            else:  # (trainer.eval_every: the test columns of this epoch's row stay empty)
                row["train_acc"] = train_acc
            row["seconds"] = time.perf_counter() - t0
            writer.writerow(row)
            f.flush()
            _kept(run, state, row, out_dir, logger, dist, saves.probes)
            saves.save(epoch, 0, None)
            if dist.any(bool(stop[0])) and epoch < opts.epochs:
                raise Interrupted(stop[0] or signal.SIGTERM, saves.path, epoch, 0)
    return task.summary(run, state, out_dir, net, found, saves.start, dist)


def tested(epoch: int, opts: Settings) -> bool:
    """Whether epoch ``epoch`` ends with a test: every ``opts.eval_every``-th epoch, and the last."""
    return epoch % opts.eval_every == 0 or epoch == opts.epochs


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


def _kept(run: Run, state: RunState, row: dict, out_dir: Path, logger, dist: Dist, probes) -> None:
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
    if not tested(row["epoch"], run.settings):  # (trainer.eval_every: no test figures to keep or log)
        log.info(
            "epoch %d/%d  train_loss %.4f  lr %.4g  %.1fs  (tested every %d epochs)", row["epoch"],
            run.settings.epochs, row["train_loss"], row["lr"], row["seconds"], run.settings.eval_every,
        )  # fmt: skip
        return
    score = run.task.score(row)
    if score > state.best[0] or state.best[1] == 0:
        state.best = (score, row["epoch"])
    run.task.log_epoch(row, run.settings.epochs)


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

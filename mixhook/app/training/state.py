"""A run's state, owned here: what a run has done so far, captured into one checkpoint and restored
from it, and the rule for which checkpoints a run may continue.

:class:`RunState` holds the position (epochs finished, steps into the next one, training steps in
all), the metrics rows and running totals, the elapsed time and the best epoch. :meth:`RunState.save`
captures it together with everything else the rest of a run depends on (model, optimizer, LR schedule,
AMP grad scaler, every random stream of every rank, the config) into one atomically written file
(:mod:`~mixhook.app.training.checkpoint`); :meth:`RunState.restore` puts all of it back, so training
continues exactly as if it had not stopped. :func:`check_resumable` says whether a checkpoint belongs to
a run's config: the same settings, or the same settings with more epochs (*extending* a run), as long as
the schedule the trained epochs followed stays the same. :class:`Totals` are a part-done epoch's
running sums, and :class:`Checkpoints` where the loop keeps ``last.pt``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mixhook.sharding import sharded

from ...hooks import without_rank
from . import checkpoint as ckpt
from .distributed import Dist, full_state, load_full_state

# Keys that may differ between a run and its resumption: where things are, how they are shown.
RESUMABLE_CHANGES = {
    "trainer.resume", "trainer.progress_bar", "trainer.checkpoint_every", "trainer.device",
    "trainer.check_finite_every", "trainer.threads",
    "data.root", "data.num_workers", "data.download",
}  # fmt: skip
EPOCHS = "trainer.epochs"  # may grow: the run is extended


@dataclass
class RunState:
    """Where a run is: ``epoch`` epochs finished and ``step`` steps into the next (0 at an epoch's end),
    ``global_step`` training steps in all; ``rows`` the ``metrics.csv`` rows so far; ``totals`` the
    running sums of a part-done epoch (:meth:`Totals.saved`); ``seconds`` of
    training so far; ``best`` the best ``(score, epoch)``: the score is the run's task's
    (:meth:`~mixhook.app.training.task.Task.score`: the test accuracy, or minus the test RMSE)."""

    epoch: int = 0
    step: int = 0
    global_step: int = 0
    rows: list = field(default_factory=list)
    totals: list | None = None
    seconds: float = 0.0
    best: tuple = (-1.0, 0)

    def save(self, path: str | os.PathLike, run, scaler=None, dist: Dist | None = None) -> None:
        """Write the checkpoint of ``run`` (a :class:`~mixhook.app.training.settings.Run`) at this state to
        ``path``. Every rank must call it (the random streams are gathered); rank 0 writes."""
        dist = dist or Dist()
        totals = (
            None
            if self.totals is None
            else [t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in self.totals]
        )
        # every rank's random streams and running sums of a part-done epoch, in rank order (one gather)
        randoms, every_totals = zip(*dist.gather((ckpt.random_states(run.hooks), totals)), strict=True)
        # a sharded model's whole state is gathered from every rank's shards
        whole = full_state(run.model, run.optimizer) if sharded(run.model) else None
        mixer = run.mixup
        learned = mixer.state_dict() if mixer is not None and any(True for _ in mixer.parameters()) else None
        if not dist.main:
            return
        model, optimizer = whole or (run.model.state_dict(), run.optimizer.state_dict())
        ckpt.save(path, {
            "epoch": self.epoch, "step": self.step, "global_step": self.global_step,
            "rows": self.rows, "seconds": self.seconds, "best": list(self.best), "totals": totals,
            "rank_totals": list(every_totals) if dist.enabled else None,
            "model": model,
            "optimizer": optimizer,
            "scheduler": None if run.scheduler is None else run.scheduler.state_dict(),
            "scaler": None if scaler is None else scaler.state_dict(),
            "random": list(randoms),
            "learned": learned,  # a learned mixer's own state (AutoMix's Mix Block and momentum copy)
            "config": run.config,
            "data_split": getattr(run.data, "split_hash", None),
        })  # fmt: skip

    @classmethod
    def restore(cls, saved: dict, run, scaler=None, dist: Dist | None = None) -> RunState:
        """Put a checkpoint (:func:`~mixhook.app.training.checkpoint.load`) back into ``run``: model,
        optimizer, schedule, scaler and this rank's random streams; return its state.
        :class:`~mixhook.app.training.checkpoint.CheckpointError` when it does not fit the run."""
        try:
            if sharded(run.model):  # each rank takes its shards of the whole model and optimizer
                load_full_state(run.model, run.optimizer, saved["model"], saved["optimizer"])
            else:
                run.model.load_state_dict(saved["model"])
                run.optimizer.load_state_dict(saved["optimizer"])
        except (RuntimeError, KeyError, ValueError) as err:
            said = " ".join(str(err).split())[:300] or type(err).__name__  # torch's report, on one line
            raise ckpt.CheckpointError(
                f"the checkpoint's model or optimizer does not fit this run: {said}"
            ) from None
        if (run.scheduler is None) != (saved["scheduler"] is None):
            raise ckpt.CheckpointError("the checkpoint's LR schedule does not match this run's")
        if run.scheduler is not None:
            run.scheduler.load_state_dict(saved["scheduler"])
        if saved.get("learned") is not None:  # (rank 0's: the same Mix Block and copy on every rank)
            run.mixup.load_state_dict(without_rank(saved["learned"]))
        if scaler is not None and saved.get("scaler"):
            scaler.load_state_dict(saved["scaler"])
        split, ours = saved.get("data_split"), getattr(run.data, "split_hash", None)
        if split is not None and ours is not None and split != ours:
            raise ckpt.CheckpointError(
                f"the checkpoint was trained on another data split (digest {split}; this run's is {ours}): "
                "the data files, the split settings or the library that draws the split changed"
            )
        dist = dist or Dist()
        if len(saved["random"]) != dist.world:
            raise ckpt.CheckpointError(
                f"the checkpoint was written by {len(saved['random'])} process(es), this run has {dist.world}"
            )
        ckpt.restore_random_states(saved["random"][dist.rank], run.hooks)
        every_totals = saved.get("rank_totals")  # (several processes: each rank's own running sums)
        totals = saved["totals"] if every_totals is None else every_totals[dist.rank]
        return cls(
            epoch=saved["epoch"], step=saved["step"], global_step=saved["global_step"],
            rows=list(saved["rows"]), totals=totals, seconds=saved["seconds"],
            best=tuple(saved["best"]),
        )  # fmt: skip


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


class Checkpoints:
    """Where :func:`~mixhook.app.training.loop.train` keeps ``last.pt``: :meth:`save` writes the run's
    state (its model, optimizer, random streams, metrics rows and, mid-epoch, the epoch's running sums)
    after ``epoch_done`` whole epochs and ``step`` steps of the next. ``start``: when the run began
    (``perf_counter``), less the time of the part before a resume."""

    def __init__(self, run, state: RunState, path: Path, scaler, dist: Dist, logger):
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


def check_resumable(saved: dict, config: dict, as_saved_epochs: dict | None = None) -> None:
    """Whether checkpoint ``saved`` (as :func:`~mixhook.app.training.checkpoint.load` returns it) may be
    continued by a run with ``config``: raises
    :class:`~mixhook.app.training.checkpoint.CheckpointError` (one line) when not.

    The settings must be the checkpoint's, except :data:`RESUMABLE_CHANGES` and ``trainer.epochs``,
    which may grow (extending a run; never below the epochs already trained). ``as_saved_epochs``:
    ``config`` as it would be with the checkpoint's ``trainer.epochs``; a key that differs in
    ``config`` but not there follows the epochs (``scheduler.T_max: ${trainer.epochs}``), and changing
    it would change the schedule the trained epochs followed: refused, saying so."""
    old, new = _flat(saved.get("config") or {}), _flat(config)
    changed = [
        key
        for key in sorted(old.keys() | new.keys())
        if key not in RESUMABLE_CHANGES
        and not key.startswith("hydra.")
        and old.get(key, "<unset>") != new.get(key, "<unset>")
    ]
    extending = EPOCHS in changed
    if extending and isinstance(new.get(EPOCHS), int) and new[EPOCHS] < saved["epoch"]:
        raise ckpt.CheckpointError(f"{saved['epoch']} epochs trained, more than {EPOCHS}={new[EPOCHS]}")
    following = _flat(as_saved_epochs) if extending and as_saved_epochs is not None else {}
    for key in changed:
        if key == EPOCHS:
            continue
        before, now = old.get(key, "<unset>"), new.get(key, "<unset>")
        if following and following.get(key, "<unset>") == before:
            raise ckpt.CheckpointError(
                f"extending the run from {old[EPOCHS]} to {new[EPOCHS]} epochs would change {key} from "
                f"{before!r} to {now!r}, a schedule the {saved['epoch']} epochs already trained did not "
                "follow: extend a run whose schedule does not follow trainer.epochs (scheduler=constant "
                f"or multistep), or train {new[EPOCHS]} epochs from the start"
            )
        raise ckpt.CheckpointError(
            f"written with {key}={before!r}, this run has {key}={now!r}; "
            "resume with the checkpoint's settings"
        )


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}

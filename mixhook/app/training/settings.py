"""What a run trains with: :class:`Settings` (the ``trainer`` keys the loop reads) and :class:`Run` (the
model, data, optimizer and hooks, and the task they make)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mixhook.mixers import MixingHook

from .task import Task, task_for


@dataclass
class Settings:
    """How to train: the ``trainer`` keys the loop reads (ranges checked by the app's schema)."""

    epochs: int
    loss: str = "ce"  # one of task.LOSSES
    precision: str = "32"  # one of forward.PRECISIONS
    compile: bool = False
    channels_last: bool = False
    progress_bar: bool = True
    checkpoint_every: int = 0
    mixed_loss_weight: float = 1.0  # the loss of a mixed step times this (PatchUp's authors: 2)
    check_finite_every: int | None = None  # host reads of the finite check (finite.check_every)
    warmup_epochs: int = 0  # a linear warm-up of the learning rate over these first epochs (warmup.Warmup)
    warmup_start_factor: float = 1.0  # its first step's rate over the scheduled one
    eval_every: int = 1  # test every this many epochs, and after the last (loop.train)


@dataclass
class Run:
    """Everything one run trains with: built and checked by :func:`mixhook.app.build.build`, or by hand.

    ``hooks``: every hook attached to ``model`` (their generators are checkpointed); ``mixup`` the one
    mixing regularizer among them, if any; ``handles``: what their ``attach()`` returned (removing them
    detaches everything). ``summary``: copied into ``summary.json`` (the mixup settings, seed, ...);
    ``config``: saved in the checkpoint for a resuming run to compare with its own.
    ``feature_maps``: ``(layers, batch, labels)`` to draw after every epoch into ``feature_maps/``.
    ``task``: what the run learns (:class:`~mixhook.app.training.task.Task`), made once from ``data`` and
    ``settings.loss`` (by the builder, before anything is attached, or else here)."""

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
    task: Task | None = None  # (None: made here from the data and the loss)

    def __post_init__(self) -> None:
        if self.task is None:
            self.task = task_for(self.data, self.settings.loss)

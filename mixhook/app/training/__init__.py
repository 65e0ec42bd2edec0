"""The training loop of the experiment app (no Hydra here: plain objects in, metrics out)."""

from .evaluation import evaluate
from .loop import Training, train, train_one_epoch
from .settings import Run, Settings
from .task import LOSSES, Classification, Regression, Task

__all__ = [
    "LOSSES", "Classification", "Regression", "Run", "Settings", "Task", "Training", "evaluate", "train",
    "train_one_epoch",
]  # fmt: skip

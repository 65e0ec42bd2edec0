"""The training loop of the experiment app (no Hydra here: plain objects in, metrics out)."""

from .loop import LOSSES, Run, Settings, Training, evaluate, train, train_one_epoch

__all__ = ["LOSSES", "Run", "Settings", "Training", "evaluate", "train", "train_one_epoch"]

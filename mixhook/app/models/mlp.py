"""A small MLP for tabular data (the app's regression task on scikit-learn's diabetes data)."""

from __future__ import annotations

from torch import nn


class MLP(nn.Module):
    """``layer1`` (Linear + ReLU), ``layer2`` (Linear + ReLU), ``head`` (Linear): the layers the mixup
    configs name (``input``, ``layer1``, ``layer2``) exist here as in PreActResNet-18.

    Args:
        in_channels: input features (the app passes the data's).
        num_classes: outputs (1 for a regression target).
        hidden: width of both hidden layers.
    """

    def __init__(self, in_channels: int, num_classes: int, hidden: int = 64):
        super().__init__()
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"hidden must be a positive integer, got {hidden!r}")
        self.layer1 = nn.Sequential(nn.Linear(in_channels, hidden), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.head(self.layer2(self.layer1(x.flatten(1))))

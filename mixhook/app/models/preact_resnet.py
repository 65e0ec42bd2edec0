"""PreActResNet-18 (He et al. 2016, "Identity Mappings in Deep Residual Networks"), the model of the
Manifold Mixup paper (Verma et al. 2019) and of mixup's CIFAR experiments (Zhang et al. 2018).

The architecture and module names are those of the Manifold Mixup reference code
(``supervised/models/preresnet.py``): ``conv1``, ``layer1`` .. ``layer4`` (two ``PreActBlock`` each) and
``linear``, with no batch norm after ``layer4`` (11,171,146 parameters for 10 classes). Its
``forward`` mixes at the outputs of ``input``, ``layer1``, ``layer2`` (and ``layer3``): exactly the
outputs that mixhook's hooks on those names mix. Global average pooling (the reference's
``avg_pool2d(out, 4)`` at 32x32) makes it work at any input size from 8x8 (digits) upwards.

Two options reproduce other authors' networks: ``shortcut="activated"`` is the Noisy Feature Mixup
authors' block (erichson/NFM, ``src/cifar_models/preresnet.py``: ``self.shortcut = nn.Sequential()``
applied to ``relu(bn1(x))``, so the identity shortcut carries the activated input, not ``x``), and
``width=2`` their ``PreActWideResNet18`` (stages of 128, 256, 512, 1024 channels). A fractional width
(``0.25``: stages of 16, 32, 64, 128 channels) gives the same network narrower, for quick runs and tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SHORTCUTS = ("input", "activated")


class PreActBlock(nn.Module):
    """Pre-activation basic block: BN-ReLU-conv3x3-BN-ReLU-conv3x3 plus the (projected) shortcut.

    ``shortcut``: what an identity shortcut carries: ``"input"``, the block's input ``x`` (He et al. 2016,
    the Manifold Mixup and PatchUp code), or ``"activated"``, ``relu(bn1(x))`` (the NFM authors' code). A
    projection shortcut takes ``relu(bn1(x))`` either way, as in all three codebases."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, shortcut: str = "input"):
        super().__init__()
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride must be an integer >= 1 (the first convolution's), got {stride!r}")
        if shortcut not in SHORTCUTS:
            raise ValueError(f"shortcut={shortcut!r} is not a shortcut; valid: {', '.join(SHORTCUTS)}")
        self.activated = shortcut == "activated"
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.shortcut = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(x))
        if self.shortcut is not None:
            shortcut = self.shortcut(out)
        else:
            shortcut = out if self.activated else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        return out + shortcut


class PreActResNet(nn.Module):
    """Pre-activation ResNet with ``PreActBlock`` stages of widths ``64, 128, 256, 512`` times ``width``."""

    def __init__(
        self,
        num_blocks: list[int],
        in_channels: int = 3,
        num_classes: int = 10,
        shortcut: str = "input",
        width: float = 1,
        stride: int = 1,
    ):
        super().__init__()
        if in_channels < 1 or num_classes < 2:
            raise ValueError(f"need in_channels >= 1 and num_classes >= 2, got {in_channels}, {num_classes}")
        if isinstance(width, bool) or not isinstance(width, (int, float)) or width <= 0 or 64 * width % 1:
            raise ValueError(
                f"width must be a positive multiple of 1/64 (stages of 64*width, 128*width, ... channels: "
                f"0.25, 0.5, 1, 2), got {width!r}"
            )
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride must be an integer >= 1 (the first convolution's), got {stride!r}")
        if shortcut not in SHORTCUTS:
            raise ValueError(f"shortcut={shortcut!r} is not a shortcut; valid: {', '.join(SHORTCUTS)}")
        self.shortcut = shortcut
        widths = [int(w * width) for w in (64, 128, 256, 512)]
        self.in_planes = widths[0]
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, stride=stride, padding=1, bias=False)
        self.layer1 = self._make_layer(widths[0], num_blocks[0], stride=1)
        self.layer2 = self._make_layer(widths[1], num_blocks[1], stride=2)
        self.layer3 = self._make_layer(widths[2], num_blocks[2], stride=2)
        self.layer4 = self._make_layer(widths[3], num_blocks[3], stride=2)
        self.linear = nn.Linear(widths[3], num_classes)

    def _make_layer(self, planes: int, num_blocks: int, stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (num_blocks - 1):
            layers.append(PreActBlock(self.in_planes, planes, s, self.shortcut))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(x)
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def PreActResNet18(  # noqa: N802 (a class-like factory)
    in_channels: int = 3, num_classes: int = 10, shortcut: str = "input", width: float = 1, stride: int = 1
) -> PreActResNet:
    """PreActResNet-18: two blocks per stage (``shortcut``, ``width``: see the module's docstring;
    ``stride``: the first convolution's, 2 for 64x64 images as the Manifold Mixup authors train
    Tiny-ImageNet)."""
    return PreActResNet(
        [2, 2, 2, 2], in_channels=in_channels, num_classes=num_classes, shortcut=shortcut, width=width,
        stride=stride,
    )  # fmt: skip

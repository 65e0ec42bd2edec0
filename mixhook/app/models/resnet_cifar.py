"""The CIFAR ResNets of He et al. 2016 ("Deep Residual Learning for Image Recognition", Section 4.2):
three stages of 16, 32 and 64 channels, ``n`` basic blocks each (depth ``6n + 2``: ResNet-32 has ``n =
5``), identity shortcuts that subsample and zero-pad the channels where a stage begins (the paper's option
A), global average pooling and a linear classifier. ResNet-32 is the model of the long-tailed CIFAR
benchmarks (Cao et al. 2019, LDAM-DRW; Remix, Chou et al. 2020, follows their setup).

Module names and initialisation are those of the LDAM-DRW code (kaidic/LDAM-DRW
``models/resnet_cifar.py``): ``conv1``, ``bn1``, ``layer1`` .. ``layer3`` (``BasicBlock``s) and
``linear``, Kaiming-normal weights for the convolutions and the classifier; 464,154 parameters for 10
classes. Global average pooling makes it work at any input size (8x8 digits too).

``shortcut="projection"`` builds the network of the Random Erasing authors' code instead
(zhunzhong07/Random-Erasing ``models/fashion/resnet.py`` and ``models/cifar/resnet.py``, a port of
fb.resnet.torch): where a stage begins, the shortcut is a strided 1x1 convolution and batch norm (the
paper's option B), the convolutions are initialised ``N(0, 2 / (9 * out_channels))`` (Kaiming's, by fan
out), batch norm to 1 and 0, the classifier as PyTorch's ``Linear``; 272,186 parameters for ResNet-20
on one-channel images. Their code switches to bottleneck blocks from depth 44, which this model does not
build: a projection ResNet of depth 44 or more is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

RESNET_SHORTCUTS = ("zeros", "projection")  # option A (zero-padded identity) or B (1x1 convolution + BN)


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the shortcut, then ReLU; the shortcut of a block that changes the
    size takes every other pixel and pads the new channels with zeros (option A: no parameters)."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, projection: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        changes = stride != 1 or in_planes != planes
        self.pad = (planes - in_planes) // 2 if changes and not projection else None
        self.downsample = None  # (option B: the Random Erasing code's name for it)
        if changes and projection:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )
        self.stride = stride

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.downsample is not None:
            return self.downsample(x)
        if self.pad is None:
            return x
        return F.pad(x[:, :, :: self.stride, :: self.stride], (0, 0, 0, 0, self.pad, self.pad))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """A CIFAR ResNet of ``depth = 6n + 2`` layers (20, 32, 44, 56, 110, ...) for ``num_classes``;
    ``shortcut``: ``"zeros"`` (option A, the LDAM-DRW code's) or ``"projection"`` (option B, the Random
    Erasing code's; see the module)."""

    def __init__(self, depth: int = 32, in_channels: int = 3, num_classes: int = 10, shortcut: str = "zeros"):
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
            raise ValueError(
                f"depth must be 6n + 2 for an integer n >= 1 (20, 32, 44, 56, 110), got {depth!r}"
            )
        if shortcut not in RESNET_SHORTCUTS:
            raise ValueError(f"shortcut={shortcut!r} is not a shortcut; valid: {', '.join(RESNET_SHORTCUTS)}")
        if shortcut == "projection" and depth >= 44:
            raise ValueError(
                f"depth={depth} with shortcut=projection: the Random Erasing code builds bottleneck blocks "
                "from depth 44, which this model does not; use depth 20, 26, 32 or 38"
            )
        self.projection = shortcut == "projection"
        n = (depth - 2) // 6
        self.in_planes = 16
        self.conv1 = nn.Conv2d(in_channels, 16, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = self._stage(16, n, 1)
        self.layer2 = self._stage(32, n, 2)
        self.layer3 = self._stage(64, n, 2)
        self.linear = nn.Linear(64, num_classes)
        for m in self.modules():
            if self.projection and isinstance(m, nn.Conv2d):  # fb.resnet.torch's, as the Random Erasing code
                nn.init.normal_(
                    m.weight, 0.0, (2.0 / (m.kernel_size[0] * m.kernel_size[1] * m.out_channels)) ** 0.5
                )
            elif not self.projection and isinstance(m, (nn.Linear, nn.Conv2d)):  # LDAM-DRW's _weights_init
                nn.init.kaiming_normal_(m.weight)

    def _stage(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (blocks - 1):
            layers.append(BasicBlock(self.in_planes, planes, s, self.projection))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def ResNet32(in_channels: int = 3, num_classes: int = 10) -> CifarResNet:  # noqa: N802 (a class-like factory)
    """ResNet-32 (``n = 5``), the long-tailed CIFAR benchmarks' model."""
    return CifarResNet(32, in_channels, num_classes)

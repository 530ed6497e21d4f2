"""ResNet-18 for 32x32 CIFAR images (He et al. 2016, with the usual CIFAR stem), written here so that
``train.py --synthetic`` never imports torchvision.

The CIFAR variant differs from ImageNet's ResNet-18 in its stem: one 3x3 convolution with stride 1 and no
max-pool (a 32x32 image would otherwise shrink to 1x1 too early); the four stages then give 32, 16, 8 and 4
pixels, and a 4x4 average pool feeds the classifier.  11.2 M parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["BasicBlock", "ResNet", "resnet18"]


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 conv-BN projection) shortcut."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR ResNet: 3x3 stem, four stages of ``blocks[i]`` blocks (64, 128, 256, 512 channels), linear head."""

    def __init__(self, blocks: tuple[int, int, int, int] = (2, 2, 2, 2), num_classes: int = 10) -> None:
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._stage(64, blocks[0], stride=1)
        self.layer2 = self._stage(128, blocks[1], stride=2)
        self.layer3 = self._stage(256, blocks[2], stride=2)
        self.layer4 = self._stage(512, blocks[3], stride=2)
        self.linear = nn.Linear(512 * BasicBlock.expansion, num_classes)

    def _stage(self, planes: int, count: int, stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (count - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes * BasicBlock.expansion
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def resnet18(num_classes: int = 10) -> ResNet:
    """ResNet-18 for CIFAR: blocks (2, 2, 2, 2)."""
    return ResNet((2, 2, 2, 2), num_classes)

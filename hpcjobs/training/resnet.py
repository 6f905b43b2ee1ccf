"""ResNet-18 and ResNet-50 with torchvision's layout and parameter names,
so that state dicts load either way: PyPI's torchvision wheels are CUDA
builds that do not import beside the CPU torch this project pins.

``resnet18()`` has 11,689,512 parameters and ``resnet50()`` 25,557,032 at
1000 classes, as torchvision's. The stem (7x7 convolution, stride 2, then
3x3 max pooling) and the adaptive average pool take any image size from
32x32 up; ``norm_layer`` replaces BatchNorm2d (Horovod's synthetic
benchmark passes ``hvd.SyncBatchNorm``). Weights are initialised as
torchvision does (Kaiming normal, fan-out, for convolutions; BatchNorm at
weight 1, bias 0).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["ResNet", "BasicBlock", "Bottleneck", "resnet18", "resnet50"]


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and the shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, downsample: nn.Module | None, norm: Callable):
        super().__init__()
        self.conv1 = _conv3x3(cin, planes, stride)
        self.bn1 = norm(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = norm(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    """1x1 down, 3x3 (carrying the stride, as torchvision's v1.5), 1x1 up
    by four (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, downsample: nn.Module | None, norm: Callable):
        super().__init__()
        self.conv1 = _conv1x1(cin, planes)
        self.bn1 = norm(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = norm(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = norm(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    """Stem, four stages of ``layers[i]`` blocks (64, 128, 256, 512 planes;
    stride 2 from the second), global average pool, ``fc``."""

    def __init__(self, block, layers: list[int], num_classes: int = 1000, norm_layer: Callable | None = None):
        super().__init__()
        self._norm = norm_layer or nn.BatchNorm2d
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = self._norm(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._stage(block, 64, layers[0], 1)
        self.layer2 = self._stage(block, 128, layers[1], 2)
        self.layer3 = self._stage(block, 256, layers[2], 2)
        self.layer4 = self._stage(block, 512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) or (
                    isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _stage(self, block, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes * block.expansion, stride),
                                       self._norm(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample, self._norm)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, 1, None, self._norm) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000, norm_layer: Callable | None = None) -> ResNet:
    """torchvision's ``resnet18`` (no pretrained weights here)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, norm_layer)


def resnet50(num_classes: int = 1000, norm_layer: Callable | None = None) -> ResNet:
    """torchvision's ``resnet50`` (no pretrained weights here)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, norm_layer)

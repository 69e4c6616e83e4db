"""A small CIFAR-style ResNet (He et al. 2016, section 4.2) with one BasicBlock per stage: ResNet-8.

Three stages of 16, 32 and 64 channels on 3x32x32 images: heavier than LeNet-5 (about 20x the compute per image),
so the benchmark has a model where spreading the work over cards can pay off.
"""

from __future__ import annotations

from torch import nn


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the input (a 1x1 conv + BN where the shape changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.body(x) + self.shortcut(x))


class ResNet8(nn.Module):
    input_shape = (3, 32, 32)  # what one sample looks like: synthetic data is made to match
    channels_last = True  # a conv net: faster in NHWC on the CPU (the trainer's --channels-last auto)

    def __init__(self, classes: int = 10, channels: int = 3, widths: tuple[int, ...] = (16, 32, 64)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=True))
        self.stages = nn.Sequential(*(BasicBlock(widths[max(i - 1, 0)], width, stride=2 if i else 1)
                                      for i, width in enumerate(widths)))  # 32x32 -> 16x16 -> 8x8
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], classes))

    def forward(self, x):
        return self.head(self.stages(self.stem(x)))

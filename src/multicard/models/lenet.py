"""The seeds' LeNet-5: conv 6@5x5 (padding 2) -> pool -> conv 16@5x5 -> pool -> 120 -> 84 -> 10."""

from torch import nn


class LeNet5(nn.Module):
    input_shape = (1, 28, 28)  # what one sample looks like: synthetic data is made to match
    channels_last = True  # a conv net: faster in NHWC on the CPU (the trainer's --channels-last auto)

    def __init__(self, classes: int = 10, channels: int = 1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # 28x28 -> 14x14
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),  # 14x14 -> 10x10 -> 5x5
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))

"""A wide MLP of about 100M parameters on MNIST-shaped input: a model where sharding matters.

flatten -> Linear(784, W) -> `depth` identical residual blocks (x + GELU(Linear(LayerNorm(x)))) -> LayerNorm ->
Linear(W, 10), its logits scaled down for wide W (see `logit_scale`). With the defaults (W = 4096, 6 blocks) it
has 104,001,546 parameters, 100,737,024 of them in the blocks: 397 MiB in fp32, and with their gradients and
Adam's two moments (16 bytes per parameter) 1.55 GiB held by every process under ddp. The blocks sit in an
nn.ModuleList of identical children, which is what fsdp's default wrap rule shards one by one. Compute per sample
is small next to its size (about 104M multiply-adds forward): it is a memory benchmark, not a speed one. `width`
and `depth` build smaller ones (for tests).
"""

from __future__ import annotations

import math

from torch import nn


class Block(nn.Module):
    """x + GELU(Linear(LayerNorm(x))): pre-norm residual, so that a deep stack starts near the identity."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.linear(self.norm(x)))


class WideMLP(nn.Module):
    input_shape = (1, 28, 28)  # what one sample looks like: synthetic data is made to match

    def __init__(self, width: int = 4096, depth: int = 6, classes: int = 10, channels: int = 1):
        super().__init__()
        self.flatten = nn.Flatten()
        self.stem = nn.Linear(channels * 28 * 28, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)
        # Adam moves every weight by about lr a step, all in the direction that helps, so one step moves a logit
        # by about lr x width: at width 4096 and lr 1e-3 the loss jumped from 2.3 to 10 in 3 steps. Scaled by
        # 8 / sqrt(width) (1 up to width 64, 1/8 at 4096) it stayed under 2.9 and fell faster (measured on
        # synthetic data, batch 64: mean loss of the 2nd epoch 1.80 against 2.11 unscaled)
        self.logit_scale = min(1.0, 8 / math.sqrt(width))

    def forward(self, x):
        x = self.stem(self.flatten(x))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) * self.logit_scale

"""synthetic: random images and labels of any size and shape, for benchmarks (nothing to learn)."""

from __future__ import annotations

import torch

from .images import ImageData


def load(samples: int = 8192, shape: tuple[int, ...] = (1, 28, 28), classes: int = 10,
         test_samples: int = 1024, seed: int = 0) -> tuple[ImageData, ImageData]:
    g = torch.Generator().manual_seed(seed)

    def make(n: int) -> ImageData:
        images = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g)
        return ImageData(images, torch.randint(0, classes, (n,), generator=g), 0.5, 0.29)

    return make(samples), make(test_samples)

"""synthetic: random images and labels of any size and shape, for benchmarks (nothing to learn)."""

from __future__ import annotations

import math

import torch

from ..errors import UsageError
from .idx import available_memory
from .images import ImageData


def load(samples: int = 8192, shape: tuple[int, ...] = (1, 28, 28), classes: int = 10,
         test_samples: int = 1024, seed: int = 0) -> tuple[ImageData, ImageData]:
    need = (samples + test_samples) * math.prod(shape) * 5  # uint8 images, then their float32 copies
    free = available_memory()
    if free is not None and need > free:
        raise UsageError(f"--synthetic-samples {samples}: {samples} images of {'x'.join(map(str, shape))} need "
                         f"{need / 2**30:.1f} GiB of memory, more than the {free / 2**30:.1f} GiB available")
    g = torch.Generator().manual_seed(seed)

    def make(n: int) -> ImageData:
        images = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g)
        return ImageData(images, torch.randint(0, classes, (n,), generator=g), 0.5, 0.29)

    return make(samples), make(test_samples)

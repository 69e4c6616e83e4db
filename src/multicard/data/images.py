"""ImageData: images held in memory, normalized once, served a whole batch per index list (no collation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


class ImageData(TensorDataset):
    """(N, C, H, W) images and int64 labels; `data[indices]` is a batch, by one indexing op.

    uint8 pixels are normalized to float once, here ((x / 255 - mean) / std), so no step pays for it again;
    float images are taken as normalized already.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: float, std: float,
                 augment: bool = False):
        if images.dtype == torch.uint8:
            images = images.float().div_(255).sub_(mean).div_(std)
        super().__init__(images, labels)
        self.mean, self.std, self.augment = mean, std, augment

    def __getitem__(self, index):
        images, labels = self.tensors[0][index], self.tensors[1][index]
        if self.augment and images.dim() == 4:
            black = -self.mean / self.std  # what 0 became: the background the transform must pad with
            images = random_affine(images - black) + black
        return images, labels

    def to(self, device: torch.device) -> ImageData:
        return ImageData(*(t.to(device) for t in self.tensors), self.mean, self.std, self.augment)


def random_affine(x: torch.Tensor, turn: float = 0.2, scale: float = 0.1, shift: float = 0.05) -> torch.Tensor:
    """Rotate by up to `turn` radians, scale by up to ±`scale`, shift by up to `shift` of the side, per image.

    Uses the global torch RNG, so each rank (seeded seed + rank) draws its own.
    """
    n = x.shape[0]
    angle = (torch.rand(n, device=x.device) * 2 - 1) * turn
    zoom = 1 + (torch.rand(n, device=x.device) * 2 - 1) * scale
    move = (torch.rand(n, 2, device=x.device) * 2 - 1) * shift * 2  # grid coordinates span 2 per image side
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    theta = torch.stack([torch.stack([cos, -sin, move[:, 0]], 1), torch.stack([sin, cos, move[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, align_corners=False)

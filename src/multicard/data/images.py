"""ImageData: images held in memory, normalized once, served a whole batch per index list (no collation).

Augmentation is keyed, not streamed: once told its seed and epoch (set_epoch), the dataset draws sample i's
rotation, scale and shift from (seed, epoch, i) alone, by a counter-based hash. So a sample is transformed the
same whichever process, micro-batch or batch size fetches it, and after a resume: a run's augmentation does not
depend on how the run was cut.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

MASK = 0xFFFFFFFF  # the hash works on 32-bit values held in int64
GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: any constant with half its bits set
DRAWS = 4  # uniforms per image: angle, zoom, shift x, shift y


class ImageData(TensorDataset):
    """(N, C, H, W) images and int64 labels; `data[indices]` is a batch, by one indexing op.

    uint8 pixels are normalized to float once, here ((x / 255 - mean) / std), so no step pays for it again;
    float images are taken as normalized already. With `augment`, each image served is randomly rotated,
    scaled and shifted: keyed by (seed, epoch, index) after set_epoch, else drawn from torch's global RNG.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: float, std: float,
                 augment: bool = False):
        if images.dtype == torch.uint8:
            images = images.float().div_(255).sub_(mean).div_(std)
        super().__init__(images, labels)
        self.mean, self.std, self.augment = mean, std, augment
        # shared with copies on other devices (to()), so that setting the epoch on one keys them all
        self.key: dict[str, int | None] = {"seed": 0, "epoch": None}

    def set_epoch(self, epoch: int, seed: int | None = None) -> None:
        """Key the augmentation of the passes that follow: sample i gets the draw of (seed, epoch, i). Set it
        before a pass: DataLoader workers take a copy of the dataset when the pass starts."""
        self.key["epoch"] = epoch
        if seed is not None:
            self.key["seed"] = seed

    def __getitem__(self, index):
        images, labels = self.tensors[0][index], self.tensors[1][index]
        if not self.augment:
            return images, labels
        single = images.dim() == 3  # one sample (a plain DataLoader's way): transformed as in a batch
        batch = images.unsqueeze(0) if single else images
        epoch = self.key["epoch"]
        if epoch is None:
            u = torch.rand(len(batch), DRAWS, device=batch.device)
        else:
            u = uniforms(self.key["seed"], epoch, positions(index, len(self), batch.device))
        black = -self.mean / self.std  # what 0 became: the background the transform must pad with
        batch = random_affine(batch - black, u) + black
        return (batch[0] if single else batch), labels

    def to(self, device: torch.device) -> ImageData:
        moved = ImageData(*(t.to(device) for t in self.tensors), self.mean, self.std, self.augment)
        moved.key = self.key
        return moved


def positions(index, size: int, device: torch.device) -> torch.Tensor:
    """The dataset positions (0..size-1) that `index` (int, list, slice, index tensor or mask) selects."""
    if isinstance(index, torch.Tensor) and not index.dtype == torch.bool:
        return index.to(device).remainder(size).reshape(-1)  # -1 is size - 1: the same sample, the same draw
    return torch.arange(size, device=device)[index].reshape(-1)


def mix(x):
    """murmur3's 32-bit finalizer (fmix32): a bijection on 0..2^32-1 whose every input bit flips about half the
    output bits. On Python ints or int64 tensors (on any device, elementwise: no host sync)."""
    x = x ^ (x >> 16)
    x = times(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = times(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def times(x, c: int):
    """x * c mod 2^32, in 16-bit halves of c so that no int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK


def uniforms(seed: int, epoch: int, index: torch.Tensor, draws: int = DRAWS) -> torch.Tensor:
    """(len(index), draws) float32 uniforms in [0, 1): a function of (seed, epoch, sample index) alone."""
    key = mix(mix((seed & MASK) ^ GOLDEN) ^ (epoch & MASK))  # (GOLDEN: seed 0 does not hash to 0)
    # one counter per (sample, draw), distinct for every sample below 2^30, then one hash of it (few ops: fast)
    counter = index.long().unsqueeze(1) * draws + torch.arange(draws, device=index.device, dtype=torch.int64)
    h = mix((counter & MASK) ^ key)
    return (h >> 8).float() * 2.0 ** -24  # the top 24 bits: every value exact in float32, never 1


def random_affine(x: torch.Tensor, u: torch.Tensor, turn: float = 0.2, scale: float = 0.1,
                  shift: float = 0.05) -> torch.Tensor:
    """Rotate by up to `turn` radians, scale by up to ±`scale`, shift by up to `shift` of the side, per image;
    `u` holds each image's DRAWS uniforms in [0, 1) that pick them."""
    signed = u * 2 - 1
    angle, zoom = signed[:, 0] * turn, 1 + signed[:, 1] * scale
    move = signed[:, 2:] * shift * 2  # grid coordinates span 2 per image side
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    theta = torch.stack([torch.stack([cos, -sin, move[:, 0]], 1), torch.stack([sin, cos, move[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, align_corners=False)

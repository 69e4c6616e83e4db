"""Loaders that give each process its share: shuffled shards for training, exact shards for evaluation."""

from __future__ import annotations

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from .images import ImageData


class ShardSampler(Sampler[int]):
    """Every `world`-th index from `rank`: each sample in exactly one shard, none padded or repeated.

    DistributedSampler pads the last shard with repeats so that shards are equal; for evaluation that would
    count some samples twice. Shards here may differ by one sample; metrics are reduced as sums.
    """

    def __init__(self, size: int, rank: int = 0, world: int = 1):
        self.size, self.rank, self.world = size, rank, world

    def __iter__(self):
        return iter(range(self.rank, self.size, self.world))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world))

    def order(self) -> torch.Tensor:
        return torch.arange(self.rank, self.size, self.world)


class Shuffled(DistributedSampler):
    """DistributedSampler (one seeded permutation per epoch, padded to equal shards, dealt out by rank) that also
    gives its order as one tensor, built in milliseconds where listing 262,144 indices takes about 45."""

    def order(self) -> torch.Tensor:
        """Exactly list(self), as a tensor (the test suite holds the two to that)."""
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        indices = torch.randperm(len(self.dataset), generator=g)
        indices = indices.repeat(-(-self.total_size // len(indices)))[:self.total_size]  # the padding
        return indices[self.rank:self.total_size:self.num_replicas]


class InMemory:
    """Batches cut straight from in-memory tensors: each epoch the sampler's order comes as one index tensor,
    split into batches, each fetched by one indexing op (no DataLoader, no per-sample collation). With a
    `device`, the tensors move there once first: the fast path, with no per-step host work at all."""

    def __init__(self, dataset: TensorDataset, sampler: Shuffled | ShardSampler, batch_size: int,
                 device: torch.device | None):
        if device is not None:
            dataset = dataset.to(device) if isinstance(dataset, ImageData) else \
                TensorDataset(*(t.to(device) for t in dataset.tensors))
        self.data, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.device = dataset.tensors[0].device

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        for chunk in self.sampler.order().to(self.device).split(self.batch_size):
            yield self.data[chunk]


def make_loader(dataset: Dataset, batch_size: int, *, train: bool, rank: int = 0, world: int = 1,
                seed: int = 0, workers: int = 0, pin_memory: bool = False,
                device: torch.device | None = None) -> DataLoader | InMemory:
    """`batch_size` is per process. Training shuffles one global permutation per epoch (the same for every
    world size) and deals it out, so N processes see, step by step, the samples one process would see.
    A TensorDataset is served by InMemory (from `device` if given) unless loader workers are asked for."""
    if train:
        sampler = Shuffled(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    else:
        sampler = ShardSampler(len(dataset), rank, world)
    if isinstance(dataset, TensorDataset) and (device is not None or workers == 0):
        return InMemory(dataset, sampler, batch_size, device)
    common = dict(num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0)
    if isinstance(dataset, TensorDataset):  # workers asked for: they fetch whole batches, still no collation
        return DataLoader(dataset, sampler=BatchSampler(sampler, batch_size, drop_last=False), batch_size=None,
                          **common)
    return DataLoader(dataset, sampler=sampler, batch_size=batch_size, **common)


def set_epoch(loader: DataLoader | InMemory, epoch: int) -> None:
    """Reshuffle for this epoch (users of DistributedSampler must remember this; here it is done for them)."""
    sampler = loader.sampler.sampler if isinstance(loader.sampler, BatchSampler) else loader.sampler
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def to_device(batch, device: torch.device):
    """Move a tensor, or any tuple / list / dict of them, to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch

"""Loaders that cannot be dealt out by index, read whole by every process: an IterableDataset, a batch sampler of
the user's (e.g. length bucketing), or `sampler=BatchSampler(...), batch_size=None`.

Every process iterates the user's loader as it is (the same global batches, when the loader and its random
streams are built alike in every process) and keeps its contiguous part of each batch. Each process then takes
the same number of steps by construction; a batch with fewer samples than processes is left out (some process
would get none), the only batch one process would have taken that N processes do not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from ..errors import UsageError
from ..parts import part, samples


def read_whole(loader: DataLoader) -> bool:
    """Whether `loader` is one of the pipelines each process reads whole."""
    return isinstance(loader.dataset, IterableDataset) or loader.batch_size is None


class Split:
    """The user's loader, whole; each batch cut to this process's part (world 1: the batches as they come)."""

    def __init__(self, loader: DataLoader, rank: int, world: int):
        batches = isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is not None or \
            isinstance(loader.sampler, BatchSampler)
        if not batches:
            raise UsageError(f"this DataLoader has batch_size=None with a {type(loader.sampler).__name__}, so it "
                             f"serves one sample at a time; give it batch_size, or pass a sampler that yields "
                             f"batches of indices as batch_sampler=")
        self.loader, self.rank, self.world = loader, rank, world
        self.sampler, self.batch_size = loader.sampler, None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return self._parts(iter(self.loader))  # started now: its first draws taken as the plain loader's

    def _parts(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            if self.world == 1:
                yield batch
                continue
            size = samples(batch)
            if size is None:
                raise UsageError(f"a batch of this loader is a {type(batch).__name__} with no tensor or per-sample "
                                 f"list to split between the processes")
            if size >= self.world:
                yield part(batch, self.rank, self.world)

"""Loaders that cannot be dealt out by index, read whole by every process: an IterableDataset, a batch sampler of
the user's (e.g. length bucketing), `sampler=BatchSampler(...), batch_size=None`, or a sampler whose own draws
decide the order (RandomSampler with replacement or num_samples, as minGPT's endless stream; WeightedRandomSampler).

Every process iterates the user's loader as it is (the same global batches, when the loader and its random
streams are built alike in every process) and keeps its part of each batch, dealt as the set-up loader deals
(row t to process t % N). Each process then takes the same number of steps by construction; in training a batch
with fewer samples than processes is left out (some process would get none), the only batch one process would
have taken that N processes do not. In evaluation every batch is kept, a process short of rows getting none of
it (an empty part): each sample once, and as many batches in every process.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from ..errors import UsageError
from ..jobs.progress import pass_ended, read_batch
from ..jobs.trees import values
from . import bits
from .bits import FIRST
from .habits import Habits
from .order import Agree, same_everywhere
from .parts import part, samples
from .uneven import Share


def fingerprint(batch: Any, size: int) -> torch.Tensor:
    """Int64 numbers that differ, in practice, between two different batches: its size, its tensors' (bits.py:
    any dtype, NaNs and empty tensors read exactly), and a checksum of its first strings (a batch of text)."""
    tensors = [t for t in values(batch) if isinstance(t, torch.Tensor)]
    text = 0
    for value in itertools.islice((v for v in values(batch) if isinstance(v, (str, bytes))), FIRST):
        text = zlib.crc32(value.encode() if isinstance(value, str) else value, text)
    return torch.cat([torch.tensor([size, text], dtype=torch.int64), bits.fingerprint(tensors, torch.device("cpu"))])


def read_whole(loader: DataLoader) -> bool:
    """Whether `loader` is one of the pipelines each process reads whole: all but a batch_size over a map-style
    dataset in its order or in one permutation of it (shuffle=False or True), which multicard deals out."""
    if isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
        return True
    sampler = loader.sampler
    return not (type(sampler) is SequentialSampler or type(sampler) is RandomSampler and not sampler.replacement
                and sampler.num_samples == len(loader.dataset))


class Split:
    """The user's loader, whole; each batch cut to this process's part (world 1: the batches as they come).
    `every`: evaluation, where a batch with fewer rows than processes is kept (empty parts) and nothing weighted."""

    def __init__(self, loader: DataLoader, rank: int, world: int, agree: Agree | None = None, every: bool = False,
                 weights: Share | None = None, habits: Habits | None = None):
        batches = isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is not None or \
            isinstance(loader.sampler, BatchSampler)
        if not batches:
            raise UsageError(f"this DataLoader has batch_size=None with a {type(loader.sampler).__name__}, so it "
                             f"serves one sample at a time; give it batch_size, or pass a sampler that yields "
                             f"batches of indices as batch_sampler=")
        self.loader, self.rank, self.world, self.agree, self.every = loader, rank, world, agree, every
        self.sampler, self.batch_size = loader.sampler, None
        self.weights, self.habits = weights or Share(), habits or Habits()  # the job's (yourloop/job_state.py)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return self._parts(iter(self.loader))  # started now: its first draws taken as the plain loader's

    def _parts(self, batches: Iterator[Any]) -> Iterator[Any]:
        for i, batch in enumerate(batches):
            if self.world == 1:
                read_batch()
                self.weights.record(1.0)  # a new batch: no earlier split's weight goes on to it
                yield batch
                continue
            size = samples(batch)
            if size is None:
                raise UsageError(f"a batch of this loader is a {type(batch).__name__} with no tensor or per-sample "
                                 f"list to split between the processes")
            if i == 0 and self.agree is not None:
                self._check(batch, size)
            if self.every:
                read_batch()  # counted for the launcher: a rank given more batches than another is named with both
                self.weights.record(1.0)
                self.habits.served_empty(None if size > self.rank else (
                    f"rank {self.rank}'s evaluation batch {i + 1} has no rows (the loader's batch holds {size}, "
                    f"fewer than the {self.world} processes, row t going to process t % {self.world})",
                    f"a loader whose batches hold {self.world} rows or more (drop_last=True leaves a short last one "
                    f"out, and its samples with it)"))
                yield part(batch, self.rank, self.world)
            elif size >= self.world:  # its part, weighted by its rows (uneven.py)
                read_batch()
                yield self.weights.local(batch, self.rank, self.world, habits=self.habits)
        self.weights.record(1.0)  # the pass is over: what follows is not weighted by its last batch
        self.habits.served_empty(None)
        pass_ended()

    def _check(self, batch: Any, size: int) -> None:
        """The first batch of each pass, compared between the processes (one collective a pass): a loader that
        serves each process other batches (a sampler or shuffle buffer drawing from global RNGs seeded apart)
        is one clear error, never steps over different data."""
        if not same_everywhere(self.agree, fingerprint(batch, size)):
            raise UsageError("this loader serves each process other batches, and every process reads it whole: "
                             "seed its random draws alike in every process (torch.manual_seed, or a generator for "
                             "its sampler), or keep its batches per process with global_batch=False")

"""A user's DataLoader, set up for one process of a job: its settings kept, its sampler replaced by this process's
share of one global order, batches moved to the device, and the epoch advanced on every pass."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
    default_collate,
)
from torch.utils.data.distributed import DistributedSampler

from .. import lifeline
from ..dist import progress
from ..errors import UsageError
from .images import ImageData

# what a DataLoader was built with, besides its dataset, batch and sampler: carried over unchanged
KEPT = [name for name in ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                          "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")
        if name in inspect.signature(DataLoader).parameters]


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


class GlobalOrder(Sampler[int]):
    """One order of the whole dataset per epoch (a seeded permutation, or 0..n-1), the same in every process,
    dealt out by rank: index i of the order goes to process i % world. With a per-process batch b, step k of
    the N processes together takes positions k*N*b .. (k+1)*N*b - 1: the step one process takes at batch N*b.

    The order is padded with its first indices to a multiple of the world (as DistributedSampler does, whose
    order this is exactly), or, with `drop_last`, cut to whole global steps of `step` samples."""

    def __init__(self, size: int, rank: int = 0, world: int = 1, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, step: int = 1):
        self.size, self.rank, self.world, self.shuffle, self.seed = size, rank, world, shuffle, seed
        self.drop_last, self.step, self.epoch = drop_last, step, 0
        self.start = 0  # positions of the order served already (a resumed epoch): skipped, never loaded

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        """This process's indices for the epoch, as one tensor (listing 262,144 of them in Python takes ~45 ms)."""
        if self.shuffle:
            indices = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            indices = torch.arange(self.size)
        if self.drop_last:
            indices = indices[: self.size // self.step * self.step]
        elif self.size % self.world:
            total = -(-self.size // self.world) * self.world
            indices = indices.repeat(-(-total // self.size))[:total]
        return indices[self.rank::self.world][self.start // self.world:]

    def __iter__(self):
        return iter(self.order().tolist())

    def __len__(self) -> int:
        total = self.size // self.step * self.step if self.drop_last else -(-self.size // self.world) * self.world
        return max(0, total - self.start) // self.world


class InMemory:
    """Batches cut straight from in-memory tensors: each epoch the sampler's order comes as one index tensor,
    split into batches, each fetched by one indexing op (no per-sample collation; an ImageData augments a whole
    batch at once). With a `device`, the tensors move there once first: the fast path, no per-step host work."""

    def __init__(self, dataset: TensorDataset, sampler: GlobalOrder | ShardSampler, batch_size: int,
                 device: torch.device | None):
        if device is not None:
            dataset = dataset.to(device) if isinstance(dataset, ImageData) else \
                TensorDataset(*(t.to(device) for t in dataset.tensors))
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.device = dataset.tensors[0].device

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        order = self.sampler.order()
        if not len(order):  # nothing left of a resumed epoch (split would still give one empty chunk)
            return
        for chunk in order.to(self.device).split(self.batch_size):
            yield self.dataset[chunk]


class Sharded:
    """A loader as set up: this process's share, moved to `device`, reshuffled on each pass (no set_epoch to
    remember). Other attributes (dataset, batch_size, ...) are the user's loader's.

    With `accumulate` K, its batches are micro-batches, K to an optimizer step: after each one is served,
    `step_ends` says whether it ends its step, and `share` is its part of that step's samples.

    Its state_dict() is its place in the data (the epoch, and the samples of that epoch's global order served
    so far), so a checkpoint taken after any optimizer step resumes with the next batch, on any number of
    processes that split the same global batch."""

    def __init__(self, inner: DataLoader | InMemory, original: DataLoader, device: torch.device, accumulate: int = 1):
        self.inner, self.original, self.device, self.accumulate, self.epoch = inner, original, device, accumulate, 0
        self.step_ends, self.share = True, 1.0
        self.skip = 0  # samples of the next pass's order to leave out (set by load_state_dict)
        self.place: tuple[int, int] | None = None  # (epoch, samples served) while a pass is under way

    @property
    def sampler(self) -> Sampler:
        sampler = self.inner.sampler
        return sampler.sampler if isinstance(sampler, BatchSampler) else sampler

    @property
    def local_batch_size(self) -> int | None:
        """Samples per (micro-)batch in this process (the DataLoader's batch_size is the global batch)."""
        sampler = self.inner.sampler
        return sampler.batch_size if isinstance(sampler, BatchSampler) else self.inner.batch_size

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next pass takes (for resuming); passes count on from it."""
        self.epoch, self.skip = epoch, 0

    @property
    def global_micro_batch(self) -> int:
        """Samples of the global order that one batch of every process takes together."""
        return (self.local_batch_size or 1) * getattr(self.sampler, "world", getattr(self.sampler, "num_replicas", 1))

    def state_dict(self) -> dict:
        epoch, served = self.place if self.place is not None else (self.epoch, 0)
        state = {"epoch": epoch, "samples": served}
        generator = getattr(self.inner, "generator", None)
        if generator is not None:  # it seeds the loader's workers on each pass
            state["generator"] = generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        epoch, samples = int(state["epoch"]), int(state["samples"])
        if samples % self.global_micro_batch:
            raise UsageError(f"the checkpoint stopped {samples} samples into epoch {epoch + 1}, not a whole number "
                             f"of global batches of {self.global_micro_batch}: resume with the same --batch-size")
        generator = getattr(self.inner, "generator", None)
        if generator is not None and "generator" in state:
            generator.set_state(state["generator"])
        self.epoch, self.skip, self.place = epoch, samples, None

    def __len__(self) -> int:
        return len(self.inner)

    def micro_batch_sizes(self) -> list[int]:
        """This process's samples in each batch of a pass: all full but the last (the sampler's remainder)."""
        count, size = len(self), self.local_batch_size or 1
        drops = getattr(self.inner, "drop_last", False)
        last = size if drops or not count else len(self.sampler) - (count - 1) * size
        return [size] * (count - 1) + [last] if count else []

    def __iter__(self):
        epoch, skip, g = self.epoch, self.skip, self.global_micro_batch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        ordered = isinstance(self.sampler, GlobalOrder)
        if ordered:  # the served part of a resumed epoch is left out of the order: never loaded
            self.sampler.start = skip
        self.epoch, self.skip, self.place = epoch + 1, 0, (epoch, skip)
        k, drop = self.accumulate, 0 if ordered else skip // g  # a sampler of the user's: read and dropped
        sizes = self.micro_batch_sizes() if k > 1 else []
        # batches cut on the device already need no move (~5 µs a step)
        there = isinstance(self.inner, InMemory) and self.inner.device == self.device
        for i, batch in enumerate(self.inner):
            if i < drop:
                continue
            if k > 1:
                step = sizes[i // k * k: i // k * k + k]
                self.step_ends, self.share = i % k == k - 1 or i == len(sizes) - 1, sizes[i] / sum(step)
            self.place = (epoch, skip + (i + 1 - drop) * g)
            progress()  # for the launcher: this process is not stuck (it names a rank that stops, if one does)
            yield batch if there else to_device(batch, self.device)
        if ordered:
            self.sampler.start = 0
        self.place = None

    def __getattr__(self, name: str) -> Any:
        if name == "original":  # not set yet (unpickling): no loop through __getattr__
            raise AttributeError(name)
        return getattr(self.original, name)


def shard(loader: DataLoader, *, train: bool, rank: int, world: int, device: torch.device,
          local_batch: Callable[..., int], seed: int, global_batch: bool = True,
          device_data: bool | str | None = False, accumulate: int = 1) -> Sharded:
    """`loader` rebuilt for this process (see Multicard.setup_dataloader, which documents the rules)."""
    if isinstance(loader, Sharded):
        raise UsageError("this DataLoader was set up already: pass the one you built")
    if not isinstance(loader, DataLoader):
        raise UsageError(f"setup_dataloader takes a torch.utils.data.DataLoader, not {type(loader).__name__}")
    dataset, accumulate = loader.dataset, accumulate if train else 1  # evaluation takes no optimizer steps
    if isinstance(dataset, IterableDataset):
        raise UsageError("an IterableDataset cannot be dealt out by index: give each process its own part "
                         "(mc.rank of mc.world_size), or use a map-style dataset")
    if isinstance(loader.sampler, DistributedSampler):  # sharded by the user already: not a second time
        if device_data is True:
            raise UsageError("device_data=True needs a TensorDataset without a DistributedSampler of its own")
        return Sharded(loader, loader, device, accumulate)
    if loader.batch_size is None:
        raise UsageError("this DataLoader has a batch_sampler of its own, which multicard cannot deal out; "
                         "give it batch_size (and shuffle) instead, or shard it yourself with a DistributedSampler")
    if type(loader.sampler) not in (RandomSampler, SequentialSampler) or \
            (isinstance(loader.sampler, RandomSampler) and (loader.sampler.replacement or
                                                            loader.sampler.num_samples != len(dataset))):
        raise UsageError(f"this DataLoader draws with a {type(loader.sampler).__name__}, which multicard cannot "
                         f"deal out over processes; use shuffle=True or False, or a DistributedSampler of your own")
    batch = loader.batch_size
    if not train:  # evaluation: any split is exact, so no batch size is refused
        local = -(-batch // world) if global_batch else batch
    elif global_batch:
        local = local_batch(batch, accumulate)
    elif batch % accumulate:
        raise UsageError(f"the DataLoader's batch_size {batch} does not split into {accumulate} micro-batches")
    else:
        local = batch // accumulate
    if train:
        generator = getattr(loader.sampler, "generator", None)
        order = GlobalOrder(len(dataset), rank, world, shuffle=isinstance(loader.sampler, RandomSampler),
                            seed=generator.initial_seed() if generator is not None else seed,
                            drop_last=loader.drop_last, step=local * world * accumulate)
    else:
        order = ShardSampler(len(dataset), rank, world)
    whole_batches = isinstance(dataset, TensorDataset) and loader.collate_fn is default_collate
    if device_data in (None, "auto"):
        device_data, why = on_card(dataset.tensors, device) if whole_batches else (False, "")
        if why and rank == 0:
            print(f"multicard: {why}", file=sys.stderr, flush=True)
    if device_data and not whole_batches:
        raise UsageError("device_data=True needs a TensorDataset and the default collate_fn")
    if whole_batches and (device_data or loader.num_workers == 0):
        return Sharded(InMemory(dataset, order, local, device if device_data else None), loader, device, accumulate)
    kept = {name: getattr(loader, name) for name in KEPT}
    kept["worker_init_fn"] = lifeline.in_worker(loader.worker_init_fn)  # workers end with this process
    if whole_batches:  # loader workers fetch whole batches by one index each: still no per-sample collation
        inner = DataLoader(dataset, batch_size=None, sampler=BatchSampler(order, local, drop_last=False), **kept)
    else:
        inner = DataLoader(dataset, batch_size=local, sampler=order, collate_fn=loader.collate_fn, **kept)
    return Sharded(inner, loader, device, accumulate)


def on_card(tensors: Iterable[torch.Tensor], device: torch.device, free: int | None = None) -> tuple[bool, str]:
    """device_data "auto": whether to hold a dataset's `tensors` on `device`, and why not where it falls back. On a
    card: when they take at most a quarter of the card's free memory (`free`, asked of CUDA where not given); the
    rest stays for the model, its activations and other loaders. On the CPU the data is in memory already."""
    if device.type != "cuda":
        return False, ""
    size = sum(t.numel() * t.element_size() for t in tensors)
    free = torch.cuda.mem_get_info(device)[0] if free is None else free
    if size <= free // 4:
        return True, ""
    return False, (f"the data ({size / 2**20:,.1f} MB) is more than a quarter of {device}'s free memory "
                   f"({free / 2**20:,.1f} MB): its batches are copied from host memory each step "
                   f"(--device-data puts it on the card anyway)")


def to_device(batch, device: torch.device):
    """Move a tensor, or any tuple / list / dict of them, to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch

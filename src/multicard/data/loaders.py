"""A user's DataLoader, set up for one process of a job: its settings kept, its sampler replaced by this process's
share of one global order (order.py: the plain loader's own), batches moved to the device, and the epoch
advanced on every pass. Pipelines that cannot be dealt out by index (pipelines.py) are read whole by every
process, each keeping its slice of every batch."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    Sampler,
    TensorDataset,
    default_collate,
)
from torch.utils.data.distributed import DistributedSampler

from ..errors import UsageError, note
from ..jobs.devices import to_device
from ..jobs.dist import progress
from ..jobs.launcher_watch import in_worker
from . import uneven
from .habits import Habits
from .images import ImageData
from .keyed import Keyed, Seeded, per_sample, seeded, the_seed
from .order import Agree, Chunks, GlobalOrder, Permutation, ShardSampler, base_seed
from .parts import empty
from .pipelines import Split, read_whole

# what a DataLoader was built with, besides its dataset, batch and sampler: carried over unchanged
KEPT = [name for name in ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                          "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")
        if name in inspect.signature(DataLoader).parameters]


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
        order = self.sampler.order().to(self.device)
        sizes = self.sampler.sizes if isinstance(self.sampler, ShardSampler) else self.batch_size
        # nothing left of a resumed epoch: no batch (split would still give one empty chunk); nor empty ones
        for chunk in order.split(sizes) if len(order) else ():
            if len(chunk):
                yield self.dataset[chunk]
        self.sampler.finish()


class Sharded:
    """A loader as set up: this process's share, moved to `device`, reshuffled on each pass (no set_epoch to
    remember). Other attributes (dataset, batch_size, ...) are the user's loader's.

    With `accumulate` K, its batches are micro-batches, K to an optimizer step: after each one is served,
    `step_ends` says whether it ends its step, and `share` is its part of that step's samples.

    Its state_dict() is its place in the data (the epoch, the samples of that epoch's global order served so far
    or, for a loader read whole, its batches; the generators as the pass began), so a checkpoint taken after any
    optimizer step resumes with the next batch, on any number of processes that split the same global batch."""

    def __init__(self, inner: DataLoader | InMemory, original: DataLoader, device: torch.device, accumulate: int = 1,
                 weights: uneven.Share | None = None, habits: Habits | None = None):
        self.inner, self.original, self.device, self.accumulate, self.epoch = inner, original, device, accumulate, 0
        self.step_ends, self.share = True, 1.0
        self.weights, self.habits = weights or uneven.Share(), habits or Habits()  # the job's (job_state.py)
        self.skip = 0  # samples of the next pass's order to leave out (set by load_state_dict)
        self.place: tuple[int, int] | None = None  # (epoch, samples served) while a pass is under way
        self.started: list[torch.Tensor] = []  # the generators' states as the pass under way began
        self.resumed, self.passes = False, 0  # resumed: the next pass goes on from a checkpoint taken inside it
        # what a checkpoint counts: samples of the global order, or batches of a loader every process reads whole
        self.counts, self.unit = ("batches", 1) if isinstance(inner, Split) else ("samples", self.global_micro_batch)

    @property
    def sampler(self) -> Sampler:
        sampler = self.inner.sampler if self._batches is None else self._batches
        while isinstance(sampler, (BatchSampler, Keyed, Chunks)):
            sampler = sampler.sampler
        return sampler

    @property
    def _batches(self) -> BatchSampler | Chunks | None:
        """What serves the inner loader's batches of indices (None: a loader of the user's batch_size=None)."""
        found = [getattr(self.inner, "batch_sampler", None), self.inner.sampler]
        return next((b for b in found if isinstance(b, (BatchSampler, Chunks))), None)

    @property
    def local_batch_size(self) -> int | None:
        """Samples per (micro-)batch in this process (the DataLoader's batch_size is the global batch)."""
        if isinstance(self.sampler, ShardSampler):
            return self.sampler.batch
        batches = self._batches
        return batches.batch_size if isinstance(batches, BatchSampler) else self.inner.batch_size

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next pass takes (for resuming); passes count on from it."""
        self.epoch, self.skip = epoch, 0

    @property
    def global_micro_batch(self) -> int:
        """Samples of the global order that one batch of every process takes together."""
        return (self.local_batch_size or 1) * getattr(self.sampler, "world", getattr(self.sampler, "num_replicas", 1))

    @property
    def generators(self) -> list[torch.Generator]:
        """The user's generators the plain loader draws from: its own, and its sampler's where that is another."""
        found = [self.original.generator, getattr(self.sampler, "draws", None) and self.sampler.draws.generator]
        for user in (self.original.sampler, self.original.batch_sampler):
            found += [getattr(user, "generator", None), getattr(getattr(user, "sampler", None), "generator", None)]
        return [g for i, g in enumerate(found) if g is not None and all(g is not h for h in found[:i])]

    def state_dict(self) -> dict:
        """{"epoch", "samples" (or "batches", for a loader read whole), "generators": their state as this pass
        began (a resumed pass draws its order again), "seed": the pass's seed drawn from the global RNG}."""
        epoch, served = self.place if self.place is not None else (self.epoch, 0)
        state = {"epoch": epoch, self.counts: served}
        states = self.started if self.place is not None else [g.get_state() for g in self.generators]
        if states:
            state["generators"] = states
        seed = getattr(getattr(self.sampler, "draws", None), "seed", None)
        if self.place is not None and seed is not None:
            state["seed"] = seed
        return state

    def load_state_dict(self, state: dict) -> None:
        epoch, served = int(state["epoch"]), int(state.get(self.counts, 0))
        if served % self.unit:
            raise UsageError(f"the checkpoint stopped {served} samples into epoch {epoch + 1}, not a whole number "
                             f"of global batches of {self.unit}: resume with the same --batch-size")
        for generator, saved in zip(self.generators, state.get("generators", ()), strict=False):
            generator.set_state(saved)
        if "seed" in state and isinstance(self.sampler, GlobalOrder) and self.sampler.draws is not None:
            self.sampler.draws.resume_seed = int(state["seed"])
        self.epoch, self.skip, self.place, self.resumed = epoch, served, None, served > 0

    def __len__(self) -> int:
        return len(self.sampler.sizes) if isinstance(self.sampler, ShardSampler) else len(self.inner)

    def micro_batch_sizes(self) -> list[int]:
        """This process's samples in each batch of a pass: all full but the last (the sampler's remainder)."""
        count, size = len(self), self.local_batch_size or 1
        drops = getattr(self.inner, "drop_last", False)
        last = size if drops or not count else len(self.sampler) - (count - 1) * size
        return [size] * (count - 1) + [last] if count else []

    def __iter__(self):
        epoch, skip, g = self.epoch, self.skip, self.unit
        order, batches, split = self.sampler, self._batches, isinstance(self.inner, Split)  # looked up once a pass
        if hasattr(order, "set_epoch") and not split:  # a user's sampler in a Split
            order.set_epoch(epoch)  # is left to the user's script, as on one card
        ordered = isinstance(order, GlobalOrder)
        if ordered:  # the served part of a resumed epoch is left out of the order: never loaded
            order.start = skip
        if batches is not None and isinstance(batches.sampler, Keyed):
            batches.sampler.epoch = epoch  # seed_per_sample: the draws are keyed by this epoch
        self.started = [generator.get_state() for generator in self.generators]
        self.epoch, self.skip, self.place = epoch + 1, 0, (epoch, skip)
        k, drop = self.accumulate, 0 if ordered else skip // g  # a sampler of the user's: read and dropped
        sizes = self.micro_batch_sizes() if k > 1 else []
        # batches cut on the device already need no move (~5 µs a step)
        there = isinstance(self.inner, InMemory) and self.inner.device == self.device
        served, forwards, batch = 0, 0, None
        for i, batch in enumerate(self._start_pass()):
            if i < drop:
                continue
            if k > 1:
                step = sizes[i // k * k: i // k * k + k]
                self.step_ends, self.share = i % k == k - 1 or i == len(sizes) - 1, sizes[i] / sum(step)
            if ordered:  # this process's rows of a short last step, weighted as one process weighs them
                self.weights.record(*uneven.loader_weight(order.size, order.total, order.batch, k, order.rank,
                                                          order.world, skip // g + i, self.share))
            elif not split:  # a batch of its own: no earlier split's weight goes on to it
                self.weights.record(1.0)
            self.place = (epoch, skip + (i + 1 - drop) * g)
            progress()  # for the launcher: this process is not stuck (it names a rank that stops, if one does)
            if skip and served == 1 and self.habits.forwards == forwards and self._rank == 0:  # the first batch of
                self.habits.skipped_twice(epoch, skip, self.counts)  # a resumed pass passed over: the script skips too
            served, forwards = served + 1, self.habits.forwards
            yield batch if there else to_device(batch, self.device)
        for i in range(served, len(self)) if isinstance(order, ShardSampler) else ():
            self.habits.served_empty(order.why_empty(i))  # what the script's error on it is read as
            yield self._empty(batch)  # evaluation: as many batches in every process, this one out of rows
        self.habits.served_empty(None)
        if ordered:
            order.start = 0
        self.weights.record(1.0)  # the pass is over: a batch the script makes itself from here on is not weighted
        self.place = None

    _rank = property(lambda self: getattr(self.inner, "rank", getattr(self.sampler, "rank", 0)))

    def _empty(self, last: Any) -> Any:
        """A batch with no rows, in the structure of this loader's batches (the last one served, or else one cut
        by no index, or the collated first sample, fetched with the random streams put back after it)."""
        if last is None and isinstance(self.inner, InMemory):
            last = self.inner.dataset[torch.zeros(0, dtype=torch.long, device=self.inner.device)]
        elif last is None:
            with seeded(0):
                last = self.original.collate_fn([self.original.dataset[0]])
        return to_device(empty(last), self.device)

    def _start_pass(self) -> Iterator:
        """The inner loader's iterator, started as the plain loader's: its first draw (the workers' base seed)
        taken from the loader's generator or the global RNG; a DataLoader's iterator takes it itself, and only on
        its first pass with persistent workers. A pass resumed from a checkpoint taken inside it leaves the global
        RNG as the checkpoint has it (that draw came before the checkpoint); a generator was set back to the
        pass's start, so it draws again."""
        generator, resumed, self.resumed = self.original.generator, self.resumed, False
        kept = torch.default_generator.get_state() if resumed and generator is None else None
        persistent = self.original.persistent_workers and self.original.num_workers > 0
        if isinstance(self.inner, InMemory) and kept is None and not (persistent and self.passes):
            base_seed(generator)
        self.passes += 1
        batches = iter(self.inner)
        if kept is not None:
            torch.default_generator.set_state(kept)
        return batches

    def __getattr__(self, name: str) -> Any:
        if name == "original":  # not set yet (unpickling): no loop through __getattr__
            raise AttributeError(name)
        return getattr(self.original, name)


def shard(loader: DataLoader, *, train: bool, rank: int, world: int, device: torch.device,
          local_batch: Callable[..., int], agree: Agree | None = None, global_batch: bool = True,
          device_data: bool | str | None = False, accumulate: int = 1, seed_per_sample: bool | int = False,
          weights: uneven.Share | None = None, habits: Habits | None = None) -> Sharded:
    """`loader` rebuilt for this process (see Multicard.setup_dataloader, which documents the rules); the batches
    served are told to the job's `weights` and `habits`."""
    job = {"weights": weights or uneven.Share(), "habits": habits or Habits()}
    if isinstance(loader, Sharded):
        raise UsageError("this DataLoader was set up already: pass the one you built")
    if not isinstance(loader, DataLoader):
        raise UsageError(f"setup_dataloader takes a torch.utils.data.DataLoader, not {type(loader).__name__}")
    dataset, accumulate = loader.dataset, accumulate if train else 1  # evaluation takes no optimizer steps
    seed_per_sample = per_sample(seed_per_sample)
    if seed_per_sample is not False and (isinstance(loader.sampler, DistributedSampler) or read_whole(loader)):
        raise UsageError("seed_per_sample needs a DataLoader with batch_size over a map-style dataset, dealt out by "
                         "multicard (a loader read whole draws in every process what one process draws already)")
    if isinstance(loader.sampler, DistributedSampler):  # sharded by the user already: not a second time
        if device_data is True:
            raise UsageError("device_data=True needs a TensorDataset without a DistributedSampler of its own")
        return Sharded(loader, loader, device, accumulate, **job)
    if read_whole(loader):  # an iterable, a batch sampler, a sampler's own draws: every process reads it whole
        if device_data is True or accumulate > 1:
            raise UsageError(f"{'device_data=True' if device_data is True else 'accumulate'} needs a DataLoader that "
                             f"multicard deals out (batch_size over a map-style dataset, shuffle=True or False); "
                             f"accumulate in your loop (mc.no_backward_sync)")
        return Sharded(Split(loader, rank, world if global_batch else 1, agree, every=not train, **job), loader,
                       device, **job)
    batch = loader.batch_size
    if not train:  # evaluation: any split is exact, so no batch size is refused
        local = -(-batch // world) if global_batch else batch
    elif global_batch:
        local = local_batch(batch, accumulate)
    elif batch % accumulate:
        raise UsageError(f"the DataLoader's batch_size {batch} does not split into {accumulate} micro-batches")
    else:
        local = batch // accumulate
    shuffled = isinstance(loader.sampler, RandomSampler)
    draws = Permutation(len(dataset), loader.sampler.generator, agree if train else None) if shuffled else None
    if train:
        order = GlobalOrder(len(dataset), rank, world, draws, drop_last=loader.drop_last,
                            step=local * world * accumulate, batch=local * world)
    else:  # round-robin shards (gather_in_order relies on it); a shuffling loader's draws still taken
        order = ShardSampler(len(dataset), rank, world, draws, local)
    if global_batch:  # a shape by the DataLoader's batch_size (the global batch) is told in one line
        job["habits"].dealt(batch, local)
    whole_batches = isinstance(dataset, TensorDataset) and loader.collate_fn is default_collate and \
        seed_per_sample is False
    if device_data in (None, "auto"):
        device_data, why = on_card(dataset.tensors, device) if whole_batches else (False, "")
        if why and rank == 0:
            note(why)
    if device_data and not whole_batches:
        raise UsageError("device_data=True needs a TensorDataset, the default collate_fn and no seed_per_sample")
    if whole_batches and (device_data or loader.num_workers == 0):
        inner = InMemory(dataset, order, local, device if device_data else None)
        return Sharded(inner, loader, device, accumulate, **job)
    kept = {name: getattr(loader, name) for name in KEPT}
    kept["worker_init_fn"] = in_worker(loader.worker_init_fn, torch.are_deterministic_algorithms_enabled())
    indices = Keyed(order) if seed_per_sample is not False else order  # Keyed: each index goes with its epoch
    batches = Chunks(indices, order.sizes) if not train else BatchSampler(indices, local, drop_last=False)
    if whole_batches:  # loader workers fetch whole batches by one index each: still no per-sample collation
        inner = DataLoader(dataset, batch_size=None, sampler=batches, **kept)
    else:  # seed_per_sample: the dataset seeds the draws from the epoch and index
        keyed = Seeded(dataset, the_seed(seed_per_sample, agree)) if seed_per_sample is not False else dataset
        inner = DataLoader(keyed, batch_sampler=batches, collate_fn=loader.collate_fn, **kept)
    return Sharded(inner, loader, device, accumulate, **job)


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

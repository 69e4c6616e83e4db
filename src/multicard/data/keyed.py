"""setup_dataloader(seed_per_sample=...): random draws inside a Dataset's __getitem__ keyed by (seed, epoch, index).

A plain script's dataset draws from the global streams (Python's `random`, torch's CPU generator, numpy), one
sample after another, in one process. On N processes seeded alike each process draws the same numbers for other
samples, so N processes match neither one process nor each other; DataLoader workers reseed per worker, so the
draws also depend on the number of workers. With this option each __getitem__ runs with the three streams seeded
from (seed, epoch, index) alone, and put back as they were after it: sample i of epoch e gets the same draws in
any process, any worker, with any number of either, and the rest of the program's draws are not moved. What it
gives up: the plain script's own sequence of draws (one process then draws other numbers than without it).
Draws on a card's generator are not keyed.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import random
from collections.abc import Iterator
from typing import Any

import numpy
import torch
from torch.utils.data import Dataset, Sampler

from ..errors import UsageError
from .order import Agree


def per_sample(value: Any) -> bool | int:
    """setup_dataloader's seed_per_sample as given: True, False, or a seed >= 0 (any integer: numpy's too; a bool
    other than Python's own is refused, as 1 or 0 would be read where a flag was meant)."""
    if isinstance(value, bool):
        return value
    try:
        seed = operator.index(value)
    except TypeError:
        seed = -1
    if seed < 0 or "bool" in f"{type(value).__name__} {getattr(value, 'dtype', '')}":
        raise UsageError(f"seed_per_sample={value!r}: give True (torch's initial seed) or a seed >= 0")
    return seed


def the_seed(seed_per_sample: bool | int, agree: Agree | None) -> int:
    """The seed the draws are keyed by: the one given, or (True) torch's initial seed, the one the script set
    with torch.manual_seed (rank 0's, where processes were seeded apart or not at all)."""
    if not isinstance(seed_per_sample, bool):  # a seed, as per_sample gave it
        return seed_per_sample
    seed = torch.initial_seed() % 2**63
    return seed if agree is None else int(agree(torch.tensor([seed], dtype=torch.int64), "broadcast")[0])


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed that is a function of (seed, epoch, index) alone, well mixed (any change flips about half
    its bits): blake2b, about a microsecond."""
    key = f"{seed}:{epoch}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's CPU generator, `random` and numpy's global generator seeded with `seed` inside; as before after."""
    states = torch.get_rng_state(), random.getstate(), numpy.random.get_state()
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed([seed & 0xFFFFFFFF, seed >> 32])
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        numpy.random.set_state(states[2])


class Keyed(Sampler):
    """The order of `sampler` as (epoch, index) pairs: the epoch travels with each index into the workers."""

    def __init__(self, sampler: Sampler):
        self.sampler, self.epoch = sampler, 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        return ((epoch, index) for index in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class Seeded(Dataset):
    """The user's dataset, each sample fetched with the random streams seeded from (seed, epoch, index)."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        with seeded(sample_seed(self.seed, epoch, index)):
            return self.dataset[index]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        """A batch, sample by sample (each keyed by its own index): the user's own __getitems__ (Subset's,
        StackDataset's) takes indices, not the (epoch, index) keys, and fetches several under one seed."""
        return [self[key] for key in keys]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling in a worker): no loop through __getattr__
            raise AttributeError(name)
        return getattr(self.dataset, name)

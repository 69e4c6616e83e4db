"""The order a set-up loader serves: the permutation the user's plain DataLoader would have drawn, taken from the
same random numbers it would have taken, dealt out over the processes.

A plain `DataLoader(shuffle=True, generator=g)` takes, on each pass: one int64 from `g` as its iterator starts
(the workers' base seed; from torch's global RNG without `g`), then `RandomSampler` draws `randperm(n, g)`
(without a generator of its own: one int64 from the global RNG seeds a fresh generator for it), and once the
permutation has been served, one more `randperm(n, g)` that it throws away. Taking exactly these numbers keeps
the user's generator, and the global RNG that dropout and augmentation draw from, where the plain script has
them: on one process the set-up loader serves the plain loader's batches and leaves the same random state.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch.utils.data import Sampler

from ..errors import UsageError

# between the processes (None on one process): agree(tensor, "broadcast") is rank 0's tensor on every process;
# agree(tensor, "max") the element-wise maximum
Agree = Callable[[torch.Tensor, str], torch.Tensor]


def same_everywhere(agree: Agree, values: torch.Tensor) -> bool:
    """Whether every process holds these `values` (one collective; every process gets the same answer). Integers
    are compared exactly, as int64; other values as float64."""
    exact = not values.is_floating_point()
    values = values.flatten().long() if exact else values.flatten().double()
    mine = torch.cat([values, ~values if exact else -values])  # the max of both: the max and the min
    return bool(torch.equal(agree(mine, "max"), mine))


def base_seed(generator: torch.Generator | None) -> int:
    """The number a DataLoader's iterator draws as it starts (its workers' base seed)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class Permutation:
    """RandomSampler's draws: `draw()` at the start of a pass, `finish()` once the pass has been served.

    Without a generator each process draws its seed from its own global RNG (as the plain loader does, so the
    global RNG moves on as it would); the processes then take rank 0's seed, so that a script whose processes
    were never seeded alike still deals out one order (one broadcast of one number a pass). With a generator
    every process draws from its own copy of it, which must be seeded alike: a first check says so if not."""

    def __init__(self, size: int, generator: torch.Generator | None, agree: Agree | None = None):
        self.size, self.generator, self.agree = size, generator, agree
        self.seed: int | None = None  # the seed of this pass's permutation, drawn from the global RNG
        self.resume_seed: int | None = None  # a resumed pass: that seed again, the global RNG left as it was
        self.checked = False

    def draw(self) -> torch.Tensor:
        if self.generator is not None:
            order = torch.randperm(self.size, generator=self.generator)
            if not self.checked and self.agree is not None:
                self._check(order)
            return order
        seed = self.resume_seed if self.resume_seed is not None else base_seed(None)
        self.resume_seed = None
        if self.agree is not None:
            seed = int(self.agree(torch.tensor([seed], dtype=torch.int64), "broadcast")[0])
        self.seed = seed
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(seed))

    def finish(self) -> None:
        if self.generator is not None:  # a fresh generator's throw-away draw changes nothing anyone sees
            torch.randperm(self.size, generator=self.generator)

    def _check(self, order: torch.Tensor) -> None:
        if not same_everywhere(self.agree, order[:16]):
            raise UsageError("the DataLoader's generator gives each process another order: seed it the same "
                             "in every process (e.g. torch.Generator().manual_seed(42)) and draw from it alike")
        self.checked = True


class Dealt(Sampler[int]):
    """A sampler whose pass is order() (drawn as it starts), then finish(): the last draw of its `draws`."""

    def __iter__(self):
        yield from self.order().tolist()
        self.finish()

    def finish(self) -> None:
        if self.draws is not None:
            self.draws.finish()


class ShardSampler(Dealt):
    """Every `world`-th index from `rank` (position p of the data goes to process p % world, as in training):
    each sample in exactly one shard, none padded or repeated, served in batches of `batch`.

    DistributedSampler pads the last shard with repeats so that shards are equal; for evaluation that would
    count some samples twice. Shards here may differ by one sample, and every process still gets the same number
    of batches (`sizes`), so a collective per batch (a gather of each batch's predictions, fsdp's forward) always
    has its partners. A shuffling loader's permutation is still drawn (and not used), so the random streams move
    on as the plain loader's."""

    def __init__(self, size: int, rank: int = 0, world: int = 1, draws: Permutation | None = None, batch: int = 1):
        self.size, self.rank, self.world, self.draws, self.batch = size, rank, world, draws, batch

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world))

    @property
    def sizes(self) -> list[int]:
        """This process's batch sizes in a pass: the first process's count of batches in every process. A last
        batch left empty takes a row of the one before it; only batches of one row (or fewer samples than
        processes) can leave a process an empty batch (the set-up loader serves it: no rows, the same fields)."""
        mine, most = len(self), len(range(0, self.size, self.world))
        count = -(-most // self.batch)
        sizes = [self.batch] * (count - 1) + [mine - (count - 1) * self.batch] if count else []
        if count > 1 and sizes[-1] == 0 and self.batch > 1:
            sizes[-2:] = [self.batch - 1, 1]
        return sizes

    def why_empty(self, index: int) -> tuple[str, str]:
        """Why this process's evaluation batch `index` has no rows, and what gives it some (for habits.py)."""
        held, count = len(self), len(self.sizes)
        why = f"rank {self.rank}'s evaluation batch {index + 1} of {count} has no rows (the {self.size} samples " \
              f"dealt over {self.world} processes leave it {held}"
        if not held:
            return f"{why}; every process gets as many evaluation batches)", \
                f"evaluate on {self.size} process{'es' * (self.size != 1)} or fewer"
        return f"{why}, one a batch: one batch fewer than rank 0's, and every process gets as many)", \
            f"give the loader a batch_size of {2 * self.world} or more (2 a process): a short last batch then " \
            f"lends a row to every process"

    def order(self) -> torch.Tensor:
        if self.draws is not None:
            self.draws.draw()
        return torch.arange(self.rank, max(self.rank, self.size), self.world)  # none: fewer samples than ranks


class Chunks(Sampler[list]):
    """`sampler`'s items in batches of `sizes` (ShardSampler.sizes), the empty ones left out."""

    def __init__(self, sampler: Sampler, sizes: list[int]):
        self.sampler, self.sizes = sampler, sizes

    def __iter__(self):
        items = iter(self.sampler)
        for size in self.sizes:
            if size:
                yield list(itertools.islice(items, size))
        next(items, None)  # the sampler's pass runs to its end (its finish())

    def __len__(self) -> int:
        return sum(1 for size in self.sizes if size)


class GlobalOrder(Dealt):
    """One order of the whole dataset per pass (the plain loader's permutation, or 0..n-1), the same in every
    process, dealt out by rank: index i of the order goes to process i % world. With a per-process batch b, step
    k of the N processes together takes positions k*N*b .. (k+1)*N*b - 1: the step one process takes at batch N*b.

    With `drop_last` the order is cut to whole global steps of `step` samples. Without, its last global batch of
    `batch` samples (N*b) may be short: it is dealt as it is, the processes' parts differing by one (uneven.py
    weights them by their rows), and only where it has fewer samples than processes do those left without one
    get a repeat of the order's first indices (as DistributedSampler pads), which uneven.py weights 0."""

    def __init__(self, size: int, rank: int = 0, world: int = 1, draws: Permutation | None = None,
                 drop_last: bool = False, step: int = 1, batch: int | None = None):
        self.size, self.rank, self.world, self.draws = size, rank, world, draws
        self.drop_last, self.step, self.batch = drop_last, step, batch or world
        self.start = 0  # positions of the order served already (a resumed epoch): skipped, never loaded

    def order(self) -> torch.Tensor:
        """This process's indices for the pass, drawn now, as one tensor (listing 262,144 of them in Python
        takes ~45 ms). Call it once a pass, and `finish()` once the pass has been served."""
        indices = self.draws.draw() if self.draws is not None else torch.arange(self.size)
        if self.total > self.size:  # the repeats that pad a short last global batch
            indices = indices.repeat(-(-self.total // self.size))
        return indices[:self.total][self.start:][self.rank::self.world]

    @property
    def total(self) -> int:
        """Positions in a pass: whole steps with drop_last; else every sample, plus the repeats that give each
        process a row of a last global batch shorter than the world."""
        if self.drop_last:
            return self.size // self.step * self.step
        short = self.size % self.batch
        return self.size + (self.world - short if 0 < short < self.world else 0)

    def __len__(self) -> int:
        return len(range(self.start + self.rank, self.total, self.world))

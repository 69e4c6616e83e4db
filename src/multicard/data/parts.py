"""This process's part of what every process computes alike: a global batch (made by hand, or read whole from a
loader), a globally drawn random tensor; and random streams that differ per process where a script wants that.

Under the global-batch contract N processes together take the step one process takes. A batch that every
process builds in full (the same data, the same seed) is dealt as the set-up loader deals a global batch: row t
goes to process t % N (rows rank, rank + N, ...), so mc.local, mc.randn_local, a loader read whole and the
set-up loader give a process the same samples; parts differ by at most one row where the batch does not split
evenly. mc.gather_in_order puts the parts back in order.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy
import torch

from ..errors import UsageError
from ..jobs.trees import children, places, remake


def bounds(size: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's part of `size` items: the first size % world ranks take one more."""
    base, extra = divmod(size, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _per_sample(batch: Any, found: list) -> bool:
    """Whether a list or tuple holds one value per sample (strings, numbers: it is cut itself), rather than the
    fields of a batch (tensors, dicts, lists, tuples; a namedtuple's), each cut in turn."""
    return isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields") and \
        not any(isinstance(i, (torch.Tensor, Mapping, list, tuple)) for i in found)


def _axis(tensor: torch.Tensor, dim: int, where: str = "") -> int:
    """`dim` of `tensor` as a non-negative index; one that the tensor does not have is one error."""
    if not -tensor.dim() <= dim < tensor.dim():
        raise UsageError(f"dim={dim}: the batch{where} has {tensor.dim()} dimension{'s' * (tensor.dim() != 1)} "
                         f"(shape {tuple(tensor.shape)}); give the dimension that holds its samples")
    return dim % tensor.dim()


def part(batch: Any, rank: int, world: int, dim: int = 0) -> Any:
    """Rank's rows of `batch` along `dim`, dealt as the set-up loader deals a global batch (rows rank, rank +
    world, ...): a tensor (its part made contiguous), a list / tuple of per-sample values, or dicts, lists,
    tuples, namedtuples and dataclasses of these (each field cut alike, each structure its own type again).
    Strings and other values are kept whole."""
    return _cut(batch, slice(rank, None, world), dim)


def empty(batch: Any) -> Any:
    """`batch` with no rows, in its structure: what a process with no samples left is served."""
    return _cut(batch, slice(0, 0), 0)


def _cut(batch: Any, rows: slice, dim: int) -> Any:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        return batch[(slice(None),) * _axis(batch, dim) + (rows,)].contiguous()
    found = children(batch)  # (trees.py: dicts, lists, tuples, namedtuples, dataclasses)
    if found is None:
        return batch
    return batch[rows] if _per_sample(batch, found) else remake(batch, [_cut(field, rows, dim) for field in found])


def _counts(batch: Any, dim: int, where: str = "") -> Iterator[tuple[str, int]]:
    """(where, rows) for each tensor with rows and each per-sample list in `batch`, in a fixed order."""
    if isinstance(batch, torch.Tensor):
        if batch.dim():
            yield where, batch.size(_axis(batch, dim, where and f" at {where}"))
        return
    found = children(batch)
    if found is not None and _per_sample(batch, found):
        yield where, len(batch)
    elif found is not None:
        for place, field in zip(places(batch), found, strict=True):
            yield from _counts(field, dim, where + place)


def samples(batch: Any, dim: int = 0) -> int | None:
    """How many samples `batch` holds along `dim` (None: nothing to count). Every field must hold as many (one
    process's loss would fail on fields of different lengths): else one error naming them."""
    counts = list(_counts(batch, dim))
    if len({rows for _, rows in counts}) > 1:
        listed = ", ".join(f"{where or 'the batch'}: {rows}" for where, rows in counts)
        raise UsageError(f"the batch's fields hold different numbers of rows along dim {dim} ({listed}): a global "
                         f"batch holds one row per sample in every field; cut each field with its own mc.local")
    return counts[0][1] if counts else None


def drawn_local(draw: str, rank: int, world: int, *global_shape: int, dim: int = 0, seen: Any = None,
                **options: Any) -> torch.Tensor:
    """torch.randn or torch.rand (`draw`)(*global_shape, **options), drawn whole in every process (the same random
    numbers one process draws), of which this process keeps its part along `dim`: the rows of the samples the
    loader dealt it. `seen(whole)`: told the whole draw (the job compares it between the processes)."""
    if len(global_shape) == 1 and isinstance(global_shape[0], (tuple, list, torch.Size)):
        global_shape = tuple(global_shape[0])
    if not -len(global_shape) <= dim < len(global_shape):
        raise UsageError(f"{draw}_local{tuple(global_shape)}, dim={dim}: the shape has no dimension {dim}")
    if global_shape[dim] < world:
        raise UsageError(f"{draw}_local{tuple(global_shape)}: the global shape's size {dim} must be at least the "
                         f"{world} processes, each keeping a part")
    whole = getattr(torch, draw)(*global_shape, **options)
    if seen is not None:
        seen(whole)
    return part(whole, rank, world, dim)


def seed_per_process(seed: int, rank: int) -> int:
    """Seed torch (CPU and every card), Python's `random` and numpy with seed + rank: random
    streams that differ between processes (dropout, augmentation), yet repeat from run to run. Returns the seed
    this process took."""
    mine = seed + rank
    torch.manual_seed(mine)
    random.seed(mine)
    numpy.random.seed(mine % 2**32)
    return mine

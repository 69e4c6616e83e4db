"""This process's part of what every process computes alike: a global batch (made by hand, or read whole from a
loader), a globally drawn random tensor; and random streams that differ per process where a script wants that.

Under the global-batch contract N processes together take the step one process takes. A batch that every
process builds in full (the same data, the same seed) is cut into contiguous parts, rank 0's first; parts differ
by at most one sample where the batch does not split evenly.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..errors import UsageError


def bounds(size: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's part of `size` items: the first size % world ranks take one more."""
    base, extra = divmod(size, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _dataclass_fields(obj: Any) -> list[str] | None:
    """The field names of a dataclass instance (a model's output record), else None."""
    return [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) and \
        not isinstance(obj, type) else None


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(where, value) for every tensor or number in dicts, lists, tuples and dataclasses, in a fixed order."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaves(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from leaves(value, f"{path}[{i}]")
    elif (names := _dataclass_fields(obj)) is not None:
        for name in names:
            yield from leaves(getattr(obj, name), f"{path}.{name}")
    else:
        yield path, obj


def rebuild(obj: Any, values: Iterator) -> Any:
    """`obj`'s structure with its leaves taken in order from `values` (named tuples, list subclasses and
    dataclasses kept: a dataclass is copied, its fields set anew)."""
    if isinstance(obj, dict):
        return type(obj)((k, rebuild(v, values)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        items = [rebuild(v, values) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if (names := _dataclass_fields(obj)) is not None:
        new = copy.copy(obj)
        for name in names:
            object.__setattr__(new, name, rebuild(getattr(obj, name), values))  # frozen ones too
        return new
    return next(values)


def _is_structure(items: list | tuple) -> bool:
    """A list or tuple of tensors (or of dicts, lists, tuples): fields of a batch, each cut in turn. Any other
    list or tuple (strings, numbers) holds one value per sample: it is cut itself."""
    return hasattr(items, "_fields") or any(isinstance(i, (torch.Tensor, Mapping, list, tuple)) for i in items)


def part(batch: Any, rank: int, world: int, dim: int = 0) -> Any:
    """Rank's contiguous part of `batch` along `dim`: a tensor, a list / tuple of per-sample values, or dicts,
    lists and tuples of these (each field cut alike). Strings and other values are kept whole."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        start, stop = bounds(batch.size(dim), rank, world)
        return batch.narrow(dim, start, stop - start)
    if isinstance(batch, Mapping):
        cut = {key: part(value, rank, world, dim) for key, value in batch.items()}
        try:
            return type(batch)(cut)
        except TypeError:  # a mapping that cannot be built from a dict: a plain dict of its fields
            return cut
    if isinstance(batch, (list, tuple)):
        if not _is_structure(batch):
            start, stop = bounds(len(batch), rank, world)
            return batch[start:stop]
        fields = [part(item, rank, world, dim) for item in batch]
        return type(batch)(*fields) if hasattr(batch, "_fields") else type(batch)(fields)
    return batch


def samples(batch: Any, dim: int = 0) -> int | None:
    """How many samples `batch` holds along `dim`: its first tensor's size, or its first per-sample list's length
    (None: nothing to count)."""
    if isinstance(batch, torch.Tensor):
        return batch.size(dim) if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        if not _is_structure(batch):
            return len(batch)
        return next((n for n in (samples(item, dim) for item in batch) if n is not None), None)
    return None


def randn_local(rank: int, world: int, *global_shape: int, dim: int = 0, **options: Any) -> torch.Tensor:
    """torch.randn(*global_shape, **options), drawn whole in every process (the same random numbers one process
    draws), of which this process keeps its part along `dim`."""
    if len(global_shape) == 1 and isinstance(global_shape[0], (tuple, list, torch.Size)):
        global_shape = tuple(global_shape[0])
    if not global_shape or global_shape[dim] < world:
        raise UsageError(f"randn_local{tuple(global_shape)}: the global shape's size {dim} must be at least the "
                         f"{world} processes, each keeping a part")
    return part(torch.randn(*global_shape, **options), rank, world, dim)


def seed_per_process(seed: int, rank: int) -> int:
    """Seed torch (CPU and every card), Python's `random` and numpy (if installed) with seed + rank: random
    streams that differ between processes (dropout, augmentation), yet repeat from run to run. Returns the seed
    this process took."""
    mine = seed + rank
    torch.manual_seed(mine)
    random.seed(mine)
    try:
        import numpy
    except ImportError:
        return mine
    numpy.random.seed(mine % 2**32)
    return mine

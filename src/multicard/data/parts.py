"""This process's part of what every process computes alike: a global batch (made by hand, or read whole from a
loader), a globally drawn random tensor; and random streams that differ per process where a script wants that.

Under the global-batch contract N processes together take the step one process takes. A batch that every
process builds in full (the same data, the same seed) is dealt as the set-up loader deals a global batch: row t
goes to process t % N (rows rank, rank + N, ...), so mc.local, mc.randn_local, a loader read whole and the
set-up loader give a process the same samples; parts differ by at most one row where the batch does not split
evenly. mc.gather_in_order puts the parts back in order.
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


def _axis(tensor: torch.Tensor, dim: int, where: str = "") -> int:
    """`dim` of `tensor` as a non-negative index; one that the tensor does not have is one error."""
    if not -tensor.dim() <= dim < tensor.dim():
        raise UsageError(f"dim={dim}: the batch{where} has {tensor.dim()} dimension{'s' * (tensor.dim() != 1)} "
                         f"(shape {tuple(tensor.shape)}); give the dimension that holds its samples")
    return dim % tensor.dim()


def part(batch: Any, rank: int, world: int, dim: int = 0) -> Any:
    """Rank's rows of `batch` along `dim`, dealt as the set-up loader deals a global batch (rows rank, rank +
    world, ...): a tensor (its part made contiguous), a list / tuple of per-sample values, or dicts, lists and
    tuples of these (each field cut alike). Strings and other values are kept whole."""
    return _cut(batch, slice(rank, None, world), dim)


def empty(batch: Any) -> Any:
    """`batch` with no rows, in its structure: what a process with no samples left is served."""
    return _cut(batch, slice(0, 0), 0)


def _cut(batch: Any, rows: slice, dim: int) -> Any:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        return batch[(slice(None),) * _axis(batch, dim) + (rows,)].contiguous()
    if isinstance(batch, Mapping):
        cut = {key: _cut(value, rows, dim) for key, value in batch.items()}
        try:
            return type(batch)(cut)
        except TypeError:  # a mapping that cannot be built from a dict: a plain dict of its fields
            return cut
    if isinstance(batch, (list, tuple)):
        if not _is_structure(batch):
            return batch[rows]
        fields = [_cut(item, rows, dim) for item in batch]
        return type(batch)(*fields) if hasattr(batch, "_fields") else type(batch)(fields)
    return batch


def _counts(batch: Any, dim: int, where: str = "") -> Iterator[tuple[str, int]]:
    """(where, rows) for each tensor with rows and each per-sample list in `batch`, in a fixed order."""
    if isinstance(batch, torch.Tensor):
        if batch.dim():
            yield where, batch.size(_axis(batch, dim, where and f" at {where}"))
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _counts(value, dim, f"{where}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        if not _is_structure(batch):
            yield where, len(batch)
            return
        for i, item in enumerate(batch):
            yield from _counts(item, dim, f"{where}[{i}]")


def samples(batch: Any, dim: int = 0) -> int | None:
    """How many samples `batch` holds along `dim` (None: nothing to count). Every field must hold as many (one
    process's loss would fail on fields of different lengths): else one error naming them."""
    counts = list(_counts(batch, dim))
    if len({rows for _, rows in counts}) > 1:
        listed = ", ".join(f"{where or 'the batch'}: {rows}" for where, rows in counts)
        raise UsageError(f"the batch's fields hold different numbers of rows along dim {dim} ({listed}): a global "
                         f"batch holds one row per sample in every field; cut each field with its own mc.local")
    return counts[0][1] if counts else None


def randn_local(rank: int, world: int, *global_shape: int, dim: int = 0, **options: Any) -> torch.Tensor:
    """torch.randn(*global_shape, **options), drawn whole in every process (the same random numbers one process
    draws), of which this process keeps its part along `dim`: the rows of the samples the loader dealt it."""
    if len(global_shape) == 1 and isinstance(global_shape[0], (tuple, list, torch.Size)):
        global_shape = tuple(global_shape[0])
    if not -len(global_shape) <= dim < len(global_shape):
        raise UsageError(f"randn_local{tuple(global_shape)}, dim={dim}: the shape has no dimension {dim}")
    if global_shape[dim] < world:
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

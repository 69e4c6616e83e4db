"""The structures a batch or a model's output comes in, walked and rebuilt alike wherever multicard moves, cuts,
deals, gathers, weighs or casts them: tensors and other values in dicts (OrderedDict, defaultdict, a dict subclass
or Mapping of the user's), lists, tuples, namedtuples and dataclasses, each rebuilt as the type it was (a
defaultdict keeps its factory, a subclass its attributes). A torch.Size and a PackedSequence are values, not
structures: a PackedSequence moves by its own .to(), which keeps its batch sizes on the CPU.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence


def children(obj: Any) -> list | None:
    """The children of a structure, in a fixed order; None for a value."""
    if isinstance(obj, Mapping):
        return list(obj.values())
    if isinstance(obj, (list, tuple)) and not isinstance(obj, (torch.Size, PackedSequence)):
        return list(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, field.name) for field in dataclasses.fields(obj)]
    return None


def places(obj: Any) -> list[str]:
    """Where each child of a structure sits, in children()'s order: "[key]", "[i]" or ".field"."""
    if isinstance(obj, Mapping):
        return [f"[{key!r}]" for key in obj]
    if isinstance(obj, (list, tuple)):
        return [f"[{i}]" for i in range(len(obj))]
    return [f".{field.name}" for field in dataclasses.fields(obj)]


def remake(obj: Any, values: list) -> Any:
    """A structure of `obj`'s own type holding `values` in place of its children (in children()'s order)."""
    if type(obj) is dict:
        return dict(zip(obj, values, strict=True))
    if type(obj) is tuple or type(obj) is list:
        return type(obj)(values)
    if isinstance(obj, MutableMapping):  # a copy keeps a defaultdict's factory, a subclass's attributes
        new = copy.copy(obj)
        for key, value in zip(obj, values, strict=True):
            new[key] = value
        return new
    if isinstance(obj, Mapping):  # read-only: built from pairs where it can be, else a plain dict
        try:
            return type(obj)(zip(obj, values, strict=True))
        except TypeError:
            return dict(zip(obj, values, strict=True))
    if isinstance(obj, tuple):
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    if isinstance(obj, list):
        new = copy.copy(obj)  # a list subclass keeps what else it carries
        new[:] = values
        return new
    new = copy.copy(obj)  # a dataclass: its fields set anew (frozen ones too)
    for field, value in zip(dataclasses.fields(obj), values, strict=True):
        object.__setattr__(new, field.name, value)
    return new


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(where, value) for every value in `obj`'s structures, in a fixed order."""
    found = children(obj)
    if found is None:
        yield path, obj
        return
    for where, child in zip(places(obj), found, strict=True):
        yield from leaves(child, path + where)


def values(obj: Any) -> Iterator[Any]:
    """The values in `obj`'s structures, in leaves()'s order (without their places: cheaper)."""
    found = children(obj)
    if found is None:
        yield obj
        return
    for child in found:
        yield from values(child)


def rebuild(obj: Any, values: Iterator) -> Any:
    """`obj`'s structure with its values taken in order from `values` (the order of leaves())."""
    found = children(obj)
    if found is None:
        return next(values)
    return remake(obj, [rebuild(child, values) for child in found])


def map_tensors(fn: Callable[[Any], Any], obj: Any) -> Any:
    """`obj` with fn(t) in place of each tensor (and PackedSequence) in it; other values kept."""
    if isinstance(obj, (torch.Tensor, PackedSequence)):
        return fn(obj)
    found = children(obj)
    if found is None:
        return obj
    return remake(obj, [map_tensors(fn, child) for child in found])

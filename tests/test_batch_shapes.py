"""Batches of every shape a DataLoader makes (issue 40.8): namedtuples, dataclasses and dict subclasses
(OrderedDict, defaultdict, a dict subclass of the user's) come back as they were, through the device move, the
set-up loader (training and evaluation), mc.local, mc.gather_in_order and the set-up model's outputs; on 1, 2 and
3 gloo processes (one job a world size), each process holding the rows the loader deals it."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

import multicard
from multicard.jobs.devices import to_device
from multicard.yourloop.multicard import Multicard

Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    note: str = "kept"


class Tagged(dict):
    """A dict subclass of the user's, with an attribute of its own."""

    def __init__(self, *args, tag: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag


def make(kind: str, i: int):
    x, y = torch.full((2,), float(i)), torch.tensor(i)
    if kind == "namedtuple":
        return Pair(x, y)
    if kind == "ordereddict":
        return collections.OrderedDict([("y", y), ("x", x)])  # its own key order
    if kind == "defaultdict":
        found = collections.defaultdict(list)
        found["x"], found["y"] = x, y
        return found
    if kind == "subclass":
        return Tagged(x=x, y=y, tag="mine")
    return Batch(x, y)


KINDS = ["namedtuple", "ordereddict", "defaultdict", "subclass", "dataclass"]


class Samples(Dataset):
    def __init__(self, kind: str, n: int = 12):
        self.kind, self.n = kind, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return make(self.kind, i)


def collate(kind: str):
    if kind != "dataclass":
        return default_collate
    return lambda items: Batch(torch.stack([b.x for b in items]), torch.stack([b.y for b in items]))


def shape(batch) -> tuple:
    """What must come back as it was: the type, the keys or fields in order, a dict's factory or attributes."""
    keys = list(batch) if isinstance(batch, dict) else batch._fields if isinstance(batch, tuple) else \
        [f.name for f in dataclasses.fields(batch)]
    extra = getattr(batch, "default_factory", None) or getattr(batch, "tag", None) or getattr(batch, "note", None)
    return type(batch).__name__, tuple(keys), extra


def field(batch, name: str) -> torch.Tensor:
    return batch[name] if isinstance(batch, dict) else getattr(batch, name)


class Head(nn.Module):
    """Returns a namedtuple of two tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, batch):
        out = self.lin(field(batch, "x"))
        return Pair(out, out * 2)


def shapes_job(mc: Multicard) -> dict:
    found = {}
    torch.manual_seed(0)
    model = mc.setup(Head())
    for kind in KINDS:
        loader = DataLoader(Samples(kind), batch_size=6, collate_fn=collate(kind))
        train = mc.setup_dataloader(loader)
        first = next(iter(train))
        evaluation = mc.setup_dataloader(DataLoader(Samples(kind, 7), batch_size=mc.world_size * 2,
                                                    collate_fn=collate(kind)), train=False)
        seen = [mc.gather_in_order(batch) for batch in evaluation]
        whole = collate(kind)([make(kind, i) for i in range(6)])
        out = model(mc.local(whole))
        found[kind] = {"train": (shape(first), field(first, "y").tolist()),
                       "gathered": [(shape(b), field(b, "y").tolist()) for b in seen],
                       "local": (shape(mc.local(whole)), field(mc.local(whole), "y").tolist()),
                       "out": (type(out).__name__, out.y.shape[0])}
    return mc.gather(found)


def check(found: dict, world: int, rank: int) -> None:
    for kind in KINDS:
        like = shape(collate(kind)([make(kind, 0)]))
        mine = list(range(rank, 6, world))  # the rows the loader deals this process: rank, rank + N, ...
        assert found[kind]["train"] == (like, mine), kind
        assert found[kind]["local"] == (like, mine), kind
        assert found[kind]["out"] == ("Pair", len(mine)), kind
        gathered = [y for s, ys in found[kind]["gathered"] for y in ys if s == like]
        assert sorted(gathered) == list(range(7)), (kind, found[kind]["gathered"])  # each sample once


def test_every_batch_shape_round_trips_on_one_process():
    with Multicard("single", "cpu") as mc:
        check(shapes_job(mc)[0], 1, 0)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_batch_shape_round_trips_on_n_processes(world):
    ranks = multicard.launch(shapes_job, devices=f"cpu:{world}")
    for rank, found in enumerate(ranks):
        check(found, world, rank)


def test_the_device_move_keeps_every_structure_and_leaves_other_values():
    packed = nn.utils.rnn.pack_padded_sequence(torch.ones(2, 3, 1), torch.tensor([3, 2]), batch_first=True)
    size = torch.Size([2, 3])
    for kind in KINDS:
        batch = make(kind, 3)
        moved = to_device(batch, torch.device("cpu"))
        assert shape(moved) == shape(batch) and torch.equal(field(moved, "x"), field(batch, "x"))
    nested = {"packed": packed, "size": size, "pairs": [Pair(torch.ones(1), "a")]}
    moved = to_device(nested, torch.device("cpu"))
    assert type(moved["packed"]) is type(packed) and moved["size"] is size and moved["pairs"][0].y == "a"

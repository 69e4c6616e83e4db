"""The replica check at the seams (issue 40.5): no false alarm on settings whose text differs between processes
though their value does not (a set of strings, an object whose repr names its address), and no gloo abort where
the ranks reach different checks (mc.check_replicas() on rank 0 alone; a step skipped on one rank only) or
compare different things (a setting one rank alone has): one line naming what differs. On 2 gloo processes, and
3 in the slow suite (one job a world size)."""

from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest
import torch
from torch import nn

import multicard
from multicard.yourloop.multicard import Multicard
from multicard.yourloop.replicas import ReplicasParted

TAGS = {f"tag{i}" for i in range(20)}  # iterated in each process's own string-hash order


class Thing:
    """A setting with no repr of its own: `<...Thing object at 0x...>`, another address in each process."""


@dataclasses.dataclass
class Tagged:
    tags: set
    sizes: tuple


def loop(mc: Multicard, run: Multicard, group: dict, skip_on: int | None = None) -> dict:
    """Six steps of a small set-up loop, checked every 2, with `group`'s extra settings in its param group; rank
    `skip_on` skips its third optimizer step. The line it stopped with (or "not caught"), and what it said."""
    said, line = io.StringIO(), "not caught"
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD([{"params": model.parameters(), **group}], lr=0.1)
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(1))
    try:
        with contextlib.redirect_stderr(said):
            model, optimizer = run.setup(model, optimizer)
            for step in range(1, 7):
                optimizer.zero_grad()
                run.backward(model(run.local(x)).pow(2).mean())
                if not (step == 3 and mc.rank == skip_on):  # as a GradScaler of its own skips on one rank
                    optimizer.step()
    except ReplicasParted as e:
        line = str(e)
    return {"line": line, "said": said.getvalue()}


def seams_job(mc: Multicard) -> dict:
    found = {}
    pad = [object() for _ in range(1 + 997 * mc.rank)]  # each process's Thing at another address
    alike = {"tags": set(TAGS), "thing": Thing(), "fn": lambda p: p, "nested": [{"x": frozenset(TAGS)}],
             "config": Tagged(set(TAGS), (1,))}
    found["alike"] = loop(mc, Multicard("ddp", "cpu", replica_check_every=1), alike)
    found["differ"] = loop(mc, Multicard("ddp", "cpu", replica_check_every=1),
                           {"tags": {"tag0", f"tag{1 + mc.rank}"}})
    found["skipped"] = loop(mc, Multicard("ddp", "cpu", replica_check_every=2), {}, skip_on=mc.world_size - 1)
    found["unlike"] = loop(mc, Multicard("ddp", "cpu", replica_check_every=1),  # a setting the last rank alone has
                           {"label": "head"} if mc.rank == mc.world_size - 1 else {})
    # by hand on rank 0 alone: the others go on into a step of their own (ddp's all-reduce), and wait there
    run = Multicard("ddp", "cpu", timeout=3)
    torch.manual_seed(0)
    model = run.setup(nn.Linear(4, 2))
    if mc.rank == 0:
        try:
            run.check_replicas()
        except ReplicasParted as e:
            found["by hand"] = {"line": str(e)}
    run.backward(model(torch.ones(2, 4)).sum())  # every rank meets here: rank 0 after its line
    del pad
    return mc.gather(found)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_settings_by_value_and_checks_that_part_are_one_line(world):
    ranks = multicard.launch(seams_job, devices=f"cpu:{world}")
    others = ", ".join(map(str, range(1, world)))
    last = world - 1
    for rank, found in enumerate(ranks):
        assert found["alike"]["line"] == "not caught", found["alike"]
        note = "multicard: note: the replica check compares the optimizer's "
        if rank == 0:  # said once, on rank 0: the object and the function compared by their type
            assert found["alike"]["said"].count(note) == 2, found["alike"]["said"]
            assert f"{note}thing (param group 0) by the type of its Thing alone: its repr names its address" in \
                found["alike"]["said"]
        else:
            assert found["alike"]["said"] == ""
        assert found["differ"]["line"].startswith(
            "after mc.setup: the replicas parted: the optimizer's tags (param group 0) is {'tag0', 'tag1'} on rank 0, "
            "{'tag0', 'tag2'} on rank 1"), found["differ"]
        skipped = ", ".join(f"rank {r} after optimizer step {3 if r == last else 4}" for r in range(world))
        assert found["skipped"]["line"].startswith(
            f"the processes reached this replica check after different numbers of optimizer steps: {skipped}; every "
            f"process must call mc.check_replicas() and mc.load at the same point of its loop"), found["skipped"]
        each = ", ".join(f"rank {r}: the optimizer's {'label' if r == last else 'lr'} (param group 0) (a setting)"
                         for r in range(world))
        assert found["unlike"]["line"] == f"after mc.setup: the processes' models or optimizers are not built alike " \
            f"({each}); build them alike", found["unlike"]
    assert ranks[0]["by hand"]["line"].startswith(
        f"at mc.check_replicas(): rank{'s' * (world > 2)} {others} did not reach a replica check within 2.7 s; every "
        f"process must call mc.check_replicas()"), ranks[0]["by hand"]
    assert all("\n" not in f["line"] for r in ranks for f in r.values())


def test_a_setting_is_fingerprinted_by_its_value():
    from multicard.yourloop.fingerprints import number, stable

    assert stable({"b", "a", "c"}) == stable({"c", "a", "b"}) == "{'a', 'b', 'c'}"
    assert number(frozenset({("x", 1), ("y", 2)})) == number(frozenset({("y", 2), ("x", 1)}))
    blind: list[str] = []
    assert stable([Thing(), (1.5,)], blind) == "[<Thing>, (1.5,)]" and blind == ["Thing"]
    assert stable({"a": 1}) != stable({"a": 2}) and number("0.1") != number(0.1)
    assert stable(Tagged({"b", "a"}, (2,))) == "Tagged(tags={'a', 'b'}, sizes=(2,))"

"""What a set-up model trains (its parameters' requires_grad), the same in every process under ddp. DDP's reducer
waits for each trainable parameter's gradient from every process: a process that trains other parameters (a layer
frozen under `if mc.rank == 1:`) would leave the others waiting in a collective until the job's timeout.

Every process tells the job's store, at each forward that arms ddp's reduction, how many it has run and a checksum
of what trains: one message, nothing waited for (2-9 us a forward on 2 gloo processes). At mc.setup, and at a
forward where what trains changed since the wrapper was built (it is then built anew, on every rank alike), the
process also waits for every process to tell that forward and compares: a process that trains other parameters
is one line, said as soon as the others reach that forward (they reach it before they wait for its gradients).
"""

from __future__ import annotations

import time
import zlib
from typing import Any

from torch import nn

from ..errors import UsageError

WAIT = 0.9  # a meeting waits for the other ranks this part of the job's timeout: its line comes before a collective's
ALIKE = ("under ddp every process must train the same parameters (each waits for every trainable parameter's "
         "gradient from all of them): freeze and unfreeze them alike on every rank, not under `if mc.rank == ...`")


def checksum(trains: list[bool]) -> int:
    return zlib.crc32(bytes(trains))


class Trains:
    """One set-up model's parameters and what trains of them, as its wrapper was built; told under `key` in the
    job's `store`, `key`/rank: "forwards checksum changed before" (the forward of the last change, and the checksum
    before it: a rank may be at a later forward already), and at a meeting the mask of what trains ("0110")."""

    def __init__(self, store: Any, key: str, rank: int, world: int, wait_s: float, model: nn.Module):
        self.store, self.key, self.rank, self.world, self.wait_s = store, key, rank, world, wait_s
        self.params = list(model.parameters())
        self.trains = [p.requires_grad for p in self.params]
        self.sum, self.forwards, self.changed = checksum(self.trains), 0, 0
        self.before = self.sum

    def forward(self) -> list[bool] | None:
        """At a forward that arms the reduction: None where what trains is as the wrapper was built (told to the
        store), else what trains now (to meet on: agree)."""
        self.forwards += 1
        trains = [p.requires_grad for p in self.params]
        if trains == self.trains:
            self.store.set(f"{self.key}/{self.rank}", f"{self.forwards} {self.sum} {self.changed} {self.before}")
            return None
        return trains

    def agree(self, trains: list[bool], model: nn.Module, when: str) -> None:
        """Every process trains `trains` at this forward: else one line naming a parameter and the ranks."""
        before, self.trains = self.trains, trains
        self.before, self.sum, self.changed = self.sum, checksum(trains), self.forwards
        mask = "".join("01"[t] for t in trains)
        self.store.set(f"{self.key}/{self.rank}", f"{self.forwards} {self.sum} {self.changed} {self.before} {mask}")
        masks, sums = [], []
        for text in self._gather(when):  # each rank's word at this forward, or at a later one
            _, now, changed, earlier, *told = text.split()
            sums.append(int(now) if int(changed) <= self.forwards else int(earlier))
            masks.append([c == "1" for c in told[0]] if told and int(changed) == self.forwards else
                         before if sums[-1] == checksum(before) else trains if sums[-1] == self.sum else None)
        if any(sum_ != self.sum for sum_ in sums):
            raise UsageError(f"{when}: the processes train different parameters: {_differ(masks, model, sums)}; "
                             f"{ALIKE}")

    def _gather(self, when: str) -> list[str]:
        """Every rank's word, once each has told this forward or a later one (a rank goes on past a forward that
        reduces nothing: after its change there is at most one more, the meeting it waits in)."""
        keys = [f"{self.key}/{rank}" for rank in range(self.world)]
        deadline, pause = time.monotonic() + self.wait_s, 0.0005
        while True:
            said = [v.decode() for v in self.store.multi_get(keys)] if self.store.check(keys) else None
            if said and all(int(s.split()[0]) >= self.forwards for s in said):
                return said
            if time.monotonic() > deadline:
                late = [r for r, k in enumerate(keys) if not self.store.check([k]) or
                        int(self.store.get(k).decode().split()[0]) < self.forwards]
                raise UsageError(f"{when}: rank{'s' * (len(late) > 1)} {', '.join(map(str, late))} did not reach it "
                                 f"within {self.wait_s:g} s (every rank sets up and forwards its set-up models "
                                 f"alike under ddp)")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


def _differ(masks: list, model: nn.Module, sums: list[int]) -> str:
    """The first parameter whose requires_grad differs between the ranks whose masks are known, with them; else
    the ranks that train otherwise than rank 0."""
    known = [(rank, mask) for rank, mask in enumerate(masks) if mask is not None]
    names = [name for name, _ in model.named_parameters()]
    differ = [i for i in range(len(names)) if len({mask[i] for _, mask in known}) > 1]
    if not differ:
        other = [rank for rank, sum_ in enumerate(sums) if sum_ != sums[0]]
        return f"{_ranks(other)} train{'s' * (len(other) == 1)} other parameters than rank 0"
    first = differ[0]
    trains = [rank for rank, mask in known if mask[first]]
    frozen = [rank for rank, mask in known if not mask[first]]
    more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
    return f"{names[first]} trains on {_ranks(trains)} but is frozen on {_ranks(frozen)}{more}"


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"

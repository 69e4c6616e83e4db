"""The replica check: the processes of a job compare a fingerprint of what each holds, so that replicas that part
are caught, whatever the cause (rank-dependent code, a state loaded on one rank, an update outside backward, a
non-deterministic kernel, a bit-flip). Multicard holds one (mc._replicas); docs/your-loop.md says what it sees.

Checked right after setup (fsdp: before it shards the model, as fully_shard, unlike DDP, copies no weights from
rank 0), after mc.load, every `every` steps, and by hand (mc.check_replicas()). The steps are told by the set-up
models' forwards whose backward is reduced (every rank runs those alike, or ddp's reduction would not meet), so
every rank takes each check at the same forward, whatever each rank counted; a loop with no such forward (one
that bypasses the wrapper) is told by its optimizer steps. The optimizer steps counted (calls of step() on an
optimizer set up through mc.setup / mc.setup_optimizers, an fp16 step the scaler skipped included, else steps of
any optimizer over a set-up model's parameters: a process-wide hook of torch) name the check and must agree.
Between checks it costs a counter: no host sync.

Before its first collective, each check meets beside the job (the job's store: no collective): every rank says
which check it is at and the optimizer steps it took. Ranks at different checks (mc.check_replicas() on rank 0
alone meeting another rank's periodic check), or a rank that never comes (it went on into a collective of its
own), end there in one line, never in a collective that mismatches (which gloo aborts). That, and what a check
says where the processes differ: replica_lines.py.

What is compared, and its exact fingerprint (settings by value): fingerprints.py. One max-reduce of [f, -f]
gives every rank the max and the min, so every rank sees the same verdict and all stop together. Only a check
that fails does more: it learns each rank's value and the largest difference, to say it in one line.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .. import rules
from ..errors import note
from ..jobs import protocol
from ..jobs.progress import watched
from ..strategies import Strategy
from .fingerprints import entries, fingerprints, stable
from .precision import wrap_step
from .replica_lines import ReplicasParted, explain, meet, unlike

MODE_VAR, EVERY_VAR = protocol.REPLICA_CHECK, protocol.REPLICA_CHECK_EVERY  # what multicard run passes on
CAUSES = ("usual causes: rank-dependent code (if mc.rank == 0: ...), a state loaded on one rank only, a parameter or "
          "buffer updated outside backward on some ranks (weight clipping, an EMA written back), a non-deterministic "
          "kernel; to go on anyway: Multicard(replica_check='warn' or 'off'), multicard run/train --replica-check "
          "warn|off")


def mode_and_every(mode: str | None, every: int | None) -> tuple[str, int]:
    """The mode and the steps between checks: as given, else from multicard run's flags (the environment),
    else stop and rules.REPLICA_CHECK_EVERY; a bad value is one line."""
    if mode is None:
        mode = os.environ.get(MODE_VAR, "stop")
        said = f"{MODE_VAR}={mode} (multicard run --replica-check)"
    else:
        said = f"replica_check={mode!r}"
    rules.replica_check(mode, said)
    if every is None:
        text = os.environ.get(EVERY_VAR, str(rules.REPLICA_CHECK_EVERY))
        every = int(text) if text.strip().isdigit() else text
        said = f"{EVERY_VAR}={text} (multicard run --replica-check-every)"
    else:
        said = f"replica_check_every={every!r}"
    return mode, rules.replica_check_every(every, said)


class ReplicaCheck:
    """What one Multicard compares: the models and optimizers set up through it. Inactive (nothing hooked, no
    cost) on one process or when off."""

    def __init__(self, strategy: Strategy, mode: str | None = None, every: int | None = None):
        self.mode, self.every = mode_and_every(mode, every)
        self.strategy, self.steps, self.warned, self.closed = strategy, 0, False, False
        self.models: list[tuple[str, nn.Module]] = []  # (the model's class name, the user's model)
        self.optimizers: list[torch.optim.Optimizer] = []  # set up: their step() calls are counted here
        self.job: Any = None  # the JobState, once the Multicard joined its job (its parameters outside the models)
        self.ticks, self.checked, self.since = 0, 0, False  # steps told (see above); the last checked; a reduced
        self.key, self.meetings, self.told = "", 0, set()  # forward since the last optimizer step; where checks meet

    def __getstate__(self) -> dict:
        """A copy (the Multicard pickled into a DataLoader worker) is no process of the job: it compares nothing,
        and carries neither the models nor the hook."""
        return {**self.__dict__, "models": [], "optimizers": [], "job": None, "closed": True}

    @property
    def active(self) -> bool:
        return self.mode != "off" and self.strategy.world > 1 and not self.closed

    @property
    def settings(self) -> tuple[str, int]:
        return self.mode, self.every

    # -- what is compared ------------------------------------------------------------------------------------
    def sharding(self, model: nn.Module) -> None:
        """Before fsdp shards `model`: each process's whole model must be the same (no weights are copied)."""
        if self.active and getattr(self.strategy, "sharded", False):
            self.compare("at mc.setup, before fsdp shards the model (it copies no weights between processes: "
                         "build the model alike on every rank, e.g. after torch.manual_seed, or load it on every "
                         "rank)", [(type(model).__name__, model)], params=True, optimizers=[])

    def set_up(self, model: nn.Module, name: str) -> None:
        """A set-up model (`name`: its class's), compared from now on (by hand only, where the check is off)."""
        if self.strategy.world > 1:
            self.models.append((name, model))

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """A set-up optimizer: its settings compared, its step() calls counted (a bound method still, so LR
        schedulers wrap it as usual)."""
        if self.strategy.world == 1 or any(optimizer is o for o in self.optimizers):
            return
        self.optimizers.append(optimizer)
        if not self.active:
            return

        def counted(plain: Any, *args: Any, **kwargs: Any) -> Any:  # fp16: one call of the loop's is one step
            out = plain(*args, **kwargs)
            self.stepped()
            return out

        wrap_step(optimizer, counted)

    def stepped_elsewhere(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer over a set-up model that did not go through mc.setup is about to step (the job's step
        hook tells it; those set up are counted by their own step)."""
        if self.active:
            self.stepped()

    def forwarded(self) -> None:
        """A set-up model's forward whose backward is reduced is about to run: every `every` of them, a check."""
        self._due()
        self.ticks, self.since = self.ticks + 1, True

    def stepped(self) -> None:
        self.steps += 1
        if self.since:  # told by the forward before it
            self.since = False
            return
        self.ticks += 1  # no reduced forward since the last step: the step tells itself
        self._due()

    def _due(self) -> None:
        if self.ticks % self.every == 0 and self.ticks != self.checked and self.active and not self.warned:
            self.checked = self.ticks
            self.check(f"after optimizer step {self.steps}", first=False, kind="periodic")

    def loaded(self, path: Any, state: dict | None) -> None:
        """After mc.load restored `state` (every process must call it then): a state loaded alike?"""
        if state is not None:
            self.check(f"after mc.load({str(path)!r})", kind="load")

    def close(self) -> None:
        """The process group goes down: nothing is compared any more."""
        self.closed = True

    # -- comparing -------------------------------------------------------------------------------------------
    def check(self, when: str, by_hand: bool = False, first: bool = True, kind: str = "setup") -> bool:
        """Compare the set-up models and optimizers now (every process must call it). True where all agree.
        `first`: agree on what is compared (names, shapes, dtypes) in a collective of its own, before the
        fingerprints (whose collective needs the same length everywhere); the periodic checks skip it. `kind`
        (setup, load, by hand, periodic) and the steps taken must be the same on every rank."""
        if not (self.active or by_hand and self.strategy.world > 1) or not (self.models or self.optimizers):
            return True
        return self.compare(when, self.models, params=not getattr(self.strategy, "sharded", False),
                            optimizers=self.optimizers, first=first, kind="by hand" if by_hand else kind)

    def compare(self, when: str, models: list, params: bool, optimizers: list, first: bool = True,
                kind: str = "setup") -> bool:
        self.key, self.meetings = self.key or self.strategy.new_key("replicas"), self.meetings + 1
        meet(self.strategy, self.key, self.meetings, [kind, self.steps, when])
        found = entries(models, params, optimizers)
        found += self.job.params.outside(optimizers) if self.job is not None else []  # parameters outside the models
        self._say_blind(found)
        with torch.no_grad(), watched():
            line = unlike(self.strategy, when, found) if first else None
            if line is None:
                mine, owners = fingerprints(found, self.strategy.device)
                both = self.strategy.all_reduce(torch.cat([mine, -mine]), "max")  # every rank: the max and -min
                differ = torch.nonzero(both[:len(mine)] != -both[len(mine):]).flatten().tolist()  # the host sync
                if not differ:
                    return True
                more = len({owners[i] for i in differ}) - 1
                also = f" (and {more} more tensor{'s' * (more > 1)} or setting{'s' * (more > 1)})" if more else ""
                label, value = found[owners[differ[0]]]
                line = f"{when}: the replicas parted: {explain(self.strategy, label, value, mine[differ[0]])}{also}; " \
                       f"{CAUSES}"
        if self.mode == "warn":
            self.warned = True  # said once: they stay parted, and the automatic checks stop
            if self.strategy.is_main:
                note(f"warning: {line}")
            return False
        raise ReplicasParted(line)

    def _say_blind(self, found: list) -> None:
        """Once for each setting compared by type alone (fingerprints.stable: an object whose repr names its
        address), a note on rank 0's stderr."""
        for label, value in found:
            blind: list[str] = []
            if label in self.told or isinstance(value, torch.Tensor) or not stable(value, blind) or not blind:
                continue
            self.told.add(label)
            if self.strategy.is_main:
                note(f"note: the replica check compares {label} by the type of its "
                     f"{', '.join(sorted(set(blind)))} alone: its repr names its address, which differs between "
                     f"processes")

class Replicas:
    """The method of Multicard (uses its _start() and _replicas)."""

    def check_replicas(self) -> bool:
        """Compare the replicas now: every process must call it (e.g. before a save). The set-up models'
        parameters (not fsdp's shards) and buffers (not BatchNorm's running statistics) and the set-up
        optimizers' settings; where they differ, one line naming what, the ranks and the largest difference,
        raised (replica_check "stop" or "off") or printed on rank 0 ("warn": then it returns False)."""
        self._start()
        return self._replicas.check("at mc.check_replicas()", by_hand=True)

"""What the processes feed their set-up models, alike where multicard cuts it and apart where it does not, checked
where it can be seen cheaply (on 2+ processes; the replica check's mode governs both: "off" checks nothing):

- mc.local cuts each process's rows from the global batch it is passed, and mc.randn_local / rand_local draw a
  global batch whole in every process, so that batch must be the same in every process. A script that never seeds
  draws a batch of its own in each (its shuffle, crops and flips), and each process would train on rows of another
  batch; a draw on some ranks only (an EMA's sample under `if mc.is_main:`) parts the processes' random states
  for good. mc.local's first call is compared at once; later, the draws before the 1st, 2nd, 4th, ... training
  forward up to K, then every K-th (K: the replica check's steps between checks), with torch's random state (one
  all-reduce of ten numbers then, its time beside the forward and backward; nothing between). Batches that differ
  are one line: that the random states parted between two steps (and how to keep a rank's own draw off the shared
  stream), or that they were never seeded alike.
- the first training forward of a set-up model (gradients on, in train mode) compares its inputs, once. The same
  inputs in every process, where nothing multicard deals (a set-up training loader, mc.local, mc.randn_local) fed
  this process, mean that each process reads every batch itself: one process's steps at N times its work. Said
  once, on rank 0 (inputs that differ are a script's own sharding: nothing to say).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..errors import note
from ..jobs.progress import watched
from ..jobs.trees import values

FIRST = 4096  # values of a tensor its fingerprint reads: a bounded cost, whatever the batch's size


class Inputs:
    """What one job compares of the batches its set-up models are fed (the job's state holds it): whether
    something multicard deals fed this process, whether the first training forward was compared, mc.local's calls,
    the forwards that followed draws, and the draws and cuts before the next comparison (their fingerprints summed,
    weighted by their place). `job`: the JobState (its strategy, replica check, steps, and stop_or_warn)."""

    def __init__(self, job: Any) -> None:
        self.job, self.dealt, self.first, self.cuts, self.forwards = job, False, True, 0, 0
        self.since: list = []  # (kind, the call) of each draw or cut before the next forward
        self.sums: torch.Tensor | None = None  # their fingerprints, summed by place (where that forward compares)
        self.streams_alike_at: int | None = None  # the last step whose draws saw the random states alike
        self.started: tuple | None = None  # a comparison under way: its result to come, what it compares, the step

    def cut(self, batch: Any) -> None:
        """mc.local's global `batch`: compared between the processes at once on the first call; later calls at the
        next forward of a set-up model whose gradients are reduced, where that one compares (`compare`)."""
        self.dealt = True
        if self.job.replicas.mode == "off" or "alike" in self.job.warned:
            return
        self.cuts += 1
        if self.cuts > 1:
            self._add(("mc.local", self.cuts), batch)
        elif not _alike(self.job.strategy, _tensors(batch)):
            self.job.stop_or_warn(f"mc.local (call 1): {self._unseeded()}", "alike")

    def drew(self, whole: torch.Tensor) -> None:
        """mc.randn_local / rand_local drew `whole`: compared as mc.local's cuts are (`compare`)."""
        self.dealt = True
        if self.job.replicas.mode != "off" and "alike" not in self.job.warned and self.job.strategy.world > 1:
            self._add(("a draw of mc.randn_local or rand_local", 0), whole)

    def _due(self, forward: int) -> bool:
        """Whether the `forward`-th forward after draws compares them: the 1st, 2nd, 4th, ... up to K, then every
        K-th (K: the replica check's steps between checks)."""
        every = self.job.replicas.every
        return forward % every == 0 or forward <= every and forward & (forward - 1) == 0

    def _add(self, what: tuple[str, int], batch: Any) -> None:
        self.since.append(what)
        if self._due(self.forwards + 1):  # the next forward compares: this batch's fingerprint goes with it
            numbers = fingerprint(_tensors(batch), self.job.strategy.device) * len(self.since)
            self.sums = numbers if self.sums is None else self.sums + numbers

    def compare(self) -> None:
        """A forward of a set-up model whose gradients are reduced is about to run, on every rank alike (ddp and
        fsdp need every rank's). After draws or cuts, at the 1st, 2nd, 4th, ... such forward up to K, then at every
        K-th, their fingerprints and torch's random state's start being compared (one all-reduce of ten numbers,
        not waited for here: its time goes by beside the forward and backward); the comparison started before is
        judged. A draw on some ranks only parts the random states for good, so it is seen at the next comparison;
        the cost: one small all-reduce every K steps (benchmarks/seams.py)."""
        self.judge()
        if not self.since or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        self.forwards += 1
        if self.sums is None or not self._due(self.forwards):
            self.since, self.sums = [], None
            return
        device = self.job.strategy.device
        sums = torch.cat([self.sums, _stream(device) * len(self.since)])
        since, steps = self.since, self.job.steps
        self.sums, self.since = None, []
        with torch.no_grad(), watched():
            self.started = self.job.strategy.all_reduce_later(torch.cat([sums, -sums]), "max"), since, steps

    def finish(self) -> None:
        """The job closes: a comparison under way is waited for, not judged (the process group goes down next)."""
        started, self.started = self.started, None
        if started is not None:
            with contextlib.suppress(Exception):
                started[0]()

    def judge(self) -> None:
        """The comparison under way, judged (at the next step of the job, or the next reduced forward: before the
        step that batches would move): batches that differ are one line; where the random states had been alike
        and parted since, a draw on some ranks only moved them."""
        if self.started is None:
            return
        (result, since, steps), self.started = self.started, None
        with torch.no_grad(), watched():
            both = result()
        differ = (both[:5] != -both[5:]).tolist()  # the host sync: once a step, where there were draws
        if not differ[3] and not differ[4]:
            self.streams_alike_at = steps + 1  # alike as the draws before this step were made
        if not any(differ[:3]):
            return
        kind, call = since[0]
        last = since[-1][1] if since[-1][0] == kind else call
        where = f"{kind} (call{f's {call}-{last}' if last > call else f' {call}'})" if call else kind
        if (differ[3] or differ[4]) and self.streams_alike_at is not None:
            line = (f"{where}, between optimizer steps {self.streams_alike_at} and {steps + 1}: the processes' "
                    f"random states parted there (alike before): a draw on some ranks only, such as a sample "
                    f"under `if mc.is_main:`, moved one rank's torch random state, so each process drew another "
                    f"global batch; keep a draw of one rank off the shared stream: `with torch.random.fork_rng():` "
                    f"around it, or a torch.Generator of its own")
        else:
            line = f"{where}, before optimizer step {steps + 1}: {self._unseeded()}"
        self.job.stop_or_warn(line, "alike")

    def _unseeded(self) -> str:
        return (f"the processes passed different global batches: each cut its rows from a batch it drew itself (a "
                f"shuffle, crop or flip drawn unseeded), so the {self.job.strategy.world} processes do not take one "
                f"process's step; seed every process alike before drawing the batch (torch.manual_seed(0) at the top "
                f"of the script, and random.seed / numpy's where the batch uses them), or let "
                f"mc.setup_dataloader(loader) deal it")

    def forwarded(self, inputs: Any, training: bool) -> None:
        """A set-up model's forward on 2+ processes: the first one that trains compares its `inputs` (every process
        reaches it, as ddp and fsdp need every process's forward)."""
        if not self.first or not training or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        if self.job.replicas.mode == "off":
            return
        self.first, strategy = False, self.job.strategy
        if _alike(strategy, _tensors(inputs)) and not self.dealt and strategy.is_main:
            world = strategy.world
            note(f"warning: the set-up model's first training batch is the same in every process, and no "
                 f"set-up loader or mc.local cut it: each process reads every batch ({world} processes take one "
                 f"process's steps at {world} times its work); pass the loader through mc.setup_dataloader(loader), "
                 f"or cut a batch you build with mc.local(batch)")


def _stream(device: torch.device) -> torch.Tensor:
    """Two int64 numbers: the sum and position-weighted sum of torch's CPU random state read as integers."""
    state = torch.default_generator.get_state()
    bits = state[:len(state) // 8 * 8].view(torch.int64)
    place = torch.arange(1, len(bits) + 1, dtype=torch.int64)
    return torch.stack([bits.sum(), (bits * place).sum()]).to(device)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in `obj` (a PackedSequence by its data)."""
    from torch.nn.utils.rnn import PackedSequence

    return [t.data if isinstance(t, PackedSequence) else t for t in values(obj)
            if isinstance(t, (torch.Tensor, PackedSequence))]


def _alike(strategy: Any, tensors: list[torch.Tensor]) -> bool:
    """Whether every process holds these tensors (their first values, sizes and number): one all-reduce of the
    fingerprint and its negation (max and -min), the same verdict everywhere."""
    mine = fingerprint(tensors, strategy.device)
    with torch.no_grad(), watched():
        both = strategy.all_reduce(torch.cat([mine, -mine]), "max")
    return both.tolist() == torch.cat([mine, -mine]).tolist()


def fingerprint(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Three int64 numbers (data/bits.py): the tensors' shapes and dtypes, and the sum and position-weighted sum
    of each one's first FIRST values read as integers of its element's width. Any dtype, NaNs and empty tensors
    included: equal tensors give equal numbers on any device."""
    from ..data.bits import fingerprint as read

    return read(tensors, device, FIRST)

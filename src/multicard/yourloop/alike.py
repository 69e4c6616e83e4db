"""What the processes feed their set-up models, alike where multicard cuts it and apart where it does not, checked
where it can be seen cheaply (on 2+ processes; the replica check's mode governs both: "off" checks nothing):

- mc.local cuts each process's rows from the global batch it is passed, so that batch must be the same in every
  process. A script that never seeds draws a batch of its own in each (its shuffle, crops and flips), and each
  process would train on rows of another batch. The batch's fingerprint is compared at the first call and at every
  K-th after it (K: the replica check's steps between checks): one all-reduce of six numbers then, nothing
  between. Batches that differ are one line that says to seed: an error, or a warning said once.
- the first training forward of a set-up model (gradients on, in train mode) compares its inputs, once. The same
  inputs in every process, where nothing multicard deals (a set-up training loader, mc.local, mc.randn_local) fed
  this process, mean that each process reads every batch itself: one process's steps at N times its work. Said
  once, on rank 0 (inputs that differ are a script's own sharding: nothing to say).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import note
from ..jobs.progress import watched
from ..jobs.trees import values

FIRST = 4096  # values of a tensor its fingerprint reads: a bounded cost, whatever the batch's size


class Inputs:
    """What one job compares of the batches its set-up models are fed (the job's state holds it): whether
    something multicard deals fed this process, whether the first training forward was compared, mc.local's
    calls, `job`: the JobState (its strategy, replica check, and stop_or_warn)."""

    def __init__(self, job: Any) -> None:
        self.job, self.dealt, self.first, self.cuts = job, False, True, 0

    def cut(self, batch: Any) -> None:
        """mc.local's global `batch`: compared between the processes at the first call and every K-th."""
        self.dealt = True
        check = self.job.replicas
        if check.mode == "off" or "alike" in self.job.warned:
            return
        self.cuts += 1
        calls, strategy = self.cuts, self.job.strategy
        if (calls == 1 or calls % check.every == 0) and not _alike(strategy, _tensors(batch)):
            line = (f"mc.local (call {calls}): the processes passed different global batches: each cut its rows from "
                    f"a batch it drew itself (a shuffle, crop or flip drawn unseeded), so the {strategy.world} "
                    f"processes do not take one process's step; seed every process alike before drawing the batch "
                    f"(torch.manual_seed(0) at the top of the script, and random.seed / numpy's where the batch uses "
                    f"them), or let mc.setup_dataloader(loader) deal it")
            self.job.stop_or_warn(line, "alike")

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


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in values(obj) if isinstance(t, torch.Tensor)]


def _alike(strategy: Any, tensors: list[torch.Tensor]) -> bool:
    """Whether every process holds these tensors (their first values, sizes and number): one all-reduce of the
    fingerprint and its negation (max and -min), the same verdict everywhere."""
    mine = fingerprint(tensors, strategy.device)
    with torch.no_grad(), watched():
        both = strategy.all_reduce(torch.cat([mine, -mine]), "max")
    return both.tolist() == torch.cat([mine, -mine]).tolist()


def fingerprint(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Three int64 numbers: the tensors' sizes, and the sum and position-weighted sum of each one's first FIRST
    values read as integers (a float as its float64 bits), weighted by the tensor's place. Integer sums wrap and
    do not depend on the order of a reduction: equal tensors give equal numbers on any device, NaNs included."""
    total = torch.zeros(3, dtype=torch.int64, device=device)
    for k, tensor in enumerate(tensors, 1):
        t = tensor.detach()
        t = torch.view_as_real(t) if t.is_complex() else t
        if t.dim():  # the rows that hold the first values: no copy of a whole batch that is not contiguous
            t = t[:max(1, -(-FIRST // max(1, t[0].numel())))]
        flat = t.reshape(-1)[:FIRST]
        bits = flat.double().contiguous().view(torch.int64) if flat.is_floating_point() else flat.long()
        place = torch.arange(1, len(bits) + 1, dtype=torch.int64, device=bits.device)
        numbers = torch.stack([bits.new_tensor(tensor.numel()), bits.sum(), (bits * place).sum()])
        total += numbers.to(device) * k
    return total

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
from . import owners

FIRST = 4096  # values of a tensor its fingerprint reads: a bounded cost, whatever the batch's size
_state = {"dealt": False, "first": True, "cuts": 0, "warned": False}


def dealt() -> None:
    """A set-up training loader, or mc.randn_local, deals this process its part."""
    _state["dealt"] = True


def cut(batch: Any) -> None:
    """mc.local's global `batch`: compared between the processes at the first call and every K-th."""
    _state["dealt"] = True
    job = owners.current()
    if job is None or job.mode == "off" or _state["warned"]:
        return
    _state["cuts"] += 1
    calls = _state["cuts"]
    if (calls == 1 or calls % job.every == 0) and not _alike(job.strategy, _tensors(batch)):
        line = (f"mc.local (call {calls}): the processes passed different global batches: each cut its rows from a "
                f"batch it drew itself (a shuffle, crop or flip drawn unseeded), so the {job.strategy.world} "
                f"processes do not take one process's step; seed every process alike before drawing the batch "
                f"(torch.manual_seed(0) at the top of the script, and random.seed / numpy's where the batch uses "
                f"them), or let mc.setup_dataloader(loader) deal it")
        owners.stop_or_warn(job, line, _state)


def forwarded(inputs: Any, training: bool) -> None:
    """A set-up model's forward on 2+ processes: the first one that trains compares its `inputs` (every process
    reaches it, as ddp and fsdp need every process's forward)."""
    if not _state["first"] or not training or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return
    job = owners.current()
    if job is None or job.mode == "off":
        return
    _state["first"] = False
    if _alike(job.strategy, _tensors(inputs)) and not _state["dealt"] and job.strategy.is_main:
        world = job.strategy.world
        note(f"warning: the set-up model's first training batch is the same in every process, and no "
             f"set-up loader or mc.local cut it: each process reads every batch ({world} processes take one "
             f"process's steps at {world} times its work); pass the loader through mc.setup_dataloader(loader), "
             f"or cut a batch you build with mc.local(batch)")


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

"""The Strategy interface: everything that differs between single, dp, dp-balanced and ddp.

The Multicard (yourloop/) calls only these methods, never asks which strategy it has. A strategy wraps the
model AND the criterion, so dp-balanced can keep outputs and losses on the cards without the loop knowing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import rules
from ..errors import UsageError, note
from ..jobs import dist
from ..jobs.devices import Devices, cpu_threads, machine, usable_cores
from ..jobs.dist import Job


class Strategy:
    name = "single"
    timeout_s = 120.0  # how long the rendezvous and each collective may wait for another process

    def __init__(self, devices: Devices, job: Job | None = None, find_unused_parameters: bool = False):
        self.devices = devices
        self.job = job or Job()  # the launched job this process belongs to; set again in start()
        self.find_unused_parameters = find_unused_parameters

    # -- shape of the job ------------------------------------------------------------------------------
    @property
    def processes(self) -> int:
        """How many processes to launch on this machine."""
        return 1

    @property
    def rank(self) -> int:
        return self.job.rank

    @property
    def world(self) -> int:
        """Processes in the whole job: the launcher's count, or the count this strategy will spawn."""
        return self.job.world if self.job.launched else self.processes

    @property
    def is_main(self) -> bool:
        return self.job.rank == 0  # this process prints, shows progress and writes the files

    @property
    def device(self) -> torch.device:
        """Where this process puts its inputs and targets."""
        return torch.device("cuda", self.devices.ids[0]) if self.devices.kind == "cuda" else torch.device("cpu")

    @property
    def cards(self) -> list[int]:
        """The CUDA cards this process drives (their peak memory is reported)."""
        return [self.device.index] if self.device.type == "cuda" else []

    def local_batch(self, global_batch: int, what: str = "--batch-size", hint: str = "", accumulate: int = 1) -> int:
        """Samples per process per micro-batch, from the global batch (samples per optimizer step) cut into
        `accumulate` micro-batches. `what` names the setting in an error, `hint` adds another way out."""
        rules.at_least(global_batch, f"{what} {global_batch}", 1)
        parts = self.world * accumulate
        if global_batch % parts:
            lo, hi = global_batch // parts * parts, -(-global_batch // parts) * parts
            examples = f"{lo} or {hi}" if lo else f"{hi}"
            into = f"{accumulate} micro-batches x {self.world} processes" if accumulate > 1 else \
                f"{self.world} processes"
            raise UsageError(f"{what} {global_batch} does not split over {into}; use a multiple of {parts} "
                             f"(e.g. {examples}){hint}")
        return global_batch // parts

    # -- in the process that trains --------------------------------------------------------------------
    def start(self, job: Job) -> None:
        self.job = job
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:  # each process takes its share of the cores it can keep busy, not all of the machine's
            torch.set_num_threads(cpu_threads(job.local_world, torch.get_num_threads()))

    def join_group(self, job: Job) -> None:
        """This process in a process group: one joined already (by the script, or another Multicard), else the
        job's, joined here and left by the last strategy that used it (leave_group)."""
        if not torch.distributed.is_initialized():
            dist.init(job, self.devices, self.timeout_s)
            _GROUP["ours"] = True
        if self.device.type == "cpu" and job.launched and job.world > 1 and not _GROUP["users"]:
            self.share_cores()  # the first Multicard of this process on the group: every rank's
        _GROUP["users"] += 1
        self.in_group = True

    def leave_group(self) -> None:
        """This strategy is done with the process group: the last to use one it joined leaves it."""
        if getattr(self, "in_group", False):
            self.in_group, _GROUP["users"] = False, _GROUP["users"] - 1
        if _GROUP["users"] == 0 and _GROUP["ours"]:
            _GROUP["ours"], _GROUP["keys"] = False, 0
            dist.teardown()

    def share_cores(self) -> None:
        """CPU, 2+ processes, once the job meets (every rank calls it): the processes on this machine divide its
        cores, however many the launcher said were here (torchrun --nnodes 2 or SLURM's 2 nodes of 1 task, run on
        one machine, tell each it is alone). Where OMP_NUM_THREADS keeps more threads than the cores, one line."""
        here = machine()
        machines = self.gather(here)
        ranks = [rank for rank, m in enumerate(machines) if m == here]
        if len(ranks) > self.job.local_world:
            torch.set_num_threads(cpu_threads(len(ranks), torch.get_num_threads()))
        threads = [t for rank, t in enumerate(self.gather(torch.get_num_threads())) if rank in ranks]
        cores = usable_cores()
        fair = max(1, cores // len(ranks))  # said only where fewer threads would do: one each is the least
        if len(ranks) > 1 and sum(threads) > cores and max(threads) > fair and self.rank == ranks[0]:
            note(f"{len(ranks)} processes on this machine run {sum(threads)} threads on its {cores} cores "
                 f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}): each waits on the others; set "
                 f"OMP_NUM_THREADS={fair} (cores // processes), or unset it and the processes "
                 f"divide the cores")

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """BatchNorm layers that compute their statistics over every process (one process: nothing to do)."""
        return model

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """One line for an optimizer this strategy cannot step (every one can, but fsdp's few)."""

    def wrap_loss(self, fn: Callable) -> Callable:
        """fn(outputs, targets) -> batch mean(s); the wrapped one gives the same over the whole local batch."""
        return fn

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward leaves the gradients unreduced (one process: there is nothing to reduce)."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the gradients of every parameter of `model` to a total norm of max_norm; the norm before."""
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """`tensor` combined over all processes by op (sum, max or min), as a new tensor."""
        return tensor.clone()

    def all_reduce_later(self, tensor: torch.Tensor, op: str) -> Callable[[], torch.Tensor]:
        """all_reduce started now; the function returned waits for it and gives the result (the collective's time
        spent beside the work between)."""
        return lambda: tensor.clone()

    def gather(self, obj: Any) -> list:
        """Every process's `obj`, in rank order."""
        return [obj]

    def broadcast(self, obj: Any, src: int) -> Any:
        """Process `src`'s picklable `obj` on every process."""
        return obj

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Process `src`'s `tensor` written into `tensor` (same shape and dtype) on every process."""
        return tensor

    def barrier(self) -> None:
        """Wait here for every process (one process: nothing to wait for)."""

    def exchange(self, key: str, value: str, timeout_s: float) -> list[str | None]:
        """Every process's `value`, posted under `key` beside the job (no collective: a process that is
        elsewhere, in a collective or gone on, cannot mismatch one), in rank order; None for a process whose
        value did not come within timeout_s."""
        return [value]

    def forget(self, key: str) -> None:
        """This process's value under `key` is read by all: taken away."""

    def new_key(self, prefix: str) -> str:
        """A key of its own beside the job, for something made alike in every process (a replica check): counted
        alike in every process of the group, as each makes its checks in one order."""
        _GROUP["keys"] += 1
        return f"{prefix}/{_GROUP['keys']}"

    def refresh(self, wrapper: nn.Module, model: nn.Module) -> nn.Module:
        """The wrapper to run the next forward: `wrapper`, or one built anew where it can no longer reduce what
        trains (ddp: parameters frozen or unfrozen since it was built)."""
        return wrapper

    def explain(self, error: BaseException, model: nn.Module) -> None:
        """Raise one line for an error of the wrapper's forward that this strategy can say plainly; else return."""

    def stop(self) -> None:
        """Always called, also after an error."""


# The process group is one per process: every strategy in it shares the one joined first, and the last to close
# leaves it (a group the script joined itself, with init_process_group, stays the script's to destroy); "keys":
# the keys its users took beside the job. Module level: the process group is the process's, not a job's.
_GROUP = {"users": 0, "ours": False, "keys": 0}

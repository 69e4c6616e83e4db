"""ddp: one process per card (NCCL) or per CPU slot (gloo), gradients averaged by DistributedDataParallel."""

from __future__ import annotations

import gc

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import dist
from ..devices import cpu_cores
from ..dist import Job
from ..errors import UsageError
from .base import Strategy


class DDP(Strategy):
    name = "ddp"

    @property
    def processes(self) -> int:
        return 1 if self.job.launched else self.devices.count

    @property
    def device(self) -> torch.device:
        if self.devices.kind == "cpu":
            return torch.device("cpu")
        # a process that sees one card uses it, whatever its local rank: that is how srun --gpus-per-task=1
        # (or a launcher that sets CUDA_VISIBLE_DEVICES per process) hands each process its own card
        return torch.device("cuda", self.devices.ids[self.job.local_rank if self.devices.count > 1 else 0])

    def start(self, job: Job) -> None:
        self.job = job
        if self.devices.kind == "cuda" and 1 < self.devices.count <= job.local_rank:
            raise UsageError(f"local rank {job.local_rank} has no card: {self.devices.count} visible here; start "
                             f"one process per card, or show each process one card")
        if self.devices.kind == "cpu":  # each process takes its share of the cores, not all of them
            torch.set_num_threads(max(1, cpu_cores() // job.local_world))
        super().start(job)
        dist.init(job, self.device.type)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        ids = [self.device] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=self.find_unused_parameters)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def reduce(self, sums: torch.Tensor) -> torch.Tensor:
        sums = sums.clone()
        torch_dist.all_reduce(sums)
        return sums

    def gather(self, values: list[float]) -> list[float]:
        parts: list = [None] * self.world
        torch_dist.all_gather_object(parts, values)
        return [v for part in parts for v in part]

    def barrier(self) -> None:
        torch_dist.barrier(device_ids=self.cards or None)

    def stop(self) -> None:
        gc.collect()  # DDP's reducer may sit in a reference cycle: free it while the group is still up
        dist.teardown()

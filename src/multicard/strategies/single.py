"""single: one process on the CPU or one card. The base class already is exactly that, and it makes a process group
of one (gloo on the CPU, NCCL on a card; its store in memory, no port), so that a model that asks torch.distributed
itself (get_world_size, all_reduce, all_gather: MoCo's gathers) runs unchanged; a group joined already is used as
it is."""

from __future__ import annotations

import torch

from ..jobs.dist import Job
from .base import Strategy


class Single(Strategy):
    name = "single"

    def start(self, job: Job) -> None:
        super().start(job)
        if torch.distributed.is_available():
            self.join_group(Job())  # a world of one, whatever launched this process

    def stop(self) -> None:
        self.leave_group()

"""ddp: one process per card (NCCL) or per CPU slot (gloo), gradients averaged by DistributedDataParallel. Processes
that share a card (--devices 0,0, a rehearsal) meet over gloo."""

from __future__ import annotations

import contextlib
import gc
import re
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import UsageError, note
from ..jobs import dist
from ..jobs.devices import Devices, rehearsal
from ..jobs.dist import Job
from . import syncbn
from .base import Strategy
from .trains import WAIT, Trains

UNFINISHED = "Expected to have finished reduction in the prior iteration"  # DDP: a parameter got no gradient


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
        if self.devices.shared and job.rank == 0:  # said before anything that could wait on the others
            note(rehearsal(self.devices))
        super().start(job)
        if torch_dist.is_initialized():  # another Multicard (or the script itself) joined the job already
            _check_group(job, self.devices)
        self.join_group(job)

    def sync_batchnorm(self, model: nn.Module) -> nn.Module:
        if self.device.type == "cuda":
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return syncbn.convert(model)  # torch's runs on cards only

    # A job of one process has nobody to reduce with: no DDP wrapper (its hooks and bucket copies cost ~25% of a
    # LeNet-5 step on a card), and collectives answer as single's do, without a round trip through the group.

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """DDP's wrapper, once every process trains the same parameters (trains.py); a model none of whose
        parameters trains (all frozen: a saliency map w.r.t. the input) has nothing to reduce and runs as it is."""
        if self.world == 1:
            return model
        store = torch_dist.distributed_c10d._get_default_store()  # the job's: no collective
        made = store.add(f"multicard/trains/made/{self.rank}", 1)  # the same count on every rank: the key's
        trains = Trains(store, f"multicard/trains/{made}", self.rank, self.world, WAIT * self.timeout_s, model)
        self.__dict__.setdefault("trained", {})[id(model)] = trains
        trains.agree(trains.trains, model, f"at mc.setup({type(model).__name__})")
        return self._wrapped(model, trains.trains)

    def _wrapped(self, model: nn.Module, trains: list[bool]) -> nn.Module:
        if not any(trains):
            return model
        sparse = [name for name, b in model.named_buffers() if b.layout != torch.strided or b.is_quantized]
        if sparse:  # DDP cannot broadcast them: each process keeps its own (the replica check compares them)
            ignored = getattr(model, "_ddp_params_and_buffers_to_ignore", [])
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [*ignored, *sparse])
        ids = [self.device] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=self.find_unused_parameters)

    def refresh(self, wrapper: nn.Module, model: nn.Module) -> nn.Module:
        """A parameter frozen (or unfrozen) since the wrapper was built: DDP's reducer would wait for its gradient
        (or never reduce it), so a new wrapper is built at this forward, once every rank is found to train the same
        parameters (trains.py), as at setup. Otherwise the same wrapper: a look at each parameter's requires_grad,
        one message to the job's store, no collective."""
        trains = self.__dict__.get("trained", {}).get(id(model))
        now = trains.forward() if trains is not None else None
        if now is None:
            return wrapper
        trains.agree(now, model, f"at forward {trains.forwards} of the set-up {type(model).__name__}")
        if isinstance(wrapper, DistributedDataParallel):
            wrapper._remove_autograd_hooks()  # the old reducer's hooks leave the parameters
        return self._wrapped(model, now)

    def __getstate__(self) -> dict:
        """A copy (in a DataLoader worker) forwards nothing: it carries no set-up models (nor the store)."""
        return {**self.__dict__, "trained": {}}

    def explain(self, error: BaseException, model: nn.Module) -> None:
        """DDP's error at a forward after a backward that left some parameters without a gradient."""
        if UNFINISHED not in str(error):
            return
        trains = [name for name, p in model.named_parameters() if p.requires_grad]  # DDP's indices, in its order
        found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", str(error))
        names = [trains[int(i)] for i in found[1].split() if int(i) < len(trains)] if found else []
        listed = f"parameter{'s' * (len(names) > 1)} {', '.join(names[:4])}{' and more' * (len(names) > 4)}" \
            if names else "some parameters"
        raise UsageError(f"{listed} got no gradient in the last backward (a layer the forward did not use, or an "
                         f"output the loss left out), and ddp waits for every trainable parameter's: pass "
                         f"Multicard(find_unused_parameters=True) (multicard train --find-unused-parameters), or set "
                         f"requires_grad=False on those that never train") from None

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        tensor = tensor.clone()
        if self.world > 1:
            torch_dist.all_reduce(tensor, getattr(torch_dist.ReduceOp, op.upper()))
        return tensor

    def all_reduce_later(self, tensor: torch.Tensor, op: str) -> Callable[[], torch.Tensor]:
        tensor = tensor.clone()
        if self.world == 1:
            return lambda: tensor
        work = torch_dist.all_reduce(tensor, getattr(torch_dist.ReduceOp, op.upper()), async_op=True)

        def result() -> torch.Tensor:
            work.wait()
            return tensor
        return result

    def gather(self, obj: Any) -> list:
        if self.world == 1:
            return [obj]
        parts: list = [None] * self.world
        torch_dist.all_gather_object(parts, obj)
        return parts

    def broadcast(self, obj: Any, src: int) -> Any:
        if self.world == 1:
            return obj
        box = [obj]
        torch_dist.broadcast_object_list(box, src, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if self.world > 1:
            torch_dist.broadcast(tensor, src)
        return tensor

    def barrier(self) -> None:
        if self.world > 1:
            torch_dist.barrier(device_ids=self.cards or None)

    def exchange(self, key: str, value: str, timeout_s: float) -> list[str | None]:
        if self.world == 1:
            return [value]
        store = torch_dist.distributed_c10d._get_default_store()  # the job's, which the process group meets at
        keys = [f"multicard/{key}/{rank}" for rank in range(self.world)]
        store.set(keys[self.rank], value)
        deadline, pause = time.monotonic() + timeout_s, 0.0005
        while not store.check(keys):  # polled: a store's own wait that times out writes lines of its own
            if time.monotonic() > deadline:
                return [store.get(k).decode() if store.check([k]) else None for k in keys]
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        return [v.decode() for v in store.multi_get(keys)]

    def forget(self, key: str) -> None:
        if self.world > 1:
            torch_dist.distributed_c10d._get_default_store().delete_key(f"multicard/{key}/{self.rank}")

    def stop(self) -> None:
        self.__dict__.pop("trained", None)
        gc.collect()  # DDP's reducer may sit in a reference cycle: free it while the group is still up
        self.leave_group()


def _check_group(job: Job, devices: Devices) -> None:
    """A group joined before this Multicard serves it if it is this job's: the same rank, world and a backend
    for this device's tensors (gloo where processes share a card)."""
    world, rank = (job.world, job.rank) if job.launched else (1, 0)
    have = (torch_dist.get_rank(), torch_dist.get_world_size())
    if have != (rank, world):
        raise UsageError(f"this process joined a process group as rank {have[0]} of {have[1]}, but its job says "
                         f"rank {rank} of {world}: destroy that group, or let Multicard join the job")
    backend = str(torch_dist.get_backend())
    if dist.backend_for(devices) == "gloo" and "gloo" not in backend:
        tensors = "tensors of a card shared by processes" if devices.shared else "CPU tensors"
        raise UsageError(f"this process joined a {backend} process group, which cannot reduce {tensors}: "
                         f"join with gloo, or let Multicard join the job")

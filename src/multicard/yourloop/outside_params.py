"""The parameters an optimizer steps outside the set-up models, for one job on 2+ processes (the job's state holds
an OutsideParams): what the set-up models hold, which optimizers went through mc.setup, and two things follow:

- a set-up optimizer's parameters outside every set-up model (a temperature, CLIP's logit scale, an embedding
  table kept beside the model) are the job's: their gradients are averaged over the processes when the optimizer
  steps, as its param groups stand at that moment (a parameter unfrozen later, swapped in, added by
  add_param_group, used on some ranks only: a rank without a gradient gives zeros, so every rank takes part; a
  sparse gradient is averaged and kept sparse). One small all-reduce per dtype and step; none where there is none.
  fp16's scaler step averages them before it unscales (every rank then skips alike);
- an optimizer that was not set up stepping parameters that no set-up model holds (each process trains its own
  copy, and the copies part) is one line at its first such step: an error, or a warning said once, as the replica
  check is set ("off": nothing). mc.local_optimizer(opt) says an optimizer is this process's own (a probe, a
  plain model replayed beside the job): neither averaged nor judged, and not counted among the job's steps.

What torch's own wrappers reduce is nobody's stray: fsdp's DTensors, FSDP1's flat parameters, and the parameters of
a DistributedDataParallel or FullyShardedDataParallel the script built itself (looked for once, where strays are).
Each optimizer is looked at once (again where its parameters changed): between, a step costs a dictionary look-up.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..jobs.progress import watched


class OutsideParams:
    """What one job knows of the parameters its optimizers step. `job`: the JobState (strategy, replica check)."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self.held = WeakIdKeyDictionary()  # parameter -> True: a set-up model holds it
        self.optimizers: weakref.WeakSet = weakref.WeakSet()  # set up through mc.setup / mc.setup_optimizers
        self.own: weakref.WeakSet = weakref.WeakSet()  # mc.local_optimizer: this process's own
        self.seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (parameters, strays)
        self.early: weakref.WeakSet = weakref.WeakSet()  # averaged before this step already (fp16's scaler step)

    def hold(self, parameters: list[torch.nn.Parameter]) -> None:
        """A set-up model's parameters: reduced by its wrapper."""
        for p in parameters:
            self.held[p] = True
        self.seen.clear()

    def set_up(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizers.add(optimizer)
        self.own.discard(optimizer)

    def keep_own(self, optimizer: torch.optim.Optimizer) -> None:
        self.own.add(optimizer)
        self.optimizers.discard(optimizer)

    def strays(self, optimizer: torch.optim.Optimizer) -> list[tuple[int, int, torch.Tensor]]:
        """(param group, position, parameter) of each parameter of `optimizer` that no set-up model holds and no
        wrapper of torch's reduces, as its param groups stand now."""
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        seen = self.seen.get(optimizer)
        if seen is not None and seen[0] == count and all(
                optimizer.param_groups[g]["params"][i] is p for g, i, p in seen[1]):
            return seen[1]
        found = [(g, i, p) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])
                 if not self.job.holds(p) and type(p).__name__ != "DTensor" and not getattr(p, "_is_flat_param", False)]
        if found:
            wrapped = _wrapped_by_torch()
            found = [(g, i, p) for g, i, p in found if id(p) not in wrapped]
        self.seen[optimizer] = count, found
        return found

    def outside(self, optimizers: list[torch.optim.Optimizer]) -> list[tuple[str, torch.Tensor]]:
        """(label, parameter) of the set-up optimizers' parameters outside the set-up models, as their param groups
        stand now: what the replica check compares besides the models."""
        found = []
        for n, optimizer in enumerate(optimizers):
            whose = "the optimizer's" if len(optimizers) == 1 else f"optimizer {n}'s"
            found += [(f"{whose} parameter {i} of param group {g} (outside the set-up models)", p)
                      for g, i, p in self.strays(optimizer)]
        return found

    def before_step(self, optimizer: torch.optim.Optimizer, judge: bool = True) -> bool:
        """`optimizer` is about to step: a set-up one has its outside parameters' gradients averaged; one not set
        up that changes parameters no set-up model holds is said (where this job `judge`s: the newest open one).
        Returns whether the step is the job's (a set-up optimizer's, or one over a set-up model's parameters):
        every rank takes it alike."""
        if optimizer in self.own:
            return False
        if optimizer in self.optimizers:
            if optimizer not in self.early:
                self.average(optimizer)
            self.early.discard(optimizer)
            return True
        found = self.strays(optimizer)
        if judge and found and any(p.grad is not None for _, _, p in found):
            self._say_unowned(optimizer, [p for _, _, p in found])
        return len(found) < sum(len(group["params"]) for group in optimizer.param_groups)

    def average_early(self, optimizer: torch.optim.Optimizer) -> None:
        """Averaged before the step is taken (fp16's scaler, mc.clip_gradients, unscale and look for inf first):
        not again until the step, or the scaler skipping it, is over (`stepped`)."""
        if optimizer in self.optimizers and optimizer not in self.early:
            self.average(optimizer)
            self.early.add(optimizer)

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        self.early.discard(optimizer)

    def average(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients of a set-up optimizer's parameters outside the models, averaged over the processes (a
        rank without one gives zeros; one that none has stays None)."""
        found = [p for _, _, p in self.strays(optimizer)]
        if not found:
            return
        strategy = self.job.strategy
        for dtype in sorted({(p.grad if p.grad is not None else p).dtype for p in found}, key=str):  # alike everywhere
            group = [p for p in found if (p.grad if p.grad is not None else p).dtype == dtype]
            grads = [p.grad.detach().to_dense() if p.grad is not None else torch.zeros_like(p) for p in group]
            flat = torch.cat([g.reshape(-1).to(strategy.device) for g in grads] +
                             [torch.tensor([float(p.grad is not None) for p in group], device=strategy.device,
                                           dtype=grads[0].dtype)])
            with torch.no_grad(), watched():
                total = strategy.all_reduce(flat, "sum")
            sizes = [g.numel() for g in grads]
            for p, mean, had in zip(group, total[:sum(sizes)].split(sizes), total[sum(sizes):].tolist(),
                                    strict=True):
                if had:
                    mean = mean.view_as(p).div_(strategy.world).to(p.device)
                    p.grad = mean.to_sparse() if p.grad is not None and p.grad.is_sparse else mean

    def _say_unowned(self, optimizer: torch.optim.Optimizer, found: list[torch.Tensor]) -> None:
        check = self.job.replicas
        if check.mode == "off" or "strays" in self.job.warned:
            return
        values = sum(p.numel() for p in found)
        what = f"{len(found)} parameter{'s' * (len(found) > 1)} ({values:,} value{'s' * (values > 1)})"
        line = (f"{type(optimizer).__name__}.step() changes {what} that no set-up model holds, and this optimizer "
                f"was not set up: nothing averages their gradients, so the {self.job.strategy.world} processes "
                f"train apart; set them up, model, optimizer = mc.setup(model, optimizer) (for an optimizer built "
                f"after setup, mc.setup_optimizers(optimizer)); where each process should train its own, "
                f"mc.local_optimizer(optimizer)")
        self.job.stop_or_warn(line, "strays")


def _wrapped_by_torch() -> set[int]:
    """ids of the parameters of DDP and FSDP wrappers the script built itself (a scan of the live objects)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    kinds = (DistributedDataParallel, FullyShardedDataParallel)
    return {id(p) for o in gc.get_objects() if issubclass(type(o), kinds) for p in o.module.parameters()}

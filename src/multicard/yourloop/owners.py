"""Who owns the parameters an optimizer steps: the closed world's bookkeeping, for every Multicard of this process
on 2+ processes (they share one job). What the set-up models hold and which optimizers went through mc.setup is
known here, and three things follow:

- an optimizer that was not set up stepping parameters that no set-up model holds (each process trains its own
  copy of them, and the copies part) is one line at its first such step: an error, or a warning said once, as the
  replica check is set ("off": nothing). Looked at once per optimizer (again if its parameters change): between,
  a step costs a dictionary look-up;
- a set-up optimizer's parameters outside every set-up model (a temperature, CLIP's logit scale) are the job's:
  their gradients are averaged over the processes in backward, right after each is accumulated, as DDP does for the
  model's (so a GradScaler or a clip sees the same numbers on every rank). One small all-reduce per such parameter
  and backward; none where there is none;
- every optimizer step of the process is counted: the moment a save is taken at (checkpoints/randoms.py pairs the ranks'
  saves by it).

What torch's own wrappers reduce is nobody's stray: fsdp's DTensors, FSDP1's flat parameters, and the parameters of
a DistributedDataParallel or FullyShardedDataParallel the script built itself (looked for once, where strays are).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import UsageError, note
from ..jobs.progress import watched

_jobs: list = []  # the replica checks of this process's open Multicards on 2+ processes, newest last
_held = WeakIdKeyDictionary()  # parameter -> True: a set-up model holds it
_averaged = WeakIdKeyDictionary()  # a set-up optimizer's parameter outside the models -> its hook's handle
_optimizers: weakref.WeakSet = weakref.WeakSet()  # set up through mc.setup / mc.setup_optimizers
_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (its parameter count, its strays)
_state: dict[str, Any] = {"hook": None, "steps": 0, "warned": False}


def current() -> Any:
    """The newest open job's replica check (its strategy, mode and steps between checks), or None on one process."""
    return _jobs[-1] if _jobs else None


def steps() -> int:
    """Optimizer steps this process took while a job of 2+ processes was open: alike in every rank at one point
    of a loop, so a save is known by it."""
    return _state["steps"]


def opened(check: Any) -> None:
    """A Multicard joined its job (`check`: its ReplicaCheck): on 2+ processes, optimizer steps are watched."""
    if check.strategy.world > 1:
        _jobs.append(check)
        if _state["hook"] is None:
            _state["hook"] = register_optimizer_step_pre_hook(_before_step)


def closed(check: Any) -> None:
    if any(check is job for job in _jobs):
        _jobs.remove(check)
    if not _jobs and _state["hook"] is not None:
        _state["hook"].remove()
        _state["hook"] = None


def held(parameters: list[torch.nn.Parameter]) -> None:
    """A set-up model's parameters: reduced by its wrapper (an averaging hook put on one earlier comes off; what
    each optimizer holds outside the models is looked at again)."""
    if not _jobs:
        return
    for p in parameters:
        _held[p] = True
        handle = _averaged.pop(p, None)
        if handle is not None:
            handle.remove()
    _seen.clear()


def set_up(optimizer: torch.optim.Optimizer) -> None:
    """A set-up optimizer: its parameters outside the set-up models have their gradients averaged from now on."""
    if not _jobs:
        return
    _optimizers.add(optimizer)
    _seen.pop(optimizer, None)
    _known(optimizer)


def strays(optimizer: torch.optim.Optimizer) -> list[tuple[int, int, torch.Tensor]]:
    """(param group, position, parameter) of each parameter of `optimizer` that no set-up model holds and no
    wrapper of torch's reduces."""
    found = [(g, i, p) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])
             if p not in _held and type(p).__name__ != "DTensor" and not getattr(p, "_is_flat_param", False)]
    if found:
        wrapped = _wrapped_by_torch()
        found = [(g, i, p) for g, i, p in found if id(p) not in wrapped]
    return found


def outside(optimizers: list[torch.optim.Optimizer]) -> list[tuple[str, torch.Tensor]]:
    """(label, parameter) of the set-up optimizers' parameters outside the set-up models: what the replica check
    compares besides the models."""
    found = []
    for n, optimizer in enumerate(optimizers):
        whose = "the optimizer's" if len(optimizers) == 1 else f"optimizer {n}'s"
        found += [(f"{whose} parameter {i} of param group {g} (outside the set-up models)", p)
                  for g, i, p in _known(optimizer)[0]]
    return found


def _known(optimizer: torch.optim.Optimizer) -> tuple[list[tuple[int, int, torch.Tensor]], list[torch.Tensor]]:
    """The optimizer's strays, looked at again only where its parameters changed (a set-up optimizer's new ones
    hooked: those are returned second)."""
    count, seen = _count(optimizer), _seen.get(optimizer)
    if seen is not None and seen[0] == count:
        return seen[1], []
    found = strays(optimizer)
    _seen[optimizer] = count, found
    return found, _average(found) if optimizer in _optimizers else []


def _count(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


def _wrapped_by_torch() -> set[int]:
    """ids of the parameters of DDP and FSDP wrappers the script built itself (a scan of the live objects)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    kinds = (DistributedDataParallel, FullyShardedDataParallel)
    return {id(p) for o in gc.get_objects() if issubclass(type(o), kinds) for p in o.module.parameters()}


def _average(found: list[tuple[int, int, torch.Tensor]]) -> list[torch.Tensor]:
    """Hook each parameter that trains: its gradient averaged over the processes once accumulated. Returns those
    hooked now."""
    fresh = [p for _, _, p in found if p.requires_grad and p not in _averaged]
    for p in fresh:
        _averaged[p] = p.register_post_accumulate_grad_hook(_averaged_grad)
    return fresh


def _averaged_grad(parameter: torch.Tensor) -> None:
    job, grad = current(), parameter.grad
    if job is None or grad is None or grad.is_sparse:
        return
    strategy = job.strategy
    with torch.no_grad(), watched():
        total = strategy.all_reduce(grad.detach().to(strategy.device), "sum")
        grad.copy_(total.to(grad.device).div_(strategy.world))


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global pre-step hook: count the step, and look at what it changes (once per optimizer, again where
    its parameters changed; a set-up optimizer's parameters added since have this step's gradients averaged)."""
    _state["steps"] += 1
    found, fresh = _known(optimizer)
    for p in fresh:
        _averaged_grad(p)
    if found and optimizer not in _optimizers and any(p.grad is not None for _, _, p in found):
        _say_unowned(optimizer, [p for _, _, p in found])


def _say_unowned(optimizer: torch.optim.Optimizer, found: list[torch.Tensor]) -> None:
    job = current()
    if job is None or job.mode == "off" or _state["warned"]:
        return
    values = sum(p.numel() for p in found)
    what = f"{len(found)} parameter{'s' * (len(found) > 1)} ({values:,} value{'s' * (values > 1)})"
    line = (f"{type(optimizer).__name__}.step() changes {what} that no set-up model holds, and this optimizer was "
            f"not set up: nothing averages their gradients, so the {job.strategy.world} processes train apart; set "
            f"them up, model, optimizer = mc.setup(model, optimizer) (for an optimizer built after setup, "
            f"mc.setup_optimizers(optimizer)); where each process should train its own, "
            f"Multicard(replica_check='off')")
    stop_or_warn(job, line, _state)


def stop_or_warn(job: Any, line: str, state: dict) -> None:
    """As the replica check `job` is set: `line` stops the job ("stop"), or is a warning said once, on rank 0
    ("warn"; state["warned"] then keeps it from being said again)."""
    if job.mode == "stop":
        raise UsageError(line)
    state["warned"] = True
    if job.strategy.is_main:
        note(f"warning: {line}")

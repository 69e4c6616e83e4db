"""Strategies by name, and the choice of one for a config and a machine: base + one small file per strategy.
A strategy wraps the model and the criterion and holds the collectives. May import errors, rules and jobs only."""

from __future__ import annotations

from ..errors import UsageError
from ..jobs.devices import Devices
from ..jobs.dist import Job
from .balanced import Balanced
from .base import Strategy
from .ddp import DDP
from .dp import DP
from .fsdp import FSDP
from .single import Single

# by name, in rules.STRATEGIES' order (auto: chosen by `choose`)
STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (Single, DDP, DP, Balanced, FSDP)}


def choose(name: str, devices: Devices, job: Job) -> str:
    """Resolve "auto" and reject combinations that cannot work, in one line each. `name` is one of
    rules.STRATEGIES (the caller checked it, naming the flag or the keyword it came from)."""
    if name == "auto":
        return "ddp" if job.world > 1 or devices.count > 1 else "single"
    if name not in ("ddp", "fsdp") and job.world > 1:
        raise UsageError(f"--strategy {name} runs in one process, but {job.launcher} started {job.world}; "
                         f"use --strategy ddp or fsdp")
    if name in ("dp", "dp-balanced") and devices.shared:
        raise UsageError(f"--strategy {name} drives every card from one process: it cannot rehearse more cards on "
                         f"fewer (a card named twice in --devices); rehearse with --strategy ddp or fsdp, or name "
                         f"each card once")
    if name in ("dp", "dp-balanced") and devices.kind != "cuda":
        where = "this machine has none" if devices.note else "--devices chose the CPU"
        raise UsageError(f"--strategy {name} needs CUDA cards, but {where}: use --strategy single, "
                         f"or ddp with --devices cpu:N")
    if name == "single" and devices.count > 1:
        raise UsageError(f"--strategy single trains on one device, but --devices names {devices.count}; "
                         f"use --strategy ddp, or one device")
    return name


def create(name: str, devices: Devices, job: Job, find_unused_parameters: bool = False) -> Strategy:
    return STRATEGIES[choose(name, devices, job)](devices, job, find_unused_parameters)


__all__ = ["STRATEGIES", "Strategy", "choose", "create"]

"""The job of a front object: the strategy chosen from its arguments and the launcher's environment, and the
body of each process that Multicard.launch spawns."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

from torch import nn

from .. import rules, strategies
from ..errors import UsageError
from ..jobs import protocol
from ..jobs.devices import select
from ..jobs.dist import Job
from ..strategies import Strategy
from .precision import DTYPES


def make_strategy(strategy: str | Strategy, devices: str, precision: str, job: Job, *, find_unused_parameters: bool,
                  fsdp_blocks: str, reshard_after_forward: bool, timeout: float) -> Strategy:
    """The strategy for Multicard(...)'s arguments; every combination that cannot work is one clear line."""
    rules.precision(precision, f"precision={precision!r}")
    if isinstance(strategy, Strategy):
        strategy.job = job
    else:
        rules.strategy(strategy, f"strategy={strategy!r}")
        if strategy == "auto":
            strategy = os.environ.get(protocol.STRATEGY, "auto")
            rules.strategy(strategy, f"{protocol.STRATEGY}={strategy} (multicard run --strategy)")
        # in a job multicard started, its launcher chose the devices already (and narrowed the cards)
        devices = os.environ.get(protocol.DEVICES, devices) if job.launcher == "multicard" else devices
        strategy = strategies.create(strategy, select(devices), job, find_unused_parameters)
    rules.timeout(timeout, f"timeout={timeout!r}")  # before any process starts: not once each rank joins
    strategy.timeout_s = timeout
    if getattr(strategy, "sharded", False):
        if precision == "fp16":
            raise UsageError("fsdp takes precision bf16 (its own mixed precision: bf16 compute, fp32 "
                             "reductions) or fp32, not fp16")
        if not hasattr(strategy, "param_dtype"):
            strategy.blocks, strategy.reshard_after_forward = fsdp_blocks, reshard_after_forward
            strategy.param_dtype = DTYPES[precision]
    return strategy


def launched(front: type, strategy: Strategy, precision: str, sync_batchnorm: bool, fn: Callable, args: tuple,
             loggers: list, replicas: tuple[str, int]) -> Any:
    """The body of a process that Multicard.launch spawned: `front` is the Multicard class (handed in, as the
    class imports this module); `replicas`: the replica check's mode and steps between checks."""
    mc = front(strategy, precision=precision, sync_batchnorm=sync_batchnorm,
                   timeout=strategy.timeout_s, loggers=loggers, replica_check=replicas[0],
                   replica_check_every=replicas[1], deterministic=strategy.deterministic)
    args = tuple(copy.deepcopy(a) if isinstance(a, nn.Module) else a for a in args)  # own weights, not shared
    return mc.launch(fn, *args)  # its errors read by the job's explain (launch's progress.plainly)

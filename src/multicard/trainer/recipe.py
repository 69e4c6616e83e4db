"""The trainer's recipe: the optimizer and the learning-rate schedule that a TrainConfig names, or the user's own."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from ..errors import UsageError
from .config import TrainConfig


def make_optimizer(params: list, config: TrainConfig, given: Any = None) -> Optimizer:
    """--optimizer with its settings; or the user's: an optimizer (its class and settings, over this process's
    model: in spawned processes the model is a copy) or a function params -> optimizer."""
    if given is None:
        if config.optimizer == "sgd":
            return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
                                   weight_decay=config.weight_decay)
        kind = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
        try:  # one fused kernel per step where this torch can for these parameters: the same algorithm, faster
            return kind(params, lr=config.lr, weight_decay=config.weight_decay, fused=True)
        except (RuntimeError, TypeError, ValueError):
            return kind(params, lr=config.lr, weight_decay=config.weight_decay)
    if isinstance(given, Optimizer):
        if len(given.param_groups) != 1:
            raise UsageError("optimizer: one with several parameter groups cannot be rebuilt in each process; "
                             "pass a function that builds it from the model's parameters instead")
        group = given.param_groups[0]
        return type(given)(params, **{k: group[k] for k in given.defaults if k in group})
    if callable(given):
        optimizer = given(params)
        if isinstance(optimizer, Optimizer):
            return optimizer
    raise UsageError(f"optimizer: expected a torch optimizer or a function params -> optimizer, got {given!r}")


class Schedule:
    """The learning-rate factor at each optimizer step (for LambdaLR): a linear warm-up over the first
    `warmup` steps, then StepLR's staircase (by epoch), a cosine to 0 over the remaining steps, or flat."""

    def __init__(self, kind: str, steps_per_epoch: int, total: int, warmup: int, lr_step: int, gamma: float):
        self.kind, self.steps_per_epoch, self.total, self.warmup = kind, steps_per_epoch, total, warmup
        self.lr_step, self.gamma = lr_step, gamma

    def __call__(self, step: int) -> float:
        ramp = min(1.0, (step + 1) / self.warmup) if self.warmup else 1.0
        if self.kind == "step":
            return ramp * self.gamma ** (step // self.steps_per_epoch // self.lr_step)
        if self.kind == "cosine":
            done = min(1.0, max(0, step - self.warmup) / max(1, self.total - self.warmup))
            return ramp * 0.5 * (1 + math.cos(math.pi * done))
        return ramp


def make_scheduler(optimizer: Optimizer, config: TrainConfig, steps_per_epoch: int,
                   given: Callable | None = None) -> torch.optim.lr_scheduler.LRScheduler:
    """--scheduler, stepped once per optimizer step (StepLR's staircase still moves once per epoch); or the
    user's function optimizer -> scheduler."""
    if given is not None:
        if isinstance(given, torch.optim.lr_scheduler.LRScheduler) or not callable(given):
            raise UsageError("scheduler: pass a function optimizer -> scheduler (e.g. functools.partial("
                             "torch.optim.lr_scheduler.StepLR, step_size=10)): each process builds its own")
        return given(optimizer)
    total = steps_per_epoch * config.epochs
    warmup = round(config.warmup_epochs * steps_per_epoch)
    if config.scheduler == "onecycle":  # its own rise (warm-up) and fall; momentum cycles where there is one
        moves = config.optimizer != "sgd" or config.momentum > 0
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, config.lr, total_steps=total,
                                                   pct_start=warmup / total if warmup else 0.3, cycle_momentum=moves)
    schedule = Schedule(config.scheduler, steps_per_epoch, total, warmup, config.lr_step, config.lr_gamma)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

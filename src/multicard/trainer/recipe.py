"""The trainer's recipe: the optimizer and the learning-rate schedule that a TrainConfig names, or the user's own;
and a resumed run's, taken from the checkpoint it goes on from (what it keeps, what a flag may change)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

from ..checkpoints.resume import head
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


# A resumed run is the run it continues: it takes that run's recipe unless a flag says otherwise. These cannot
# change half-way (the data order, the weights' history and the schedule's state depend on them): given otherwise,
# they are refused. The global batch is checked by describe(), once it is settled for the job.
KEPT = ("model", "data", "synthetic_samples", "seed", "augment", "optimizer", "lr", "momentum", "nesterov",
        "weight_decay", "scheduler", "lr_step", "lr_gamma", "warmup_epochs")
# these may change on a resume; a change is said in the "resuming from" line (epochs: see inherit)
CHANGEABLE = ("batch_size", "epochs", "accumulate", "precision", "clip_grad_norm", "sync_bn", "eval_batch_size",
              "save_every", "save_every_steps", "keep_checkpoints")
STRETCHED = ("onecycle", "cosine")  # schedules laid over the run's whole length


def inherit(path: Path, config: TrainConfig, given: set[str] | None = None) -> TrainConfig:
    """`config` with the recipe of the run that wrote checkpoint `path` wherever `given` (the fields the user
    set; default: those that differ from TrainConfig's defaults) does not set it. A given field that the run
    cannot change is refused in one line naming its flag, and so is --epochs where the run's schedule spans its
    length (onecycle, cosine: more epochs would train at a rate of 0) or where the run is past it already."""
    given = config.changed() if given is None else given
    given = {name for name in given if getattr(config, name) is not None}  # "auto" given: the run's own
    raw = head(path)
    saved = raw["config"]
    for name in KEPT:
        if name in given and name in saved and getattr(config, name) != saved[name]:
            raise UsageError(f"{flag(name)} {getattr(config, name)}: the run in {path.parent} has {flag(name)} "
                             f"{saved[name]}, which a resume keeps; drop the flag, or start a new run without "
                             f"--resume")
    config = replace(config, **{k: saved[k] for k in (*KEPT, *CHANGEABLE) if k in saved and k not in given})
    if "epochs" in given and saved.get("epochs", config.epochs) != config.epochs:
        done = raw["loader"]["epoch"] + (raw["loader"]["samples"] > 0)
        if config.epochs < done:
            raise UsageError(f"--epochs {config.epochs}: the run in {path.parent} has trained {done} epochs "
                             f"already; resume with --epochs {done} or more")
        if config.scheduler in STRETCHED:
            raise UsageError(f"--epochs {config.epochs}: the run's {config.scheduler} schedule is laid over its "
                             f"{saved['epochs']} epochs (its rate falls to 0 at their end), so a resume keeps them; "
                             f"for {config.epochs} epochs start a new run without --resume")
    return config


def describe(path: Path, config: TrainConfig) -> str:
    """Check that a checkpoint can continue this run (before any process starts); say where it stopped, what
    this run changes of its recipe, and, for a run that had finished, that nothing is left to train."""
    raw = head(path)
    saved = raw["config"]
    if saved["batch_size"] != config.batch_size:
        raise UsageError(f"--resume {path}: that run's global batch was {saved['batch_size']}, this one's is "
                         f"{config.batch_size}: resume with --batch-size {saved['batch_size']} (the data order "
                         f"continues by global batches)")
    place, steps = raw["loader"], raw["steps"]
    changed = [f"{flag(k)} {getattr(config, k)} (it had {saved[k]})" for k in CHANGEABLE
               if k in saved and getattr(config, k) != saved[k]]
    also = f"; changed: {', '.join(changed)}" if changed else ""
    if place["samples"] == 0 and place["epoch"] >= config.epochs:
        return (f"the run had finished its {place['epoch']} epochs ({steps} optimizer steps): nothing left to "
                f"train; its files are written again{also}")
    return f"epoch {place['epoch'] + 1}, {place['samples']} samples in, after {steps} optimizer steps{also}"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")

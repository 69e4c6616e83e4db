"""Precisions of the front object: the autocast dtype of each, outputs handed back in fp32, and fp16's gradient
scaler behind optimizer.step()."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any

import torch

from ..jobs.trees import map_tensors
from ..rules import PRECISIONS

DTYPES = dict(zip(PRECISIONS, (None, torch.bfloat16, torch.float16), strict=True))  # the autocast dtype of each


def autocast(device_type: str, precision: str) -> contextlib.AbstractContextManager:
    """The precision's autocast (nothing for fp32)."""
    dtype = DTYPES[precision]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype)


def step_through_scaler(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, skipped: torch.Tensor,
                        params: Any = None) -> None:
    """fp16: the optimizer's own step() becomes the scaler's step (unscale, skip on inf or nan, update), so
    the loop keeps calling optimizer.step(); `skipped` counts the steps skipped. `params`: the job's OutsideParams
    on 2+ processes (the gradients outside the models averaged before the scaler looks at them)."""

    def scaled(plain: Callable, *args: Any, **kwargs: Any) -> Any:
        before = scaler._scale.clone()
        if params is not None:
            params.average_early(optimizer)
        out = scaler.step(optimizer, *args, **kwargs)
        if params is not None:
            params.stepped(optimizer)
        scaler.update()
        skipped.add_(scaler._scale < before)  # backed off: this step was skipped (no host sync)
        return out

    wrap_step(optimizer, scaled)


def wrap_step(optimizer: torch.optim.Optimizer, around: Callable) -> None:
    """optimizer.step(...) becomes around(plain step, ...), once per call of the loop's: a call that comes back
    while it runs (GradScaler.step calls optimizer.step itself) is the plain step. A bound method still, so LR
    schedulers can wrap it as usual."""
    plain, busy = optimizer.step, []

    def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if busy:
            return plain(*args, **kwargs)
        busy.append(True)
        try:
            return around(plain, *args, **kwargs)
        finally:
            busy.clear()

    if hasattr(plain, "_wrapped_by_lr_sched"):  # an LR scheduler wrapped it already: it still counts the steps
        step._wrapped_by_lr_sched = True
    optimizer.step = types.MethodType(step, optimizer)


def to_fp32(obj: Any) -> Any:
    """Half-precision float tensors in any structure back to float32, the structure kept (dp-balanced's list of
    per-card outputs with its sample counts included)."""
    return map_tensors(_fp32, obj)


def _fp32(value: Any) -> Any:
    half = isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16)
    return value.float() if half else value

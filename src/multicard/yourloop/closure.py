"""optimizer.step(closure) on N processes: the closure's loss handed to the optimizer is the whole batch's.

Optimizers such as LBFGS decide from the loss the closure returns (how many times to call it, when to stop a
line search). On N processes each would decide from its own rows' loss: the processes would call the closure
a different number of times, their gradient reductions would pair up across different calls, and the job would
hang or the replicas part. The set-up optimizer's step wraps the closure so that it returns the loss one
process computes over the whole batch: the mean of the processes' losses, each weighted by its share of the
rows (uneven.py; 1 where the rows split evenly). Every process then sees the same number and takes the same
path; the gradients are reduced by the model already. One all-reduce of one number per closure call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..strategies import Strategy
from . import collectives
from .precision import step_through_scaler, wrap_step


def whole_batch_loss(strategy: Strategy, loss: Any, weight: float) -> torch.Tensor | None:
    """The batch's loss over all processes: the mean of each process's `loss` times its row `weight`."""
    if loss is None:  # a closure that returns nothing: nothing to agree on
        return None
    mine = (loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))) * weight
    return collectives.all_reduce(strategy, mine, "mean").to(mine.dtype)


def reduce_closures(optimizer: torch.optim.Optimizer, strategy: Strategy, share: Any) -> None:
    """optimizer.step(closure) calls the closure through whole_batch_loss (step() without one: as it was);
    `share`: the job's uneven.Share, whose weight the closure's forward recorded."""

    def reduced(plain: Callable, closure: Callable | None = None, *args: Any, **kwargs: Any) -> Any:
        if closure is None:
            return plain(*args, **kwargs)
        return plain(lambda: whole_batch_loss(strategy, closure(), share.weight), *args, **kwargs)

    wrap_step(optimizer, reduced)


def set_up_step(optimizer: torch.optim.Optimizer, strategy: Strategy, scaler: torch.amp.GradScaler | None,
                skipped: torch.Tensor | None, job: Any) -> None:
    """What Multicard.setup_optimizers does to an optimizer's step(): fp16 (a `scaler`): through the gradient
    scaler (on 2+ processes the parameters outside the models averaged before it unscales, so every rank skips
    alike); 2+ processes: its closure's loss reduced. One the strategy cannot step is refused here. `job`: the
    JobState."""
    strategy.check_optimizer(optimizer)
    if scaler is not None:
        step_through_scaler(optimizer, scaler, skipped, job.params if strategy.world > 1 else None)
    if strategy.world > 1:
        reduce_closures(optimizer, strategy, job.share)

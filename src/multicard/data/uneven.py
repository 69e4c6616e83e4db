"""Uneven splits: where multicard cuts a global batch whose rows do not split evenly over the processes, each
process's gradient is weighted by its share of the rows, so N processes take the step one process takes.

A loss is a mean over a process's rows, as one process's is over the whole batch. DDP and FSDP average the
processes' gradients, (1/N) sum_r grad(mean_r); one process takes sum_r (k_r/n) grad(mean_r), where process r
holds k_r of the step's n rows. So process r's gradient is multiplied by its weight N*k_r/n before the average:
1 where the rows split evenly (then nothing at all is done), else e.g. 4/3 and 2/3 for 3 rows over 2 processes,
and 0 for a process that holds only a padded repeat (a last batch with fewer rows than processes).

The weight is recorded where the split is made (mc.local, the set-up loader, a loader read whole), with this
process's rows of the split, and applied by the set-up model to the gradient that flows back into its outputs,
so `loss.backward()` and `mc.backward(loss)` alike get it, ddp and fsdp alike. It belongs to the forwards on
that split: every forward whose inputs hold those rows (a GAN's D(real), G(noise), D(fake); a teacher's no_grad
forward leaves it to the student's) until the next split (each batch of a set-up loader is one) or the end of
the loader's pass; a forward on other rows ends it (the script went on to batches of its own), and a forward
under no_grad takes none. Where the batches come from a pipeline of the user's own, multicard cannot
know the global batch: nothing is recorded.

A loss summed over the rows (mc.backward(loss, reduction="sum")) wants no weight by rows: one process's gradient
is the sum over all rows, so each process's is multiplied by N (DDP averages), which is N / weight on top of the
weight its forward applied (`Share.applied`). A job holds one Share (yourloop/job_state.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UsageError
from ..jobs.trees import leaves, rebuild, values
from .parts import part, samples


class Share:
    """This process's share of the last split a job made: the weight of its gradient for the forwards on its rows
    (1 where the rows split evenly), the rows, the dim they lie along, and the weight the last forward with
    gradients applied. One per job in a process (the job's state holds it), handed to what splits and forwards."""

    def __init__(self) -> None:
        self.weight, self.rows, self.dim, self.applied = 1.0, None, 0, 1.0

    def record(self, weight: float, rows: int | None = None, dim: int = 0) -> None:
        """The weight of this process's gradient for the forwards on its `rows` (along `dim`) of the split just
        made."""
        self.weight, self.rows, self.dim = float(weight), rows, dim

    def local(self, batch: Any, rank: int, world: int, dim: int = 0, habits: Any = None) -> Any:
        """mc.local: rank's rows of a global batch (dealt as the loader deals), its weight N*k/n recorded
        (`habits`: watch.Habits, told the rows this process holds of the global batch)."""
        rows = samples(batch, dim)
        if rows is not None and rows < world:  # a process with no rows: its mean loss is NaN, and so is the average
            raise UsageError(f"mc.local: a batch of {rows} row{'s' * (rows != 1)} over {world} processes leaves some "
                             f"process none (its loss would be NaN, and the averaged gradient with it); skip such a "
                             f"batch, or give it at least {world} rows")
        if rows:
            mine = len(range(rank, rows, world))
            self.record(world * mine / rows, mine, dim)
            if habits is not None:
                habits.dealt(rows, mine)
        return part(batch, rank, world, dim)

    def weight_for(self, inputs: Any) -> float:
        """The weight of a forward on `inputs` (its arguments): the split's, where some input tensor holds this
        process's rows of it (or no input is a tensor); else 1, and the split's weight ends there."""
        weight, rows, dim = self.weight, self.rows, self.dim
        if weight == 1 or rows is None:
            return weight
        sizes = [t.size(dim) for t in values(inputs) if isinstance(t, torch.Tensor) and -t.dim() <= dim < t.dim()]
        if sizes and rows not in sizes:
            self.record(1.0)
            return 1.0
        return weight

    def weigh(self, out: Any, weight: float) -> Any:
        """The set-up model's outputs, their gradients multiplied by `weight` (1: `out` as it is)."""
        self.applied = weight
        if weight == 1:
            return out
        found = list(leaves(out))
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for _, t in found):
            other = next((type(t).__name__ for _, t in found if not isinstance(t, (torch.Tensor, int, float, str))
                          and t is not None), None)
            if other is not None:
                raise UsageError(f"this process holds an uneven share of the batch's rows (weight {weight:.4g}), "
                                 f"which multicard weights through the model's outputs, but the model returns a "
                                 f"{other}: return tensors (or dicts, lists, tuples of them)")
            return out
        return rebuild(out, (_Scaled.apply(t, weight) if isinstance(t, torch.Tensor) and t.requires_grad else t
                             for _, t in found))


def loader_weight(size: int, total: int, batch: int, accumulate: int, rank: int, world: int, micro: int,
                  share: float) -> tuple[float, int | None]:
    """The weight of micro-batch `micro` of a set-up loader's pass (counted from the pass's first position), for
    rank of world, and the rows rank holds of it. The order of `size` samples (`total` positions with the padded
    repeats) is dealt round-robin in global micro-batches of `batch`, `accumulate` to an optimizer step; only the
    last step can be short. The loop scales each micro-batch's loss by its `share` of this process's samples in
    the step, so the weight recorded is what is left: N * (its real rows) / (the step's rows) / share. A padded
    repeat (beyond `size`) is no real row: weight 0."""
    step = batch * accumulate
    first = micro // accumulate * step
    rows = min(step, size - first)
    if rows == step:  # a whole step: every process holds batch / N rows of each micro-batch
        return 1.0, None
    mine = len(range(micro * batch + rank, min((micro + 1) * batch, size), world))
    held = len(range(micro * batch + rank, min((micro + 1) * batch, total), world))
    return world * mine / rows / share, held


class _Scaled(torch.autograd.Function):
    """The identity forward; the gradient flowing back multiplied by `weight`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.weight, None


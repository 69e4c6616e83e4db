"""Synchronized BatchNorm for processes on the CPU (gloo). torch's SyncBatchNorm runs on cards only (it refuses CPU
tensors, and its batch_norm_stats kernel has no CPU version), so ddp on the CPU uses this one: the same statistics
over every process's part of the batch, from two all-reduces per layer (sums forward, gradient sums backward).
Without it, each process normalises by its own part's statistics: the one line of say_unsynced tells a user so."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..errors import note


class _Sync(torch.autograd.Function):
    """Batch norm over the union of every process's batch: per channel, the mean and the (biased) variance of all
    samples; backward, the two gradient sums that couple the samples, summed over the processes too."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps: float, momentum: float):
        dims, shape = _layout(x)
        channels = x.shape[1]
        stats = torch.cat([x.sum(dims, dtype=torch.float64), x.double().square().sum(dims),
                           x.new_tensor([x.numel() // channels], dtype=torch.float64)])
        dist.all_reduce(stats)
        count = stats[-1]
        mean = stats[:channels] / count
        var = stats[channels:-1] / count - mean.square()
        if running_mean is not None:  # the unbiased variance, as BatchNorm keeps it
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_((var * count / (count - 1).clamp(min=1)).to(running_var.dtype),
                                                alpha=momentum)
        invstd = (var + eps).rsqrt().to(x.dtype)
        xhat = (x - mean.to(x.dtype).view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd, count)
        return xhat if weight is None else xhat * weight.view(shape) + bias.view(shape)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd, count = ctx.saved_tensors
        dims, shape = _layout(dy)
        sums = torch.cat([dy.sum(dims), (dy * xhat).sum(dims)])
        local = sums.clone()  # this process's share of the weight and bias gradients (DDP averages them)
        dist.all_reduce(sums)
        channels = dy.shape[1]
        sum_dy, sum_dy_xhat = (s.view(shape) / count.to(dy.dtype) for s in sums.split(channels))
        scale = invstd.view(shape) if weight is None else (weight * invstd).view(shape)
        dx = scale * (dy - sum_dy - xhat * sum_dy_xhat)
        grad_weight = None if weight is None else local[channels:]
        grad_bias = None if weight is None else local[:channels]
        return dx, grad_weight, grad_bias, None, None, None, None


def _layout(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """The dims to reduce (all but the channels, dim 1), and a shape that broadcasts a per-channel vector."""
    return [0, *range(2, x.dim())], [1, x.shape[1]] + [1] * (x.dim() - 2)


class CPUSyncBatchNorm(_BatchNorm):
    """A BatchNorm layer whose training statistics are the whole job's (any number of dims, as SyncBatchNorm)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)  # evaluation, or one process: plain batch norm
        momentum = self.momentum or 0.0
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average, as BatchNorm does
                momentum = 1.0 / float(self.num_batches_tracked)
        running = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        return _Sync.apply(x, self.weight, self.bias, *running, self.eps, momentum)


def convert(module: nn.Module) -> nn.Module:
    """Every BatchNorm layer in `module` replaced by a CPUSyncBatchNorm holding the same parameters and buffers
    (so an optimizer built before keeps working); returns the module (a new one only if it was BatchNorm)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, (nn.SyncBatchNorm, CPUSyncBatchNorm)):
        new = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats)
        new._parameters, new._buffers = module._parameters, module._buffers  # the same tensors, not copies
        new.train(module.training)
        return new
    for name, child in module.named_children():
        setattr(module, name, convert(child))
    return module


def say_unsynced(model: nn.Module, processes: int, main: bool, said: set[str]) -> None:
    """One line on rank 0's stderr, once, when a model with BatchNorm layers trains on 2+ processes without
    sync_batchnorm: each process's statistics are then those of its own part of the batch, so the steps are not
    the ones one process takes (nothing else in the step differs that way but dropout)."""
    layers = sum(isinstance(m, _BatchNorm) and not isinstance(m, (nn.SyncBatchNorm, CPUSyncBatchNorm))
                 for m in model.modules())
    if processes < 2 or not layers or not main or "syncbn" in said:  # said once a job (`said`: the job's)
        return
    said.add("syncbn")
    note(f"{type(model).__name__} has {layers} BatchNorm layer{'s' * (layers > 1)} and trains on "
         f"{processes} processes: each normalises by the statistics of its own 1/{processes} of the batch, not the "
         f"whole batch's as one process does; Multicard(sync_batchnorm=True) (multicard train --sync-bn) makes them "
         f"the whole batch's")

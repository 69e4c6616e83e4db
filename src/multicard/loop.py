"""fit() and evaluate(): the trainer's loop, written once on the front object (Multicard) and nothing else: what it
does, a user's own loop can do with the same calls. It never asks which strategy it runs under.

(This module is loop.py, not train.py, so that `multicard.train` stays the public function.)
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from tqdm import tqdm

from .config import TrainConfig
from .errors import UsageError
from .front import Multicard


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).double().mean()


def count(targets) -> int:
    return len(targets) if not isinstance(targets, dict) else len(next(iter(targets.values())))


@torch.no_grad()
def evaluate(mc: Multicard, model: nn.Module, stats: Callable, loader) -> dict[str, float]:
    """Exact test loss and metric: per-batch means weighted by batch size, summed over every process (the
    loader's shards hold each test sample once)."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=mc.device)
    for inputs, targets in loader:
        n = count(targets)
        sums[:2] += stats(model(inputs), targets).double() * n
        sums[2] += n
    loss, correct, n = mc.all_reduce(sums).tolist()
    return {"test_loss": loss / max(n, 1), "test_accuracy": correct / max(n, 1), "test_samples": int(n)}


def fit(mc: Multicard, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, criterion: Callable,
        stats: Callable, train_loader, test_loader, config: TrainConfig,
        on_epoch: Callable[[dict], None] | None = None) -> list[dict]:
    """Train the set-up `model` for config.epochs; return one record per epoch. `criterion` and `stats` (the
    loss and the metric, stacked) are set up with mc; the loaders too."""
    forward = torch.compile(model) if config.compile else model  # same weights; `model` stays saveable
    bar = tqdm(total=config.epochs * len(train_loader), unit="step", dynamic_ncols=True,
               disable=config.quiet or not mc.is_main or not sys.stderr.isatty())
    history = []
    for epoch in range(config.epochs):
        model.train()
        lr = optimizer.param_groups[0]["lr"]
        loss_sum, samples = torch.zeros((), dtype=torch.float64, device=mc.device), 0
        start = time.perf_counter()
        for inputs, targets in train_loader:
            loss = criterion(forward(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            mc.backward(loss)
            optimizer.step()
            n = count(targets)
            loss_sum.add_(loss.detach(), alpha=n)  # one op: float32 loss into the float64 sum
            samples += n
            bar.update()
        loss_sum, samples = mc.all_reduce(torch.stack([loss_sum, loss_sum.new_tensor(samples)])).tolist()
        seconds = time.perf_counter() - start  # after the reduction's .tolist(): the device work is done
        scheduler.step()
        record = {"epoch": epoch + 1, "train_loss": loss_sum / samples, "lr": lr,
                  "samples_per_s": samples / seconds, "seconds": seconds}
        if test_loader is not None:
            record.update(evaluate(mc, forward, stats, test_loader))
        if not math.isfinite(record["train_loss"]):  # a setting made training diverge: say which one to turn
            raise UsageError(f"epoch {epoch + 1}: the training loss is {record['train_loss']}: training diverged; "
                             f"try a smaller --lr (this run: {config.lr:g})")
        bar.set_postfix(loss=f"{record['train_loss']:.4f}", acc=f"{record.get('test_accuracy', 0):.4f}")
        history.append(record)
        if on_epoch is not None:
            on_epoch(record)
    bar.close()
    return history

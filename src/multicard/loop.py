"""fit() and evaluate(): the training loop, written once. It never asks which strategy it runs under.

(This module is loop.py, not train.py, so that `multicard.train` stays the public function.)
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from .config import TrainConfig
from .data.loaders import set_epoch, to_device
from .errors import UsageError
from .strategies import Strategy


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).double().mean()


def count(targets) -> int:
    return len(targets) if not isinstance(targets, dict) else len(next(iter(targets.values())))


@torch.no_grad()
def evaluate(model: nn.Module, stats: Callable, loader: DataLoader, strategy: Strategy) -> dict[str, float]:
    """Exact test loss and accuracy: per-batch means weighted by batch size, summed over every process."""
    model.eval()
    sums, samples = torch.zeros(2, dtype=torch.float64, device=strategy.device), 0
    for inputs, targets in loader:
        inputs, targets = to_device(inputs, strategy.device), to_device(targets, strategy.device)
        sums += stats(model(inputs), targets).double() * count(targets)
        samples += count(targets)
    loss, correct, n = strategy.reduce(torch.cat([sums, sums.new_tensor([samples])])).tolist()
    return {"test_loss": loss / max(n, 1), "test_accuracy": correct / max(n, 1), "test_samples": int(n)}


def adam(params: list, lr: float) -> torch.optim.Adam:
    """Adam fused into one kernel per step where this torch can do that for these parameters: the same
    algorithm, fewer launches (measurably faster for small models); plain Adam elsewhere."""
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(params, lr=lr)


def fit(model: nn.Module, criterion: Callable, train_loader: DataLoader, test_loader: DataLoader | None,
        strategy: Strategy, config: TrainConfig, metric: Callable = accuracy,
        on_epoch: Callable[[dict], None] | None = None) -> tuple[nn.Module, list[dict]]:
    """Set up `model` and `criterion` with `strategy`, train for config.epochs; return the wrapped model and
    one record per epoch.

    The seeds' recipe: Adam and StepLR on the plain optimizer (never wrapped, so the learning rate reads
    optimizer.param_groups[0]["lr"] under every strategy).
    """
    model, loss_fn = strategy.setup(model, criterion)
    forward = torch.compile(model) if config.compile else model  # same weights; `model` stays saveable
    autocast = torch.autocast(strategy.device.type, torch.bfloat16, enabled=config.precision == "bf16")
    optimizer = adam(list(model.parameters()), config.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=config.lr_step, gamma=config.lr_gamma)
    stats = strategy.wrap_loss(lambda out, y: torch.stack([criterion(out, y).double(), metric(out, y).double()]))
    bar = tqdm(total=config.epochs * len(train_loader), unit="step", dynamic_ncols=True,
               disable=config.quiet or not strategy.is_main or not sys.stderr.isatty())
    history = []
    for epoch in range(config.epochs):
        set_epoch(train_loader, epoch)
        model.train()
        lr = optimizer.param_groups[0]["lr"]
        loss_sum, samples = torch.zeros((), dtype=torch.float64, device=strategy.device), 0
        strategy.synchronize()
        start = time.perf_counter()
        for inputs, targets in train_loader:
            inputs, targets = to_device(inputs, strategy.device), to_device(targets, strategy.device)
            with autocast:
                loss = loss_fn(forward(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            n = count(targets)
            loss_sum.add_(loss.detach(), alpha=n)  # one op: float32 loss into the float64 sum
            samples += n
            bar.update()
        strategy.synchronize()
        seconds = time.perf_counter() - start
        scheduler.step()
        loss_sum, samples = strategy.reduce(torch.stack([loss_sum, loss_sum.new_tensor(samples)])).tolist()
        record = {"epoch": epoch + 1, "train_loss": loss_sum / samples, "lr": lr,
                  "samples_per_s": samples / seconds, "seconds": seconds}
        if test_loader is not None:
            with autocast:
                record.update(evaluate(forward, stats, test_loader, strategy))
        if not math.isfinite(record["train_loss"]):  # a setting made training diverge: say which one to turn
            raise UsageError(f"epoch {epoch + 1}: the training loss is {record['train_loss']}: training diverged; "
                             f"try a smaller --lr (this run: {config.lr:g})")
        bar.set_postfix(loss=f"{record['train_loss']:.4f}", acc=f"{record.get('test_accuracy', 0):.4f}")
        history.append(record)
        if on_epoch is not None:
            on_epoch(record)
    bar.close()
    return model, history

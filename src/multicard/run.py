"""train(): the library's entry point and the body of `multicard train`. A client of the front object like any
user's script: Multicard picks the strategy and launches the processes, and each one sets up the model, the
criterion and the loaders with it, runs the loop, and has rank 0 write metrics.jsonl, summary.json and model.pt.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import checkpoint
from .config import TrainConfig
from .errors import UsageError
from .front import Multicard
from .loop import accuracy, fit
from .report import Report, say


def train(model: nn.Module, train_data: Dataset, test_data: Dataset | None = None,
          config: TrainConfig | None = None, criterion: Callable | None = None,
          metric: Callable = accuracy, **overrides) -> dict:
    """Train `model` with the strategy and devices of `config` (keyword overrides allowed, e.g. epochs=2).

    `train_data` / `test_data` yield (inputs, targets); `criterion(outputs, targets)` returns the batch mean
    (CrossEntropyLoss by default). Where the strategy needs several processes they are spawned here, so call
    this under `if __name__ == "__main__":` and keep model, data and criterion picklable. Returns the summary.
    """
    config = replace(config or TrainConfig(), **overrides)
    config.validate()
    mc = Multicard(config.strategy, config.devices, config.precision, seed=config.seed,
                   find_unused_parameters=config.find_unused_parameters)
    mc.local_batch(config.batch_size, "--batch-size")  # a bad global batch fails here, before any process starts
    if mc.job.rank == 0:  # only rank 0 writes; last, once every other input is known good: a refused run makes
        prepare_out(config.out)  # nothing
    summary = mc.launch(worker, model, train_data, test_data, criterion or nn.CrossEntropyLoss(), metric, config)
    if mc.world_size > 1 and not mc.job.launched:  # spawned processes trained copies: the caller's model ends
        checkpoint.load(model, Path(config.out) / "model.pt")  # up trained too, as with one process
    return summary


def prepare_out(out: str) -> None:
    """Make the --out folder now, before any process starts: one that cannot be made or written is one line
    here, not a traceback from rank 0 after the data has loaded."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {out}: is a file; name a folder (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot create that folder ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: this user cannot write into that folder")


def worker(mc: Multicard, model: nn.Module, train_data: Dataset, test_data: Dataset | None, criterion: Callable,
           metric: Callable, config: TrainConfig) -> dict:
    """The body of every training process: the seeds' recipe (Adam, StepLR) on the user's model and data."""
    begin = time.perf_counter()
    torch.manual_seed(config.seed + mc.rank)  # per rank: augmentation and dropout differ
    cuda = mc.device.type == "cuda"
    torch.backends.cudnn.benchmark = cuda  # fixed image shapes: let cuDNN pick its fastest kernels once
    model = mc.setup(model)
    optimizer = adam(list(model.parameters()), config.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=config.lr_step, gamma=config.lr_gamma)
    loss_fn = mc.setup_criterion(criterion)
    stats = mc.setup_criterion(lambda out, y: torch.stack([criterion(out, y).double(), metric(out, y).double()]))
    shuffled = torch.Generator().manual_seed(config.seed)  # the data order: the same in every process
    train_loader = mc.setup_dataloader(DataLoader(train_data, config.batch_size, shuffle=True, generator=shuffled,
                                                  num_workers=config.workers, pin_memory=cuda),
                                       device_data=config.device_data)
    test_loader = None if test_data is None else mc.setup_dataloader(
        DataLoader(test_data, config.eval_batch_size, num_workers=config.workers, pin_memory=cuda), train=False,
        device_data=config.device_data)
    report = Report(Path(config.out), config, mc.is_main)
    if mc.is_main:
        note = f" ({mc.device_note})" if mc.device_note else ""
        say(f"training {type(mc.unwrap(model)).__name__} on {len(train_data)} samples: strategy {mc.strategy}, "
            f"{mc.world_size} process(es) on {mc.device.type}, global batch {config.batch_size} "
            f"({train_loader.local_batch_size} per process){note}")
    history = fit(mc, model, optimizer, scheduler, loss_fn, stats, train_loader, test_loader, config, report.epoch)
    names = [f"cuda:{c} {torch.cuda.get_device_name(c)}" for c in mc.cards] or ["cpu"]
    last = history[-1]
    summary = {
        "strategy": mc.strategy, "world_size": mc.world_size, "launcher": mc.launcher,
        "devices": flat(mc.gather(names)), "epochs": config.epochs, "global_batch_size": config.batch_size,
        "per_process_batch_size": train_loader.local_batch_size,
        **{k: last[k] for k in ("train_loss", "test_loss", "test_accuracy", "test_samples") if k in last},
        "train_samples_per_s": sum(r["samples_per_s"] * r["seconds"] for r in history)
        / max(sum(r["seconds"] for r in history), 1e-9),
        "wall_s": time.perf_counter() - begin, "peak_memory_mb": flat(mc.gather(mc.peak_memory_mb())),
        "card_used_mb": flat(mc.gather(mc.card_used_mb())),  # NVML; [] where it cannot be read
        "model": type(mc.unwrap(model)).__name__, "torch": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "config": asdict(config),
    }
    if mc.is_main:
        report.finish(summary, model)
    mc.barrier()  # leave together: a rank that tears down while another still writes can abort gloo
    return summary


def flat(parts: list[list]) -> list:
    return [v for part in parts for v in part]


def adam(params: list, lr: float) -> torch.optim.Adam:
    """Adam fused into one kernel per step where this torch can do that for these parameters: the same
    algorithm, fewer launches (measurably faster for small models); plain Adam elsewhere."""
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(params, lr=lr)

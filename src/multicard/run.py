"""train(): the library's entry point. Picks the strategy, launches its processes, runs the loop in each,
and has rank 0 write metrics.jsonl, summary.json and model.pt."""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm import tqdm

from . import checkpoint, launch, memory, strategies
from .config import TrainConfig
from .data.loaders import make_loader
from .devices import select
from .dist import job_from_env
from .errors import UsageError
from .loop import accuracy, fit


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
    job = job_from_env()
    devices = select(config.devices)
    strategy = strategies.create(config.strategy, devices, job, config.find_unused_parameters)
    strategy.local_batch(config.batch_size)  # a bad global batch fails here, before any process starts
    if job.rank == 0:  # only rank 0 writes; last, once every other input is known good: a refused run makes nothing
        prepare_out(config.out)
    args = (strategy, model, train_data, test_data, criterion or nn.CrossEntropyLoss(), metric, config)
    if strategy.processes == 1:
        return worker(*args)
    launch.run(worker, strategy.processes, args)
    checkpoint.load(model, Path(config.out) / "model.pt")  # the caller's model ends trained, as with one process
    return json.loads((Path(config.out) / "summary.json").read_text())


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


def worker(strategy: strategies.Strategy, model: nn.Module, train_data: Dataset, test_data: Dataset | None,
           criterion: Callable, metric: Callable, config: TrainConfig) -> dict:
    """The body of every training process: start, train, report, and always stop (process group down)."""
    try:
        strategy.start(job_from_env())
        # the trained (wrapped) model lives only inside this call: gone before the process group goes down
        return train_here(strategy, model, train_data, test_data, criterion, metric, config)
    finally:
        strategy.stop()


def train_here(strategy: strategies.Strategy, model: nn.Module, train_data: Dataset, test_data: Dataset | None,
               criterion: Callable, metric: Callable, config: TrainConfig) -> dict:
    begin = time.perf_counter()
    if strategy.job.launcher == "multicard":  # spawned: tensors arrive in memory shared by all processes,
        model = copy.deepcopy(model)  # so each process needs weights of its own (data stays shared)
    torch.manual_seed(config.seed + strategy.rank)  # per rank: augmentation and dropout differ
    cuda = strategy.device.type == "cuda"
    torch.backends.cudnn.benchmark = cuda  # fixed image shapes: let cuDNN pick its fastest kernels once
    common = dict(rank=strategy.rank, world=strategy.world, workers=config.workers, pin_memory=cuda,
                  device=strategy.device if config.device_data else None)
    local_batch = strategy.local_batch(config.batch_size)
    train_loader = make_loader(train_data, local_batch, train=True, seed=config.seed, **common)
    eval_batch = max(1, config.eval_batch_size // strategy.world)
    test_loader = None if test_data is None else make_loader(test_data, eval_batch, train=False, **common)
    memory.reset(strategy.cards)
    report = Report(Path(config.out), config, strategy.is_main)
    if strategy.is_main:
        note = f" ({strategy.devices.note})" if strategy.devices.note else ""
        say(f"training {type(model).__name__} on {len(train_data)} samples: strategy {strategy.name}, "
            f"{strategy.world} process(es) on {strategy.devices.kind}, global batch {config.batch_size} "
            f"({local_batch} per process){note}")
    model, history = fit(model, criterion, train_loader, test_loader, strategy, config, metric, report.epoch)
    names = [f"cuda:{c} {torch.cuda.get_device_name(c)}" for c in strategy.cards] or ["cpu"]
    last = history[-1]
    summary = {
        "strategy": strategy.name, "world_size": strategy.world, "launcher": strategy.job.launcher,
        "devices": strategy.gather(names), "epochs": config.epochs, "global_batch_size": config.batch_size,
        "per_process_batch_size": local_batch,
        **{k: last[k] for k in ("train_loss", "test_loss", "test_accuracy", "test_samples") if k in last},
        "train_samples_per_s": sum(r["samples_per_s"] * r["seconds"] for r in history)
        / max(sum(r["seconds"] for r in history), 1e-9),
        "wall_s": time.perf_counter() - begin, "peak_memory_mb": strategy.gather(memory.peak_mb(strategy.cards)),
        "card_used_mb": strategy.gather(memory.card_used_mb(strategy.cards)),  # NVML; [] where it cannot be read
        "model": type(strategy.unwrap(model)).__name__, "torch": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "config": asdict(config),
    }
    if strategy.is_main:
        report.finish(summary, model)
    strategy.barrier()  # leave together: a rank that tears down while another still writes can abort gloo
    return summary


def say(line: str) -> None:
    tqdm.write(f"multicard: {line}")


class Report:
    """What rank 0 writes into --out: a line per epoch, then the model, the metrics and the summary.

    The epochs go to metrics.jsonl.part while the run lasts; it becomes metrics.jsonl only when the run ends
    well. A run that fails or is stopped leaves an earlier run's three files in --out as they were."""

    def __init__(self, out: Path, config: TrainConfig, active: bool):
        self.out, self.config, self.active = out, config, active
        self.part = out / "metrics.jsonl.part"
        if active:  # train() made the folder (prepare_out) before any process started
            self.part.write_text("")

    def epoch(self, record: dict) -> None:
        if not self.active:
            return
        with open(self.part, "a") as f:
            f.write(json.dumps(record) + "\n")
        if not self.config.quiet:
            acc = f"  test acc {record['test_accuracy']:.2%}" if "test_accuracy" in record else ""
            say(f"epoch {record['epoch']}/{self.config.epochs}  train loss {record['train_loss']:.4f}{acc}  "
                f"lr {record['lr']:.1e}  {record['samples_per_s']:,.0f} samples/s  {record['seconds']:.1f} s")

    def finish(self, summary: dict, model: nn.Module) -> None:
        checkpoint.save(model, self.out / "model.pt")
        os.replace(self.part, self.out / "metrics.jsonl")
        tmp = self.out / "summary.json.part"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, self.out / "summary.json")
        acc = f"test accuracy {summary['test_accuracy']:.2%} on {summary['test_samples']}, " \
            if "test_accuracy" in summary else ""
        memory_line = ", ".join(f"{m:,.0f}" for m in summary["peak_memory_mb"])
        used = ", ".join(f"{m:,.0f}" for m in summary["card_used_mb"])
        say(f"done: {acc}{summary['train_samples_per_s']:,.0f} train samples/s, {summary['wall_s']:.1f} s; "
            f"peak memory MB per {'card' if summary['devices'][0] != 'cpu' else 'process'}: [{memory_line}]"
            + (f"; in use per card (NVML): [{used}]" if used else ""))
        if not self.config.quiet:  # quiet runs (multicard check's, the bench's) write into folders of their own
            say(f"wrote {self.out / 'metrics.jsonl'}, {self.out / 'summary.json'}, {self.out / 'model.pt'}")

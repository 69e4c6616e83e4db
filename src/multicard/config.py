"""TrainConfig: every knob of a run in one dataclass. The CLI builds its flags from these fields.

This module must not import torch: `multicard --help` reads it and must answer at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import UsageError


def opt(default, help: str, **meta):
    """A dataclass field that carries its --help text."""
    return field(default=default, metadata={"help": help, **meta})


STRATEGIES = ("auto", "single", "ddp", "dp", "dp-balanced")


@dataclass
class TrainConfig:
    # what to train
    model: str = opt("lenet5", "lenet5, resnet8, another registered name, or your own: file.py:Class or "
                     "package.module:Class")
    data: str = opt("mnist-5k", "mnist-5k (embedded), mnist, fashion-mnist or synthetic")
    # mnist / fashion-mnist IDX files are looked for directly in this folder
    data_dir: str | None = opt(None, "folder holding the four IDX files of mnist / fashion-mnist")
    # fetching data is opt-in: a run never touches the network unless asked
    download: bool = opt(False, "download mnist / fashion-mnist into the cache if missing (checksummed)")
    # synthetic data: big enough for a timed epoch, small enough to build in a blink
    synthetic_samples: int = opt(8192, "training samples of --data synthetic")

    # where to train
    # auto: ddp on 2+ cards, single on 1 card or on the CPU
    strategy: str = opt("auto", "auto, single, ddp, dp or dp-balanced", choices=STRATEGIES)
    # auto: every visible card, else the CPU; cpu:N runs N processes (ddp on gloo)
    devices: str = opt("auto", "auto, cpu, cpu:N, a card count N, card ids 0,1 or cuda:1")
    # a model without unused parameters would pay for the extra graph walk for nothing
    find_unused_parameters: bool = opt(False, "ddp: allow parameters that get no gradient")

    # the recipe: the seeds' Adam 1e-3 + StepLR, plus light augmentation
    # 30 epochs of 4,000 augmented images reach ~98% on mnist-5k in ~25 s on 2 CPU cores
    epochs: int = opt(30, "passes over the training data")
    # GLOBAL batch: samples per optimizer step, whatever the strategy (ddp splits it per process)
    batch_size: int = opt(64, "global batch size: samples per optimizer step, split over processes")
    # evaluation keeps no activations for backward, so it can take big batches
    eval_batch_size: int = opt(1000, "global batch size for evaluation")
    lr: float = opt(1e-3, "Adam learning rate (the seeds' value)")
    # the seeds step the rate down with StepLR; here counted in epochs
    lr_step: int = opt(20, "StepLR: multiply the rate by --lr-gamma every this many epochs")
    lr_gamma: float = opt(0.1, "StepLR factor")
    # small random rotations, scalings and shifts: +1.5 points on 4,000 training images
    augment: bool = opt(True, "randomly rotate / scale / shift training images")
    # one seed makes a run repeatable; each rank adds its rank for what should differ (augmentation)
    seed: int = opt(0, "random seed")
    # data is held in memory and indexed a batch at a time: loader processes rarely pay off
    workers: int = opt(0, "DataLoader worker processes per training process")

    # the fast path for small models: data lives on the device, batches are cut there, no DataLoader at all
    device_data: bool = opt(False, "hold the whole dataset on the device and index batches there")
    # exact fp32 stays the default; bf16 autocast is faster on cards at a small cost in precision
    precision: str = opt("fp32", "fp32, or bf16 (autocast)", choices=("fp32", "bf16"))
    # compiling costs tens of seconds up front; worth it only for long runs on cards
    compile: bool = opt(False, "torch.compile the model")

    # output
    quiet: bool = opt(False, "no progress bar, no per-epoch lines, no list of the files written")
    # a rerun with the same --out replaces that run's files
    out: str = opt("runs/train", "folder for metrics.jsonl, summary.json and model.pt")

    def validate(self) -> None:
        """Refuse numbers that cannot work, before anything runs (torch would fail later, some after an epoch)."""
        for flag, value, least in (("--epochs", self.epochs, 1), ("--lr-step", self.lr_step, 1),
                                   ("--workers", self.workers, 0), ("--eval-batch-size", self.eval_batch_size, 1)):
            if value < least:
                raise UsageError(f"{flag} {value}: must be at least {least}")
        for flag, value in (("--lr", self.lr), ("--lr-gamma", self.lr_gamma)):
            if not 0 < value < math.inf:  # also refuses nan
                raise UsageError(f"{flag} {value}: must be a positive number")

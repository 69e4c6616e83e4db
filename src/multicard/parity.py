"""multicard check: do N processes (or cards) learn what one learns? K steps each, same global batch and seed,
then every parameter compared."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from . import data, models
from .config import TrainConfig
from .data.images import ImageData
from .devices import select
from .errors import UsageError
from .run import train


@dataclass
class Parity:
    steps: int
    processes: int
    strategy: str
    max_diff: float
    worst: str  # the parameter that differs most
    loss_single: float
    loss_many: float
    tolerance: float
    causes: list[str]

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.tolerance

    def lines(self) -> list[str]:
        verdict = "PASS" if self.ok else "FAIL"
        out = [f"parity: {self.steps} steps, 1 process vs {self.processes} ({self.strategy}): largest parameter "
               f"difference {self.max_diff:.2e} ({self.worst}), tolerance {self.tolerance:.0e}: {verdict}",
               f"training loss: {self.loss_single:.6f} on one, {self.loss_many:.6f} on {self.processes}"]
        if not self.ok:
            out += ["likely cause: " + c for c in self.causes or ["none known; look for rank-dependent code"]]
        return out


def likely_causes(model: nn.Module) -> list[str]:
    causes = []
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        causes.append("BatchNorm keeps statistics per replica; convert with torch.nn.SyncBatchNorm."
                      "convert_sync_batchnorm for identical results")
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        causes.append("dropout draws its masks from each rank's own RNG, so masks differ per rank")
    return causes


def check(config: TrainConfig, steps: int = 20, tolerance: float = 1e-4) -> Parity:
    """Train `steps` optimizer steps on one process and on the config's devices; compare the weights."""
    if steps < 1:
        raise UsageError(f"--steps {steps}: must be at least 1")
    devices_text = config.devices if config.devices != "auto" or select("auto").count > 1 else "cpu:2"
    many = select(devices_text)
    if many.count < 2:
        raise UsageError(f"--devices {config.devices}: parity needs 2 or more devices, e.g. cpu:2 or 0,1")
    train_set, _ = data.load(config.data, config.data_dir, config.download, False, config.synthetic_samples)
    size = steps * config.batch_size
    if size > len(train_set):
        raise UsageError(f"--steps {steps} x --batch-size {config.batch_size} needs {size} samples; "
                         f"{config.data} has {len(train_set)}")
    subset = ImageData(train_set.tensors[0][:size], train_set.tensors[1][:size], train_set.mean, train_set.std)
    base = replace(config, epochs=1, augment=False, quiet=True, lr_step=max(config.lr_step, 1))
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}  # the many-device run first: the single run may start CUDA in this process
        for key, strategy, devices in (("many", config.strategy, devices_text),
                                       ("one", "single", "cpu" if many.kind == "cpu" else "cuda:0")):
            torch.manual_seed(config.seed)
            model = models.build(config.model)
            out = str(Path(tmp) / key)
            summary = train(model, subset, None, replace(base, strategy=strategy, devices=devices, out=out))
            runs[key] = (summary, torch.load(Path(out) / "model.pt", weights_only=True))
    (one, one_state), (many_summary, many_state) = runs["one"], runs["many"]
    diffs = {k: (one_state[k].double() - many_state[k].double()).abs().max().item() for k in one_state}
    worst = max(diffs, key=diffs.get)
    return Parity(steps, many_summary["world_size"] if many_summary["strategy"] == "ddp" else many.count,
                  many_summary["strategy"], diffs[worst], worst, one["train_loss"], many_summary["train_loss"],
                  tolerance, likely_causes(model))

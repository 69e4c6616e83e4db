"""What rank 0 of a training run writes into --out and prints: a line per epoch, then the model, the metrics and
the summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn
from tqdm import tqdm

from . import checkpoint
from .config import TrainConfig


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

"""Seeing a training run: curves.png at the end, the straggler among the ranks, and a plain progress line where
no terminal shows tqdm's bar. (The loggers behind mc.log live in yourloop/loggers.py.)

No torch or matplotlib at module level: each loads only when it is asked for.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

# a rank is named a straggler when its own time is this much over the median rank's AND this many seconds over
# it: two ranks sharing two busy cores reach 20% by noise in a 0.1 s epoch, which no one needs told
STRAGGLER, STRAGGLER_S = 0.2, 2.0


def straggler(rank_seconds: list[float]) -> tuple[int, float]:
    """The slowest rank and its lag: how much longer its own time was than the median rank's (0.35: 35%)."""
    slowest = max(range(len(rank_seconds)), key=rank_seconds.__getitem__)
    median = statistics.median(rank_seconds)
    return slowest, (rank_seconds[slowest] / median - 1 if median > 0 else 0.0)


def straggles(record: dict) -> bool:
    """Whether an epoch's record (or the summary) names a straggler worth a warning: its lag is large in relative
    and in absolute time."""
    seconds = record.get("rank_seconds") or ()
    if len(seconds) < 2:
        return False
    return record["lag"] > STRAGGLER and max(seconds) - statistics.median(seconds) > STRAGGLER_S


def crowded(processes: int) -> str:
    """A line where the processes outnumber this machine's cores (then the ranks' times say more about the
    system's scheduler than about a slow rank), else ""."""
    from ..jobs.devices import cpu_cores

    cores = cpu_cores()
    if processes <= cores:
        return ""
    return (f"{processes} processes share {cores} CPU cores: ranks wait for cores in turn, so their times differ "
            f"by chance and no straggler is named")


class Progress:
    """A plain line every `every` seconds (epoch, step, samples/s) for a log file or CI, where tqdm's bar is off.
    tick() is a clock read per batch: no host sync, nothing printed until `every` seconds have passed."""

    def __init__(self, every: float, epochs: int, steps_per_epoch: int, say):
        self.every, self.epochs, self.steps, self.say = every, epochs, steps_per_epoch, say
        self.last, self.samples = time.monotonic(), 0

    def tick(self, epoch: int, step: int, samples: int) -> None:
        self.samples += samples
        now = time.monotonic()
        if now - self.last >= self.every:
            self.say(f"epoch {epoch}/{self.epochs} step {step}/{self.steps}, "
                     f"{self.samples / (now - self.last):,.0f} samples/s")
            self.last, self.samples = now, 0


def curves(history: list[dict], path: Path, title: str = "") -> None:
    """curves.png: train and test loss, test accuracy and learning rate per epoch, side by side."""
    from matplotlib.figure import Figure  # no pyplot: no backend to pick, nothing global changed

    epochs = [r["epoch"] for r in history]
    style = dict(marker="o", markersize=3 if len(epochs) <= 40 else 0, linewidth=1.6)
    fig = Figure(figsize=(12, 3.8))
    # fixed margins: a layout engine would draw the figure twice, doubling the second this costs every run
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.13, top=0.84, wspace=0.2)
    loss, acc, lr = fig.subplots(1, 3)
    loss.plot(epochs, [r["train_loss"] for r in history], label="train", color="tab:blue", **style)
    tested = [r for r in history if "test_loss" in r]
    if tested:
        loss.plot([r["epoch"] for r in tested], [r["test_loss"] for r in tested], label="test", color="tab:orange",
                  linestyle="--", **style)
        acc.plot([r["epoch"] for r in tested], [100 * r["test_accuracy"] for r in tested], color="tab:green", **style)
        best = max(tested, key=lambda r: r["test_accuracy"] if math.isfinite(r["test_accuracy"]) else -1)
        acc.text(0.97, 0.04, f"last {tested[-1]['test_accuracy']:.2%}, best {best['test_accuracy']:.2%} "
                 f"(epoch {best['epoch']})", ha="right", va="bottom", transform=acc.transAxes, fontsize=9,
                 bbox=dict(facecolor="white", edgecolor="lightgray", alpha=0.9))
    else:
        acc.text(0.5, 0.5, "no test set", ha="center", va="center", transform=acc.transAxes, color="gray")
    lrs = [r["lr"] for r in history]
    lr.plot(epochs, lrs, color="tab:purple", **style)
    if lrs and min(lrs) > 0 and max(lrs) / min(lrs) > 20:  # a decay over decades reads best on a log scale
        lr.set_yscale("log")
    else:  # from 0: a flat rate reads as flat, a staircase as steps
        lr.set_ylim(0, 1.1 * max(lrs, default=1e-12) or 1e-12)
        lr.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    loss.legend()
    for ax, name in ((loss, "loss"), (acc, "test accuracy (%)"), (lr, "learning rate")):
        ax.set_title(name, y=1.0)  # where auto puts it, without measuring every tick label (1/3 of the time)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)

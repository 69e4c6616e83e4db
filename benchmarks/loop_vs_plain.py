"""multicard's loop (strategy single, CPU) against two hand-written PyTorch loops, in the same run.

All three train LeNet5 (same init seed) on the same mnist-5k training tensors (normalized as multicard's
ImageData does), batch 64, Adam 1e-3, for 1 warm-up epoch + --epochs timed epochs. Only the timed epochs'
training counts (evaluation excluded); multicard's rate comes from its metrics.jsonl without epoch 1.
  plain-dataloader: DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True), collating sample by sample
  plain-indexing:   a randperm per epoch, in-memory tensors indexed one batch at a time (the hardest baseline)
Repeats are interleaved (the order rotates each round); medians are reported.

    .venv/bin/python benchmarks/loop_vs_plain.py [--epochs 3] [--repeats 3] [--out benchmarks/results/...]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multicard
from multicard.data import mnist5k
from multicard.models import LeNet5

BATCH, LR, SEED = 64, 1e-3, 0


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": cores, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def source() -> str:
    """The multicard commit measured, and whether src/ had uncommitted changes."""
    def git(*args):
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=root).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted src/ changes" if git("status", "-s", "src") else "")


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return (model(x).argmax(-1) == y).double().mean().item()


def run_multicard(train, test, epochs: int) -> tuple[float, float, float]:
    """(samples/s of the timed epochs, summary's samples/s over all epochs, final test accuracy)."""
    torch.manual_seed(SEED)
    model = LeNet5()
    with tempfile.TemporaryDirectory() as out:
        summary = multicard.train(model, train, test, strategy="single", devices="cpu", epochs=epochs + 1,
                                  batch_size=BATCH, lr=LR, seed=SEED, augment=False, quiet=True, out=out)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()][1:]
    rate = sum(r["samples_per_s"] * r["seconds"] for r in rows) / sum(r["seconds"] for r in rows)
    return rate, summary["train_samples_per_s"], summary["test_accuracy"]


def run_plain(kind: str, x, y, x_test, y_test, epochs: int) -> tuple[float, float]:
    """(samples/s of the timed epochs, final test accuracy) of a hand-written loop."""
    torch.manual_seed(SEED)
    model = LeNet5()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    criterion = nn.CrossEntropyLoss()
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)

    def indexed():
        order = torch.randperm(len(x))
        for i in range(0, len(x), BATCH):
            idx = order[i:i + BATCH]
            yield x[idx], y[idx]

    model.train()
    for epoch in range(epochs + 1):
        if epoch == 1:  # epoch 0 is the warm-up
            start = time.perf_counter()
        for inputs, targets in (loader if kind == "plain-dataloader" else indexed()):
            loss = criterion(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    seconds = time.perf_counter() - start
    return epochs * len(x) / seconds, accuracy(model, x_test, y_test)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs (after one warm-up epoch)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/loop_vs_plain.json"))
    args = parser.parse_args()

    train, test = mnist5k.load(augment=False)
    x, y = train[:]  # ImageData[:]: the whole set as a normalized float batch, exactly as multicard sees it
    x_test, y_test = test[:]
    names = ["multicard", "plain-dataloader", "plain-indexing"]
    rates: dict[str, list[float]] = {n: [] for n in names}
    accs: dict[str, list[float]] = {n: [] for n in names}
    summary_rates = []
    for round_ in range(args.repeats):
        for name in names[round_ % 3:] + names[:round_ % 3]:  # rotate the order: no one always goes first
            if name == "multicard":
                rate, all_epochs, acc = run_multicard(train, test, args.epochs)
                summary_rates.append(all_epochs)
            else:
                rate, acc = run_plain(name, x, y, x_test, y_test, args.epochs)
            rates[name].append(rate)
            accs[name].append(acc)
            print(f"round {round_ + 1}/{args.repeats}  {name:17s} {rate:8,.0f} samples/s  test acc {acc:.2%}",
                  flush=True)

    medians = {n: statistics.median(v) for n, v in rates.items()}
    best = {n: max(v) for n, v in rates.items()}  # the least disturbed run of each, on a shared machine
    ratios = {f"multicard/{n}": medians["multicard"] / medians[n] for n in names[1:]}
    print(f"\n{args.epochs} timed epochs (+1 warm-up) x {args.repeats} interleaved rounds, mnist-5k train "
          f"({len(x)} samples), LeNet5, batch {BATCH}, Adam {LR}, torch threads {torch.get_num_threads()}\n")
    print("| loop | median samples/s | best | runs | median test acc | multicard / this (medians) |")
    print("|---|---:|---:|---|---:|---:|")
    for n in names:
        ratio = f"{ratios[f'multicard/{n}']:.2f}x" if n != "multicard" else "-"
        print(f"| {n} | {medians[n]:,.0f} | {best[n]:,.0f} | {', '.join(f'{r:,.0f}' for r in rates[n])} | "
              f"{statistics.median(accs[n]):.2%} | {ratio} |")
    result = {
        "benchmark": "loop_vs_plain", "medians_samples_per_s": medians, "ratios": ratios, "best_samples_per_s": best,
        "runs_samples_per_s": rates, "test_accuracy": accs,
        "multicard_summary_samples_per_s_all_epochs": summary_rates,
        "settings": {"data": "mnist-5k train split, augment off", "train_samples": len(x), "model": "LeNet5",
                     "batch_size": BATCH, "optimizer": f"Adam lr {LR}", "init_seed": SEED, "timed_epochs": args.epochs,
                     "warmup_epochs": 1, "repeats": args.repeats, "order": "rotated each round"},
        "hardware": machine(), "torch": torch.__version__, "multicard_source": source(),
        "command": shlex.join([".venv/bin/python", *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

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

import tempfile
import time

import torch
from _common import interleaved, load_mnist5k, machine, parse_args, report, timed_rate
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multicard
from multicard.models import LeNet5

BATCH, LR, SEED = 64, 1e-3, 0


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
        rate = timed_rate(out)
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
    args = parse_args(__doc__, "benchmarks/results/loop_vs_plain.json")
    train, test, x, y, x_test, y_test = load_mnist5k()
    summary_rates = []

    def run(name: str) -> tuple[float, float]:
        if name != "multicard":
            return run_plain(name, x, y, x_test, y_test, args.epochs)
        rate, all_epochs, acc = run_multicard(train, test, args.epochs)
        summary_rates.append(all_epochs)
        return rate, acc

    rates, accs = interleaved(["multicard", "plain-dataloader", "plain-indexing"], args.repeats, run)
    report("loop_vs_plain", "loop",
           f"{args.epochs} timed epochs (+1 warm-up) x {args.repeats} interleaved rounds, mnist-5k train "
           f"({len(x)} samples), LeNet5, batch {BATCH}, Adam {LR}, torch threads {torch.get_num_threads()}",
           rates, accs, summary_rates,
           settings={"data": "mnist-5k train split, augment off", "train_samples": len(x), "model": "LeNet5",
                     "batch_size": BATCH, "optimizer": f"Adam lr {LR}", "init_seed": SEED,
                     "timed_epochs": args.epochs, "warmup_epochs": 1, "repeats": args.repeats,
                     "order": "rotated each round"},
           hardware=machine(torch_threads=torch.get_num_threads()), out=args.out)


if __name__ == "__main__":
    main()

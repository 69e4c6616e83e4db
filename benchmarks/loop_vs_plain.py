"""multicard's loop (strategy single) against two hand-written PyTorch loops, in the same run, on the CPU or a card.

All three train the same model (same init seed) on the same mnist-5k training tensors (normalized as multicard's
ImageData does), batch 64, Adam 1e-3 (fused where this torch has it, in all three: the loops are compared, not
the optimizers), the same memory layout (multicard's channels-last auto is off here), for 1 warm-up epoch +
--epochs timed epochs. Only the timed epochs' training counts (evaluation excluded); multicard's rate comes
from its metrics.jsonl without epoch 1.
  plain-dataloader: DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True), collating sample by sample
  plain-indexing:   a randperm per epoch, tensors indexed one batch at a time (the hardest baseline); with
                    --device cuda the tensors and the permutation live on the card, as multicard's do there
--model tiny is a linear layer over the 784 pixels: its arithmetic is next to nothing, so the time per step is
the loop's own host work (what a small model on a fast card sees). Repeats are interleaved (the order rotates
each round); medians are reported.

    .venv/bin/python benchmarks/loop_vs_plain.py [--epochs 3] [--repeats 3] [--device cpu|cuda]
        [--model lenet5|tiny] [--out benchmarks/results/...]
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
from multicard.trainer.config import TrainConfig
from multicard.trainer.recipe import make_optimizer

BATCH, LR, SEED = 64, 1e-3, 0


class Tiny(nn.Module):
    """A linear layer over the 784 pixels: next to no arithmetic, so a step's time is the loop's host work."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(784, 10)

    def forward(self, x):
        return self.fc(x.flatten(1))


MODELS = {"lenet5": LeNet5, "tiny": Tiny}


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return (model(x).argmax(-1) == y).double().mean().item()


def run_multicard(train, test, epochs: int, model_name: str, device: str) -> tuple[float, float, float]:
    """(samples/s of the timed epochs, summary's samples/s over all epochs, final test accuracy)."""
    torch.manual_seed(SEED)
    model = MODELS[model_name]()
    with tempfile.TemporaryDirectory() as out:
        summary = multicard.train(model, train, test, strategy="single", devices=device, epochs=epochs + 1,
                                  batch_size=BATCH, lr=LR, scheduler="none", seed=SEED, augment=False, quiet=True,
                                  out=out, channels_last=False, device_data=device != "cpu")
        rate = timed_rate(out)
    return rate, summary["train_samples_per_s"], summary["test_accuracy"]


def run_plain(kind: str, x, y, x_test, y_test, epochs: int, model_name: str, device: str) -> tuple[float, float]:
    """(samples/s of the timed epochs, final test accuracy) of a hand-written loop."""
    torch.manual_seed(SEED)
    device = torch.device(device)
    model = MODELS[model_name]().to(device)
    optimizer = make_optimizer(list(model.parameters()), TrainConfig(lr=LR))  # Adam as multicard builds it
    criterion = nn.CrossEntropyLoss()
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, pin_memory=device.type == "cuda")
    x_on, y_on = x.to(device), y.to(device)  # plain-indexing: the whole set on the device, once

    def indexed():
        order = torch.randperm(len(x_on), device=device)
        for i in range(0, len(x_on), BATCH):
            idx = order[i:i + BATCH]
            yield x_on[idx], y_on[idx]

    model.train()
    for epoch in range(epochs + 1):
        if epoch == 1:  # epoch 0 is the warm-up
            sync(device)
            start = time.perf_counter()
        for inputs, targets in (loader if kind == "plain-dataloader" else indexed()):
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            loss = criterion(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    sync(device)
    seconds = time.perf_counter() - start
    return epochs * len(x) / seconds, accuracy(model, x_test.to(device), y_test.to(device))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parse_args(__doc__, "benchmarks/results/loop_vs_plain.json", extra=add_flags)
    train, test, x, y, x_test, y_test = load_mnist5k()
    summary_rates = []

    def run(name: str) -> tuple[float, float]:
        if name != "multicard":
            return run_plain(name, x, y, x_test, y_test, args.epochs, args.model, args.device)
        rate, all_epochs, acc = run_multicard(train, test, args.epochs, args.model, args.device)
        summary_rates.append(all_epochs)
        return rate, acc

    rates, accs = interleaved(["multicard", "plain-dataloader", "plain-indexing"], args.repeats, run)
    report("loop_vs_plain", "loop",
           f"{args.epochs} timed epochs (+1 warm-up) x {args.repeats} interleaved rounds, mnist-5k train "
           f"({len(x)} samples), {args.model} on {args.device}, batch {BATCH}, Adam {LR}, torch threads "
           f"{torch.get_num_threads()}", rates, accs, summary_rates,
           settings={"data": "mnist-5k train split, augment off", "train_samples": len(x), "model": args.model,
                     "device": args.device, "batch_size": BATCH, "optimizer": f"Adam lr {LR} (fused where possible, "
                     "all three)", "init_seed": SEED, "timed_epochs": args.epochs, "warmup_epochs": 1,
                     "repeats": args.repeats, "order": "rotated each round"},
           hardware=machine(torch_threads=torch.get_num_threads()), out=args.out, per_step=BATCH)


def add_flags(parser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the data held on the card)")
    parser.add_argument("--model", default="lenet5", choices=sorted(MODELS))


if __name__ == "__main__":
    main()

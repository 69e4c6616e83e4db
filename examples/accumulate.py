"""Gradient accumulation in your own loop: K micro-batches per optimizer step, and no gradient all-reduce on the
first K-1 of them (mc.no_backward_sync), so a big effective batch costs one reduction per step, not K.

The DataLoader's batch_size is the global micro-batch (split over the processes); an optimizer step takes
--accumulate of them, so it sees micro-batch x K samples whatever the number of processes.

Run:  .venv/bin/multicard run --devices cpu:2 examples/accumulate.py --epochs 3
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import multicard
from multicard.data import mnist5k
from multicard.models import LeNet5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro-batch", type=int, default=16, help="global samples per micro-batch")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    mc = multicard.Multicard()
    torch.manual_seed(0)
    model = LeNet5()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = mc.setup(model, optimizer)
    train, test = mnist5k.load()
    train_loader = mc.setup_dataloader(DataLoader(train, args.micro_batch, shuffle=True))
    test_loader = mc.setup_dataloader(DataLoader(test, 500), train=False)
    whole = len(train_loader) // args.accumulate * args.accumulate  # micro-batches that fill whole steps

    for epoch in range(1, args.epochs + 1):
        model.train()
        for i, (x, y) in enumerate(train_loader):
            if i == whole:  # the short tail of the epoch would be a smaller step: leave it out
                break
            last = (i + 1) % args.accumulate == 0
            with mc.no_backward_sync(model, enabled=not last):  # gradients add up locally until the last
                mc.backward(F.cross_entropy(model(x), y) / args.accumulate)  # the mean over the K micro-batches
            if last:
                optimizer.step()
                optimizer.zero_grad()
        model.eval()
        correct = torch.zeros((), device=mc.device)
        with torch.no_grad():
            for x, y in test_loader:
                correct += (model(x).argmax(1) == y).sum()
        correct = int(mc.all_reduce(correct))  # each test digit was seen by exactly one process
        mc.print(f"epoch {epoch}: {whole // args.accumulate} steps of {args.micro_batch * args.accumulate} samples, "
                 f"test accuracy {correct}/{len(test_loader.dataset)}")


if __name__ == "__main__":
    main()

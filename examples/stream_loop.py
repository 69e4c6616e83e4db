"""A loop over an IterableDataset (records streamed in order, no index to deal out), on N processes.

Every process reads the stream whole and keeps its part of each global batch (rows rank, rank + N, ...): N
processes take the steps one process takes. --plain runs the one-card original (the lines marked `# multicard`
left out).

Run:  .venv/bin/python examples/stream_loop.py                          (one process)
      .venv/bin/python examples/stream_loop.py --plain                  (the one-card original: the same weights)
      .venv/bin/multicard run --devices cpu:2 examples/stream_loop.py   (two processes on the CPU)
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import multicard


class Records(IterableDataset):
    """Synthetic records (x, y) with y a fixed function of x plus noise, generated in order from a seed: what a
    reader of files or a socket would yield."""

    def __init__(self, count: int, seed: int):
        self.count, self.seed = count, seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(self.count):
            x = torch.randn(8, generator=g)
            yield x, torch.tanh(x[:4].sum(0, keepdim=True)) + 0.05 * torch.randn(1, generator=g)


def main():
    parser = argparse.ArgumentParser(description="a small regression over a stream")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch")
    parser.add_argument("--records", type=int, default=640)
    parser.add_argument("--save", default="", help="write the trained weights here")
    parser.add_argument("--plain", action="store_true", help="the one-card original, without multicard")
    args = parser.parse_args()
    mc = None if args.plain else multicard.Multicard()  # multicard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(Records(args.records, seed=1), batch_size=args.batch_size)
    if mc is not None:  # multicard
        model, optimizer = mc.setup(model, optimizer)  # multicard
        loader = mc.setup_dataloader(loader)  # multicard: every process reads the stream, keeps its part
    for epoch in range(args.epochs):
        total, count = 0.0, 0
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, count = total + loss.item() * len(x), count + len(x)
        if mc is not None:  # multicard: every process's part of the epoch
            total, count = mc.all_reduce([total, count])  # multicard
        if mc is None or mc.is_main:
            print(f"epoch {epoch + 1}: train loss {float(total) / int(count):.5f}")
    if args.save:
        weights = model.state_dict()
        if mc is None:
            torch.save(weights, args.save)
        else:  # multicard
            mc.save(args.save, weights)  # multicard: rank 0 writes the plain state_dict


if __name__ == "__main__":
    main()

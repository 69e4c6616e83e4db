"""Where to compile: torch.compile(model) before mc.setup (nanoGPT's order) or after it (the trainer's --compile).
Prints the last loss, a digest of the trained weights (the same digest: the same weights, bit for bit) and the rate
of the steps after the first 10 (compiling happens in those); time the whole process from outside for the cost
with compiling. A 3-layer MLP (--width) on one fixed global batch of 64, SGD, --steps steps.

    .venv/bin/python benchmarks/compile_order.py --order before|after|eager [--steps 300] [--width 512] [--save FILE]
    .venv/bin/multicard run --devices cpu:2 benchmarks/compile_order.py --order before
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch
from torch import nn

import multicard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", choices=["before", "after", "eager"], default="before")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--save", default="", help="write the trained weights here (to compare two orders)")
    args = parser.parse_args()
    mc = multicard.Multicard()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, args.width), nn.GELU(), nn.Linear(args.width, args.width), nn.GELU(),
                        nn.Linear(args.width, 10))
    g = torch.Generator().manual_seed(1)
    x, y = mc.local(torch.randn(64, 64, generator=g)), mc.local(torch.randint(0, 10, (64,), generator=g))
    model = mc.setup(torch.compile(net) if args.order == "before" else net)
    forward = torch.compile(model) if args.order == "after" else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = time.perf_counter()
    for step in range(args.steps):
        if step == 10:
            start = time.perf_counter()
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(forward(x), y)
        mc.backward(loss)
        optimizer.step()
    rate = (args.steps - 10) / (time.perf_counter() - start)
    state = mc.state_dict(model)
    if mc.is_main:
        digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in state.values())).hexdigest()[:12]
        print(f"{args.order} on {mc.world_size}: loss {loss.item():.6f}, weights {digest}, {rate:.0f} steps/s "
              f"after 10, first key {next(iter(state))}")
        if args.save:
            torch.save(state, args.save)


if __name__ == "__main__":
    main()

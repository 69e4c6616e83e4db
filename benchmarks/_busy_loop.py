"""The user loop that benchmarks/busy_launch.py starts under each launcher: one small CNN trained for --steps
optimizer steps on noise (global batch 64), the same model, data and steps whoever starts it. The first argument
says how the loop joins its job: `multicard` (multicard.Multicard, under `multicard run`), `ddp` (plain
init_process_group, DistributedSampler and DDP, under torchrun) or `accelerate` (Accelerator(cpu=True), under
`accelerate launch`). Rank 0 prints one line: `loop_s S threads T` (the seconds of the steps alone)."""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def parts() -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                          nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 7 * 7, 10))
    data = TensorDataset(torch.randn(4096, 1, 28, 28), torch.randint(0, 10, (4096,)))
    return model, torch.optim.SGD(model.parameters(), lr=0.05), DataLoader(data, batch_size=64, shuffle=True)


def steps(model, optimizer, loader, backward, count: int) -> None:
    criterion, done = nn.CrossEntropyLoss(), 0
    while done < count:
        for x, y in loader:
            optimizer.zero_grad()
            backward(criterion(model(x), y))
            optimizer.step()
            done += 1
            if done == count:
                return


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("how", choices=["multicard", "ddp", "accelerate"])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    model, optimizer, loader = parts()
    if args.how == "multicard":
        import multicard

        mc = multicard.Multicard()
        model, optimizer = mc.setup(model, optimizer)
        loader, backward, rank = mc.setup_dataloader(loader), mc.backward, mc.rank
    elif args.how == "ddp":
        import torch.distributed as dist
        from torch.utils.data.distributed import DistributedSampler

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = nn.parallel.DistributedDataParallel(model)
        loader = DataLoader(loader.dataset, batch_size=64 // world, sampler=DistributedSampler(loader.dataset))
        backward = torch.Tensor.backward
    else:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        loader = DataLoader(loader.dataset, batch_size=64 // accelerator.num_processes, shuffle=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        backward, rank = accelerator.backward, accelerator.process_index
    start = time.perf_counter()
    steps(model, optimizer, loader, backward, args.steps)
    if rank == 0:
        print(f"loop_s {time.perf_counter() - start:.3f} threads {torch.get_num_threads()} "
              f"world {os.environ.get('WORLD_SIZE')}", flush=True)


if __name__ == "__main__":
    main()

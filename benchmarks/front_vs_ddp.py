"""The same user loop on 2 CPU processes, written with multicard's front object and by hand with raw DDP.

by hand:   torch.multiprocessing.spawn, init_process_group("gloo"), DistributedDataParallel(model),
           DataLoader(dataset, batch_size=global / 2, sampler=DistributedSampler(dataset, shuffle=True)),
           sampler.set_epoch(epoch), loss.backward().
multicard: multicard.launch(fn, devices="cpu:2"); in fn: mc.setup(model, optimizer),
           mc.setup_dataloader(DataLoader(dataset, batch_size=global, shuffle=True)), mc.backward(loss).
Both: LeNet5 (same init), Adam 1e-3, global batch 64, mnist-5k training split (augment off), the same loop body
and the same timing (barrier, 1 warm-up epoch, --epochs timed epochs, barrier), torch.set_num_threads(cores // 2)
in each process. Two datasets: a map-style Dataset served sample by sample (the DataLoader collates: the same
DataLoader on both sides, so the ratio is the front object's own overhead: target >= 0.98x), and a TensorDataset
(there setup_dataloader cuts whole batches by one index each: what a user of multicard gets for the same code).
Rate = global training samples / seconds of the timed epochs, on rank 0. Rounds rotate the order; medians reported.

    .venv/bin/python benchmarks/front_vs_ddp.py [--epochs 3] [--repeats 5] [--out benchmarks/results/...]
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _common import interleaved, load_mnist5k, machine, parse_args, report
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import multicard
from multicard.devices import cpu_cores
from multicard.launcher import free_port
from multicard.models import LeNet5

BATCH, LR, SEED, PROCS = 64, 1e-3, 0, 2


class Samples(Dataset):
    """Map-style, one sample per index, as most users' datasets are."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def dataset(kind: str, x: torch.Tensor, y: torch.Tensor) -> Dataset:
    return TensorDataset(x, y) if kind == "tensor" else Samples(x, y)


def timed(model, optimizer, loader, epochs: int, backward: Callable, set_epoch: Callable, barrier: Callable) -> float:
    """The user's loop, identical on both sides: seconds of the epochs after the first."""
    model.train()
    for epoch in range(epochs + 1):
        set_epoch(epoch)
        if epoch == 1:  # epoch 0 is the warm-up
            barrier()
            start = time.perf_counter()
        for inputs, targets in loader:
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            backward(loss)
            optimizer.step()
    barrier()
    return time.perf_counter() - start


def accuracy(model, x_test, y_test) -> float:
    with torch.no_grad():
        model.eval()
        return (model(x_test).argmax(-1) == y_test).double().mean().item()


def by_hand(rank: int, port: int, kind: str, x, y, x_test, y_test, epochs: int, result: str) -> None:
    torch.set_num_threads(max(1, cpu_cores() // PROCS))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=PROCS)
    torch.manual_seed(SEED)
    model = DistributedDataParallel(LeNet5())
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    data = dataset(kind, x, y)
    sampler = DistributedSampler(data, num_replicas=PROCS, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=BATCH // PROCS, sampler=sampler)
    seconds = timed(model, optimizer, loader, epochs, lambda loss: loss.backward(), sampler.set_epoch, dist.barrier)
    if rank == 0:
        Path(result).write_text(json.dumps({"rate": epochs * len(data) / seconds,
                                            "accuracy": accuracy(model.module, x_test, y_test)}))
    dist.destroy_process_group()


def with_multicard(mc, kind: str, x, y, x_test, y_test, epochs: int) -> tuple[float, float]:
    torch.manual_seed(SEED)
    model = LeNet5()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model, optimizer = mc.setup(model, optimizer)
    data = dataset(kind, x, y)
    loader = mc.setup_dataloader(DataLoader(data, batch_size=BATCH, shuffle=True))
    seconds = timed(model, optimizer, loader, epochs, mc.backward, lambda epoch: None, mc.barrier)
    return epochs * len(data) / seconds, accuracy(mc.unwrap(model), x_test, y_test) if mc.is_main else 0.0


def main() -> None:
    args = parse_args(__doc__, "benchmarks/results/front_vs_ddp.json")
    _, _, x, y, x_test, y_test = load_mnist5k()

    def run(name: str) -> tuple[float, float]:
        kind = "tensor" if name.endswith("TensorDataset") else "samples"
        if name.startswith("multicard"):
            return multicard.launch(with_multicard, kind, x, y, x_test, y_test, args.epochs, devices=f"cpu:{PROCS}")
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            mp.spawn(by_hand, args=(free_port(), kind, x, y, x_test, y_test, args.epochs, str(result)), nprocs=PROCS)
            out = json.loads(result.read_text())
        return out["rate"], out["accuracy"]

    names = ["multicard, Dataset", "by hand, Dataset", "multicard, TensorDataset", "by hand, TensorDataset"]
    rates, accs = interleaved(names, args.repeats, run)
    report("front_vs_ddp", "loop",
           f"{args.epochs} timed epochs (+1 warm-up) x {args.repeats} rotated rounds, mnist-5k train ({len(x)} "
           f"samples), LeNet5, {PROCS} processes (gloo), global batch {BATCH}, Adam {LR}",
           rates, accs, [],
           settings={"data": "mnist-5k train split, augment off", "train_samples": len(x), "model": "LeNet5",
                     "processes": PROCS, "backend": "gloo", "global_batch_size": BATCH,
                     "per_process_batch_size": BATCH // PROCS, "optimizer": f"Adam lr {LR}", "init_seed": SEED,
                     "timed_epochs": args.epochs, "warmup_epochs": 1, "repeats": args.repeats,
                     "order": "rotated each round"},
           hardware=machine(threads_per_process=max(1, cpu_cores() // PROCS)), out=args.out)


if __name__ == "__main__":
    main()

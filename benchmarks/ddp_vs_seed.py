"""multicard's ddp on 2 CPU processes against a hand-written seed-style DDP script, in the same run.

multicard:  multicard.train(LeNet5(), ..., strategy="ddp", devices="cpu:2"): it spawns its 2 processes itself.
seed-style: the seeds' recipe (/work/shared/seeds/002): torch.multiprocessing.spawn(nprocs=2),
            init_process_group("gloo") on 127.0.0.1 and a free port, DistributedSampler(shuffle=True) + set_epoch,
            DataLoader(TensorDataset, batch_size=global / 2) collating sample by sample, DistributedDataParallel,
            Adam 1e-3, torch.set_num_threads(cores // processes) in each process (as multicard does).
Both: LeNet5 (same init seed), mnist-5k training split (augment off), global batch 64, 1 warm-up epoch +
--epochs timed epochs. Rate = global samples / seconds of the timed epochs on rank 0 (the warm-up epoch is
excluded for both: multicard's from its metrics.jsonl, the seed script's with a barrier before and after).
Repeats alternate the order; medians are reported.

    .venv/bin/python benchmarks/ddp_vs_seed.py [--epochs 3] [--repeats 3] [--out benchmarks/results/...]
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import interleaved, load_mnist5k, machine, parse_args, report, timed_rate
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import multicard
from multicard.jobs.devices import cpu_cores
from multicard.jobs.launcher import free_port
from multicard.models import LeNet5

BATCH, LR, SEED, PROCS = 64, 1e-3, 0, 2


def seed_worker(rank: int, port: int, x, y, x_test, y_test, epochs: int, result: str) -> None:
    """One process of the seed-style script."""
    torch.set_num_threads(max(1, cpu_cores() // PROCS))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=PROCS)
    torch.manual_seed(SEED)
    model = DistributedDataParallel(LeNet5())
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=PROCS, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH // PROCS, sampler=sampler)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    criterion = nn.CrossEntropyLoss()
    model.train()
    for epoch in range(epochs + 1):
        sampler.set_epoch(epoch)
        if epoch == 1:  # epoch 0 is the warm-up
            dist.barrier()
            start = time.perf_counter()
        for inputs, targets in loader:
            loss = criterion(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        with torch.no_grad():
            model.eval()
            acc = (model.module(x_test).argmax(-1) == y_test).double().mean().item()
        Path(result).write_text(json.dumps({"rate": epochs * len(sampler) * PROCS / seconds, "accuracy": acc}))
    dist.destroy_process_group()


def run_seed(x, y, x_test, y_test, epochs: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        mp.spawn(seed_worker, args=(free_port(), x, y, x_test, y_test, epochs, str(result)), nprocs=PROCS)
        out = json.loads(result.read_text())
    return out["rate"], out["accuracy"]


def run_multicard(train, test, epochs: int) -> tuple[float, float, float]:
    """(samples/s of the timed epochs, summary's samples/s over all epochs, final test accuracy)."""
    torch.manual_seed(SEED)
    model = LeNet5()
    with tempfile.TemporaryDirectory() as out:
        summary = multicard.train(model, train, test, strategy="ddp", devices=f"cpu:{PROCS}", epochs=epochs + 1,
                                  batch_size=BATCH, lr=LR, scheduler="step", seed=SEED, augment=False, quiet=True,
                                  out=out)
        rate = timed_rate(out)
    return rate, summary["train_samples_per_s"], summary["test_accuracy"]


def main() -> None:
    args = parse_args(__doc__, "benchmarks/results/ddp_vs_seed.json")
    train, test, x, y, x_test, y_test = load_mnist5k()
    summary_rates = []

    def run(name: str) -> tuple[float, float]:
        if name != "multicard-ddp":
            return run_seed(x, y, x_test, y_test, args.epochs)
        rate, all_epochs, acc = run_multicard(train, test, args.epochs)
        summary_rates.append(all_epochs)
        return rate, acc

    rates, accs = interleaved(["multicard-ddp", "seed-ddp"], args.repeats, run)  # two names: the order alternates
    report("ddp_vs_seed", "ddp",
           f"{args.epochs} timed epochs (+1 warm-up) x {args.repeats} interleaved rounds, mnist-5k train "
           f"({len(x)} samples), LeNet5, {PROCS} processes (gloo), global batch {BATCH}, Adam {LR}",
           rates, accs, summary_rates,
           settings={"data": "mnist-5k train split, augment off", "train_samples": len(x), "model": "LeNet5",
                     "processes": PROCS, "backend": "gloo", "global_batch_size": BATCH,
                     "per_process_batch_size": BATCH // PROCS, "optimizer": f"Adam lr {LR}", "init_seed": SEED,
                     "timed_epochs": args.epochs, "warmup_epochs": 1, "repeats": args.repeats,
                     "order": "alternated each round"},
           hardware=machine(threads_per_process=max(1, cpu_cores() // PROCS)), out=args.out)


if __name__ == "__main__":
    main()

"""The same user loop written with multicard's front object and by hand with raw DDP, on 2 CPU processes.

by hand:   DistributedDataParallel(model), DataLoader(dataset, batch_size=global / 2,
           sampler=DistributedSampler(dataset, shuffle=True)), sampler.set_epoch(epoch), loss.backward().
multicard: mc.setup(model, optimizer), mc.setup_dataloader(DataLoader(dataset, batch_size=global, shuffle=True)),
           mc.backward(loss).
Both run in the SAME two processes (started by multicard.launch, one gloo process group), one timed epoch at a
time in turn, so that the machine's noise (shared cores, process placement) falls on both alike; the order
rotates every round. Each side: LeNet5 (same init), Adam 1e-3, global batch 64, mnist-5k training split (augment
off), one untimed warm-up epoch. Two datasets: a map-style Dataset served sample by sample (the DataLoader
collates on both sides: the ratio is the front object's own overhead, target >= 0.98x), and a TensorDataset
(where setup_dataloader cuts whole batches by one index each: what a multicard user gets for the same code).
Rate = global training samples / seconds of an epoch (barrier before and after), on rank 0.

    .venv/bin/python benchmarks/front_vs_ddp.py [--epochs 3] [--repeats 5] [--out benchmarks/results/...]
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import load_mnist5k, machine, parse_args, report
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import multicard
from multicard.jobs.devices import cpu_cores
from multicard.models import LeNet5

BATCH, LR, SEED, PROCS = 64, 1e-3, 0, 2
NAMES = ["multicard, Dataset", "by hand, Dataset", "multicard, TensorDataset", "by hand, TensorDataset"]


class Samples(Dataset):
    """Map-style, one sample per index, as most users' datasets are."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def side(mc, name: str, x, y) -> tuple[Callable[[], None], torch.nn.Module]:
    """One epoch of the user's loop (identical on both sides), set up the side's way; and the plain model."""
    torch.manual_seed(SEED)
    model = LeNet5()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    data = TensorDataset(x, y) if name.endswith("TensorDataset") else Samples(x, y)
    if name.startswith("multicard"):
        model, optimizer = mc.setup(model, optimizer)
        loader, backward, set_epoch = mc.setup_dataloader(DataLoader(data, BATCH, shuffle=True)), mc.backward, None
    else:
        model = DistributedDataParallel(model)
        sampler = DistributedSampler(data, num_replicas=mc.world_size, rank=mc.rank, shuffle=True, seed=SEED)
        loader = DataLoader(data, BATCH // mc.world_size, sampler=sampler)
        backward, set_epoch = (lambda loss: loss.backward()), sampler.set_epoch
    epochs = iter(range(10**9))

    def epoch() -> None:
        model.train()
        if set_epoch is not None:
            set_epoch(next(epochs))
        for inputs, targets in loader:
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            backward(loss)
            optimizer.step()

    return epoch, model.module


def job(mc, x, y, x_test, y_test, epochs: int, repeats: int) -> dict:
    made = {name: side(mc, name, x, y) for name in NAMES}
    sides = {name: run for name, (run, _) in made.items()}
    for run in sides.values():  # warm-up
        run()
    rates: dict[str, list[float]] = {name: [] for name in NAMES}
    for round_ in range(repeats):
        shift = round_ % len(NAMES)
        for name in [*NAMES[shift:], *NAMES[:shift]]:
            mc.barrier()
            start = time.perf_counter()
            for _ in range(epochs):
                sides[name]()
            mc.barrier()
            rates[name].append(epochs * len(x) / (time.perf_counter() - start))
            mc.print(f"round {round_ + 1}/{repeats}  {name:25s} {rates[name][-1]:8,.0f} samples/s")
    with torch.no_grad():
        accs = {name: [(model.eval()(x_test).argmax(1) == y_test).double().mean().item()]
                for name, (_, model) in made.items()}
    return rates, accs


def main() -> None:
    args = parse_args(__doc__, "benchmarks/results/front_vs_ddp.json")
    _, _, x, y, x_test, y_test = load_mnist5k()
    rates, accs = multicard.launch(job, x, y, x_test, y_test, args.epochs, args.repeats, devices=f"cpu:{PROCS}")
    report("front_vs_ddp", "loop",
           f"{args.epochs} timed epochs per turn x {args.repeats} rotated rounds, mnist-5k train ({len(x)} "
           f"samples), LeNet5, {PROCS} processes (gloo), global batch {BATCH}, Adam {LR}",
           rates, accs, [],
           settings={"data": "mnist-5k train split, augment off", "train_samples": len(x), "model": "LeNet5",
                     "processes": PROCS, "backend": "gloo", "global_batch_size": BATCH,
                     "per_process_batch_size": BATCH // PROCS, "optimizer": f"Adam lr {LR}", "init_seed": SEED,
                     "epochs_per_turn": args.epochs, "warmup_epochs": 1, "repeats": args.repeats,
                     "order": "rotated each round, all four in the same two processes"},
           hardware=machine(threads_per_process=max(1, cpu_cores() // PROCS)), out=args.out)
    result = json.loads(args.out.read_text())
    result["paired"] = {}
    for kind in ("Dataset", "TensorDataset"):  # multicard / by hand within each round, then the median of those
        ratios = [m / h for m, h in zip(rates[f"multicard, {kind}"], rates[f"by hand, {kind}"], strict=True)]
        result["paired"][kind] = {"median_ratio": statistics.median(ratios), "round_ratios": ratios}
        print(f"multicard / by hand, {kind}: median of per-round ratios {statistics.median(ratios):.3f}x "
              f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

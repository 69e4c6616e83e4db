"""multicard bench: the strategies side by side on synthetic data, against a plain DataLoader loop, in one run.

Every cell (a strategy on N devices, the plain loop, the fast path) runs in a fresh process, so that one cell's
memory never shows in another's (on the CPU, peak memory is a process's peak RSS). Beside the peak, each cell
reports what each process held of the parameters, their gradients and the optimizer state (memory.shard_bytes,
at the first optimizer step): the whole model under ddp, 1/N of it under fsdp. Each trains 1 warm-up epoch
plus --repeats timed epochs, with the clock read after synchronizing the cards; the median epoch is reported, and
the spread of the timed epochs beside it. The machine's 1-minute load average is read before and after each cell:
on a shared machine other work takes cores from a cell, and the report says so rather than print its numbers as if
the machine were quiet. The report (table, bench.json, bench.md, bench.png) comes from bench_report.py and
bench_files.py.

No torch at module level: the CLI imports this module to build its flags, and `multicard --help` must be fast.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from .. import rules
from ..errors import UsageError

SEED_BATCH, SEED_LR = 64, 1e-3  # the seeds' plain loop: DataLoader batch 64, Adam 1e-3
ON_CARDS = ("single", "dp", "dp-balanced", "ddp", "fsdp")
ON_CPU = ("single", "ddp", "fsdp")  # also on a card named twice: dp and dp-balanced drive all cards from one process
# synthetic samples per epoch: on the CPU about half a second of work per epoch on 2 quiet cores, so the default
# sweep stays well under 2 minutes on a shared machine; on cards sized for about a second on one H100 (a guess)
# wide-mlp (104M parameters): about a second per step of 64 on the CPU, so 4 steps an epoch there
SAMPLES = {("lenet5", "cpu"): 4096, ("resnet8", "cpu"): 512, ("wide-mlp", "cpu"): 256,
           ("lenet5", "cuda"): 262144, ("resnet8", "cuda"): 65536}
OTHER_SAMPLES = {"cpu": 1024, "cuda": 65536}
BATCH = {"cpu": 64, "cuda": 512}  # global batch of the strategy cells: on cards 64 would leave them idle
FAST_BATCH = {"cpu": 256, "cuda": 16384}  # fast path: data held on the device; on 2 CPU cores 256 beat 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/bench", help="folder for bench.json, bench.md, bench.png and cells/ "
                   "(default: runs/bench)")
    p.add_argument("--model", default="lenet5", help="model from the registry, e.g. lenet5, resnet8 or "
                   "wide-mlp (default: lenet5); data is synthetic, shaped as the model's input_shape")
    p.add_argument("--strategies", help="comma list (default: what this machine can run: "
                   "single,ddp,fsdp on the CPU; single,dp,dp-balanced,ddp,fsdp with cards)")
    p.add_argument("--devices", help="comma list of device counts (default: 1..cards; on the CPU 1..min(2, cores) "
                   "processes); a card id named twice rehearses on it: 0,0 runs 1 and 2 processes on card 0")
    p.add_argument("--samples", type=int, help="synthetic training samples per epoch (default: lenet5 4096 on "
                   "the CPU, 262144 on cards; resnet8 512 / 65536; wide-mlp 256 on the CPU; other models 1024 / "
                   "65536)")
    p.add_argument("--batch-size", type=int, help="global batch of the strategy cells (default: 64 on the CPU, "
                   "512 on cards; the plain DataLoader loop always uses 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed epochs after one warm-up epoch; the median is "
                   "reported (default: 3)")
    p.add_argument("--fast-batch", type=int, help="batch of the fast-path cell (default: 256 on the CPU, "
                   "16384 on a card)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="fast-path cell: fp32 or bf16 "
                   "autocast (default: fp32)")
    p.add_argument("--compile", action="store_true", help="fast-path cell: torch.compile the model")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain DataLoader loop (the baseline)")
    p.add_argument("--no-fast", action="store_true", help="skip the fast-path cell")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order (default: 0)")


def machine() -> tuple[int, int]:
    """(CUDA cards, CPU cores) of this machine, counted without starting CUDA."""
    from ..jobs.devices import count_cards, cpu_cores

    return count_cards()[0], cpu_cores()


def counts(text: str) -> list[int]:
    """--devices "1,2,4" -> [1, 2, 4], each a positive integer, sorted, none twice."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--devices {text}: give device counts as integers, e.g. 1,2") from None
    if any(v < 1 for v in values):
        raise UsageError(f"--devices {text}: each device count must be at least 1")
    return sorted(set(values))


def rehearsed(text: str | None, cards: int) -> tuple[int, ...] | None:
    """The card ids of a --devices that names a card twice (0,0: a rehearsal, the cell of N processes on its first
    N entries), else None: --devices counts devices."""
    entries = (text or "").lower().replace("cuda:", "").replace(" ", "").split(",")
    if len(set(entries)) == len(entries):
        return None
    from ..jobs.devices import parse

    return parse(text or "", cards).ids


def plan(args: argparse.Namespace, cards: int, cores: int) -> list[tuple[str, int]]:
    """Check the sweep and fill in the defaults of `args` for this machine; return its (strategy, count) cells.

    `single` runs only on one device; every other strategy on every count."""
    kind = "cuda" if cards else "cpu"
    args.rehearsal = rehearsed(args.devices, cards)
    runnable, available = (ON_CARDS, cards) if cards else (ON_CPU, cores)
    if args.rehearsal:
        runnable, available = ON_CPU, len(args.rehearsal)
    names = args.strategies.split(",") if args.strategies else list(runnable)
    for name in names:
        if name not in ON_CARDS:
            raise UsageError(f"--strategies {args.strategies}: unknown strategy {name!r}; choose from "
                             f"{', '.join(ON_CARDS)}")
        if name not in runnable:
            why = "drives every card from one process: it cannot rehearse on a card named twice" if args.rehearsal \
                else "needs CUDA cards and this machine has none"
            raise UsageError(f"--strategies {args.strategies}: {name} {why}; use {','.join(ON_CPU)}")
    numbers = list(range(1, available + 1)) if args.rehearsal else counts(args.devices) if args.devices else \
        list(range(1, (cards or min(2, cores)) + 1))
    if max(numbers) > available:
        what = f"{cards} cards" if cards else f"{cores} CPU cores (one process each)"
        raise UsageError(f"--devices {args.devices}: asks for {max(numbers)} devices, this machine has {what}")
    if "single" in names and 1 not in numbers:
        raise UsageError(f"--devices {args.devices}: single runs on one device only; include 1, or leave single "
                         f"out of --strategies")
    for flag, value in (("--repeats", args.repeats), ("--samples", args.samples),
                        ("--batch-size", args.batch_size), ("--fast-batch", args.fast_batch)):
        if value is not None:
            rules.at_least(value, f"{flag} {value}", 1)
    args.strategies, args.devices = ",".join(dict.fromkeys(names)), ",".join(map(str, numbers))
    args.samples = args.samples or SAMPLES.get((args.model, kind), OTHER_SAMPLES[kind])
    args.batch_size = args.batch_size or BATCH[kind]
    args.fast_batch = args.fast_batch or FAST_BATCH[kind]
    bad = [n for n in numbers if args.batch_size % n]
    if bad:
        raise UsageError(f"--batch-size {args.batch_size} does not split over {bad[0]} devices; use a multiple of "
                         f"every count in --devices")
    return [(name, n) for name in dict.fromkeys(names) for n in numbers if name != "single" or n == 1]


def device_spec(n: int, cards: int, rehearsal: tuple[int, ...] | None = None) -> str:
    """The --devices text of a cell: CPU processes (cpu / cpu:N) without cards, else the first N cards (in a
    rehearsal, the first N of its ids)."""
    if rehearsal:
        return "cuda:" + ",".join(map(str, rehearsal[:n]))
    if cards:
        return str(n)
    return "cpu" if n == 1 else f"cpu:{n}"


def isolated(fn: Callable[[dict], dict], spec: dict) -> dict:
    """fn(spec) in a fresh process (spawned, not forked: safe after CUDA or threads have started)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, spec).result()


def _quiet(folder: Path) -> None:
    """Send this process's output (and its children's) to folder/log.txt: the bench prints only its table."""
    folder.mkdir(parents=True, exist_ok=True)
    log = os.open(folder / "log.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)


def _data(spec: dict):
    import torch

    from .. import data, models

    torch.manual_seed(spec["seed"])  # the same initial weights in every cell
    model = models.build(spec["model"])
    train_data, _ = data.load("synthetic", synthetic_samples=spec["samples"], seed=spec["seed"],
                              shape=getattr(model, "input_shape", (1, 28, 28)))
    return model, train_data


def run_cell(spec: dict) -> dict:
    """One strategy cell: multicard.train, its per-epoch rates read back from metrics.jsonl."""
    from ..trainer.run import train

    out = Path(spec["out"])
    _quiet(out)
    model, train_data = _data(spec)
    summary = train(model, train_data, None, strategy=spec["strategy"], devices=spec["devices"],
                    epochs=1 + spec["repeats"], batch_size=spec["batch"], seed=spec["seed"], augment=False,
                    quiet=True, out=str(out), device_data=spec["fast"], precision=spec["precision"],
                    compile=spec["compile"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rates": [r["samples_per_s"] for r in rows[1:]], "loss": rows[-1]["train_loss"],
            "peak_memory_mb": summary["peak_memory_mb"], "card_used_mb": summary["card_used_mb"],
            "shard_mb": summary["shard_mb"], "world_size": summary["world_size"],
            "device_names": summary["devices"]}


def run_seed_loop(spec: dict) -> dict:
    """The plain loop (as the posts wrote it) on the first device: DataLoader over float tensors (collated sample
    by sample), batch 64, shuffle, Adam 1e-3, loss.item() every step; the same warm-up / repeats rule."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ..yourloop import memory

    _quiet(Path(spec["out"]))
    model, train_data = _data(spec)
    device = torch.device("cuda", 0) if spec["cards"] else torch.device("cpu")
    cards = [0] if spec["cards"] else []
    x, y = train_data[:]  # normalized float images, as the seeds' transforms give them
    loader = DataLoader(TensorDataset(x, y), batch_size=SEED_BATCH, shuffle=True)
    model = model.to(device)
    optimizer, criterion = torch.optim.Adam(model.parameters(), lr=SEED_LR), nn.CrossEntropyLoss()
    memory.reset(cards)
    rates, loss, held = [], float("nan"), None
    for _ in range(1 + spec["repeats"]):
        total, seen = 0.0, 0
        if cards:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad()
            step_loss = criterion(model(inputs), targets)
            step_loss.backward()
            optimizer.step()
            if held is None:  # as multicard measures it: at the first optimizer step, gradients still there
                held = {k: round(v / memory.MB, 2) for k, v in memory.shard_bytes(model, optimizer).items()}
            total, seen = total + step_loss.item() * len(targets), seen + len(targets)
        if cards:
            torch.cuda.synchronize()
        rates.append(seen / (time.perf_counter() - start))
        loss = total / seen
    names = [f"cuda:0 {torch.cuda.get_device_name(0)}"] if cards else ["cpu"]
    return {"rates": rates[1:], "loss": loss, "peak_memory_mb": memory.peak_mb(cards),
            "card_used_mb": memory.card_used_mb(cards), "shard_mb": [held], "world_size": 1, "device_names": names}


def row(result: dict, strategy: str, devices: int, batch: int) -> dict:
    """A cell's numbers: the median timed epoch, ms per optimizer step, memory and its imbalance, and what each
    process held of the parameters, gradients and optimizer state (MB; under fsdp, its shards)."""
    rate = statistics.median(result["rates"])
    memory = result["peak_memory_mb"]
    return {"strategy": strategy, "devices": devices, "world_size": result["world_size"], "batch_size": batch,
            "samples_per_s": rate, "epoch_samples_per_s": result["rates"], "ms_per_step": 1000 * batch / rate,
            "peak_memory_mb": memory, "imbalance": max(memory) / statistics.mean(memory) if min(memory) > 0 else None,
            "card_used_mb": result["card_used_mb"], "shard_mb": result["shard_mb"],
            "loss": result["loss"], "device_names": result["device_names"]}


def load() -> float | None:
    """The machine's 1-minute load average (threads running or waiting for a core, every process's, this bench's
    own included); None where the OS keeps none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def measured(fn: Callable[[dict], dict], spec: dict, strategy: str, n: int, batch: int, cores: int) -> dict:
    """fn(spec) in a fresh process, as a row, with the load average just before and just after it and the cores
    its processes run on: on the CPU all of the sweep's cores (single takes one thread per core, ddp and fsdp give
    each of N processes cores // N threads), with cards the card processes' host threads share them too."""
    before = load()
    cell = {**row(isolated(fn, spec), strategy, n, batch), "load_before": before, "load_after": load(),
            "cores": cores}
    announce(cell)
    return cell


def sweep(args: argparse.Namespace, cells: list[tuple[str, int]], cards: int, cores: int) -> dict:
    """Run the plain loop, every cell and the fast path; each in its own process, one after another."""
    out = Path(args.out) / "cells"
    common = {"model": args.model, "samples": args.samples, "seed": args.seed, "repeats": args.repeats,
              "cards": cards, "precision": "fp32", "compile": False, "fast": False}
    results: dict = {"cells": []}
    if not args.no_baseline:
        spec = {**common, "out": str(out / "plain-loop")}
        results["baseline"] = measured(run_seed_loop, spec, "plain loop", 1, SEED_BATCH, cores)
    for strategy, n in cells:
        spec = {**common, "strategy": strategy, "devices": device_spec(n, cards, args.rehearsal),
                "batch": args.batch_size, "out": str(out / f"{strategy}-{n}")}
        results["cells"].append(measured(run_cell, spec, strategy, n, args.batch_size, cores))
    if not args.no_fast:
        spec = {**common, "strategy": "single", "devices": device_spec(1, cards, args.rehearsal), "fast": True,
                "batch": args.fast_batch, "precision": args.precision, "compile": args.compile,
                "out": str(out / "fast")}
        results["fast"] = measured(run_cell, spec, "single fast", 1, args.fast_batch, cores)
    return results


def announce(cell: dict) -> None:
    rates = cell["epoch_samples_per_s"]
    print(f"bench: {cell['strategy']} x{cell['devices']}: {cell['samples_per_s']:,.0f} samples/s (epochs "
          f"{min(rates):,.0f}-{max(rates):,.0f}; load {cell['load_before']} -> {cell['load_after']} on "
          f"{cell['cores']} cores)", flush=True)


def run(args: argparse.Namespace) -> int:
    from .. import models
    from . import bench_files, bench_report

    if args.model not in models.MODELS:
        raise UsageError(f"--model {args.model}: unknown; choose one of {', '.join(sorted(models.MODELS))}")
    cards, cores = machine()
    cells = plan(args, cards, cores)
    if args.rehearsal:
        from ..jobs.devices import Devices, rehearsal

        print(f"multicard: {rehearsal(Devices('cuda', args.rehearsal))}", flush=True)
    begin = time.perf_counter()
    results = sweep(args, cells, cards, cores)
    report = bench_report.build(args, results, cards, cores, time.perf_counter() - begin)
    print(bench_report.table(report))
    for path in bench_files.write(report, Path(args.out)):
        print(f"bench: wrote {path}")
    return 0

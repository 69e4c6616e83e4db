"""Accumulation by hand (`if step % accumulation_steps == 0: optimizer.step()`, as Accelerate's NLP example and
many scripts write it): every micro-batch's backward all-reduces, against the same loop with the one line
`with mc.no_backward_sync(model, enabled=(step + 1) % accumulation_steps != 0):` around forward and backward,
which all-reduces once per optimizer step.

Both run in the SAME two processes (multicard.launch, one gloo group on the CPU), one timed turn at a time, the
order alternating every round, so that the shared machine's noise falls on both alike. Each side: an MLP of
4 x Linear(1024, 1024) (4.2 M parameters, 16.8 MB of gradients to all-reduce), micro-batches of 16 rows per
process, 4 micro-batches per optimizer step, SGD; one untimed warm-up turn each. Rate = optimizer steps per
second on rank 0 (barrier before and after each turn). Both sides end with the same weights (checked).

    .venv/bin/python benchmarks/hand_accumulation.py [--steps 20] [--repeats 5] [--out benchmarks/results/...]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
from _common import machine, save
from torch import nn

import multicard
from multicard.jobs.devices import cpu_cores

PROCS, WIDTH, ROWS, ACCUMULATE = 2, 1024, 16, 4
NAMES = ["every micro-batch all-reduced", "no_backward_sync(enabled=...)"]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def turn(mc, net, optimizer, batches, skip: bool) -> None:
    """The script's loop over `batches` micro-batches; `skip`: the one line that skips the all-reduce."""
    for step, x in enumerate(batches):
        last = (step + 1) % ACCUMULATE == 0
        with mc.no_backward_sync(net, enabled=not last) if skip else contextlib.nullcontext():
            mc.backward(net(x).pow(2).mean() / ACCUMULATE)
        if last:
            optimizer.step()
            optimizer.zero_grad()


def job(mc, steps: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(mc.rank)
    batches = [torch.randn(ROWS, WIDTH, generator=g) for _ in range(steps * ACCUMULATE)]
    sides = {}
    for name in NAMES:
        net = mc.setup(model())
        sides[name] = (net, torch.optim.SGD(net.parameters(), lr=1e-3))
    for name, (net, optimizer) in sides.items():  # warm-up
        turn(mc, net, optimizer, batches[:2 * ACCUMULATE], name == NAMES[1])
    rates: dict[str, list[float]] = {name: [] for name in NAMES}
    for round_ in range(repeats):
        for name in NAMES if round_ % 2 == 0 else NAMES[::-1]:
            net, optimizer = sides[name]
            mc.barrier()
            start = time.perf_counter()
            turn(mc, net, optimizer, batches, name == NAMES[1])
            mc.barrier()
            rates[name].append(steps / (time.perf_counter() - start))
            mc.print(f"round {round_ + 1}/{repeats}  {name:31s} {rates[name][-1]:6.2f} steps/s")
    first, second = (sides[name][0].module.state_dict() for name in NAMES)
    same = max((first[k] - second[k]).abs().max().item() for k in first)
    return {"rates": rates, "max_weight_difference": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed turn")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (the order alternates)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hand_accumulation.json"))
    args = parser.parse_args()
    result = multicard.launch(job, args.steps, args.repeats, devices=f"cpu:{PROCS}")
    medians = {name: statistics.median(r) for name, r in result["rates"].items()}
    ratio = medians[NAMES[1]] / medians[NAMES[0]]
    per_round = [b / a for a, b in zip(*result["rates"].values(), strict=True)]
    print(f"\n| loop, {PROCS} gloo processes, {ACCUMULATE} micro-batches a step | median steps/s | runs |")
    print("|---|---:|---|")
    for name, runs in result["rates"].items():
        print(f"| {name} | {medians[name]:.2f} | {', '.join(f'{r:.2f}' for r in runs)} |")
    print(f"\nthe one line: {ratio:.2f}x the optimizer steps per second by medians, "
          f"{statistics.median(per_round):.2f}x by the median of per-round ratios ({min(per_round):.2f}x to "
          f"{max(per_round):.2f}x); weights differ by at most "
          f"{result['max_weight_difference']:.1e}")
    record = {"benchmark": "hand_accumulation", "medians_steps_per_s": medians, "ratio": ratio,
              "per_round_ratios": per_round, "median_per_round_ratio": statistics.median(per_round),
              "runs_steps_per_s": result["rates"],
              "max_weight_difference": result["max_weight_difference"],
              "settings": {"processes": PROCS, "backend": "gloo", "model": f"MLP 4 x Linear({WIDTH}, {WIDTH})",
                           "rows_per_micro_batch_per_process": ROWS, "micro_batches_per_step": ACCUMULATE,
                           "steps_per_turn": args.steps, "repeats": args.repeats, "warmup_steps": 2},
              "hardware": machine(threads_per_process=max(1, cpu_cores() // PROCS))}
    save(args.out, record)


if __name__ == "__main__":
    main()

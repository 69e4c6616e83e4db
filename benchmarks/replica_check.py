"""What the replica check costs: a training step with and without it, ddp on 2 gloo processes on the CPU.

Result (AMD EPYC, 2 cores, idle, torch 2.13.0+cpu, 2026-11-26, `--repeats 9`, results/replica_check.json): one
check costs 25.4% of a LeNet-5 step (2.0 ms against 7.9 ms, mostly the gloo all-reduce) and 4.6% of a wide-MLP
step (36 ms against 787 ms, mostly reading 397 MiB of weights); at the default K = 100 steps between checks that
is 0.25% and 0.05% of the training time. K = 50 would be the smallest
round K under 1% here; 100 leaves room for cards, where a step is shorter (not measured on a card).

Two models: LeNet-5 (61,706 parameters, Adam, global batch 64 of MNIST-shaped noise) and the wide MLP (104M
parameters, SGD, global batch 64). In the same two processes (multicard.launch), rounds of three timings, their
order rotated each round so that the machine's noise falls on all alike: steps with the check off, steps checked
after every one (replica_check_every=1), and the periodic check alone (the fingerprint and its one all-reduce).
Each timing is framed by barriers and read on rank 0. The check's cost at K steps between checks is the check's
time over K steps' time (medians); the script also prints the smallest of 10, 20, 50, 100, 200, 500 under 1% for
both models. (A step checked after each one against one unchecked is printed too; on a shared machine their
difference is within the noise for LeNet-5.)

    .venv/bin/python benchmarks/replica_check.py [--repeats 5] [--out benchmarks/results/replica_check.json]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import machine, save

import multicard
from multicard.jobs.devices import cpu_cores
from multicard.models import LeNet5
from multicard.models.wide_mlp import WideMLP

PROCS, BATCH = 2, 64
MODELS = {"LeNet-5": (LeNet5, "adam", 50), "wide MLP 104M": (WideMLP, "sgd", 3)}  # class, optimizer, steps a timing
KS = (10, 20, 50, 100, 200, 500)


def timings(build, optimizer_name: str, steps: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per step: unchecked, checked after every step, and the periodic check alone; `repeats` rotated
    rounds. Two Multicards in the same processes (they share the process group), each with its own copy."""
    sides = {}
    for name, options in (("step", {"replica_check": "off"}), ("step, checked", {"replica_check_every": 1})):
        mc = multicard.Multicard("ddp", "cpu", **options)
        torch.manual_seed(0)
        model = build()
        kind = torch.optim.Adam if optimizer_name == "adam" else torch.optim.SGD
        sides[name] = (mc, *mc.setup(model, kind(model.parameters(), lr=1e-3)))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    x, y = sides["step"][0].local(x), sides["step"][0].local(y)

    def step(name: str) -> Callable[[], None]:
        mc, model, optimizer = sides[name]

        def run() -> None:
            optimizer.zero_grad(set_to_none=True)
            mc.backward(F.cross_entropy(model(x), y))
            optimizer.step()
        return run

    checked = sides["step, checked"][0]
    kinds = {"step": step("step"), "step, checked": step("step, checked"),
             "check": lambda: checked._replicas.check("timed", first=False)}  # what each K-th step adds
    for run in kinds.values():  # warm-up
        run()
    seconds: dict[str, list[float]] = {name: [] for name in kinds}
    names = list(kinds)
    for round_ in range(repeats):
        for name in [*names[round_ % 3:], *names[:round_ % 3]]:
            checked.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                kinds[name]()
            checked.barrier()
            seconds[name].append((time.perf_counter() - start) / steps)
    for mc, *_ in sides.values():
        mc.close()
    return seconds


def job(mc, repeats: int) -> dict:
    return {name: timings(build, opt, steps, repeats) for name, (build, opt, steps) in MODELS.items()}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="rotated rounds")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/replica_check.json"))
    args = parser.parse_args()
    found = multicard.launch(job, args.repeats, devices=f"cpu:{PROCS}")
    print(f"\nddp on {PROCS} gloo processes, global batch {BATCH}, {args.repeats} rotated rounds; medians\n")
    print("| model | step | step, checked | check alone | check / step | cost at K=10 / 100 / 500 |")
    print("|---|---:|---:|---:|---:|---:|")
    summary = {}
    for name, seconds in found.items():
        median = {k: statistics.median(v) for k, v in seconds.items()}
        ratio = median["check"] / median["step"]
        summary[name] = {"median_s": median, "check_over_step": ratio,
                         "cost_at_k": {k: ratio / k for k in KS}, "runs_s": seconds}
        print(f"| {name} | {median['step'] * 1e3:.2f} ms | {median['step, checked'] * 1e3:.2f} ms | "
              f"{median['check'] * 1e3:.2f} ms | {ratio:.1%} | "
              f"{ratio / 10:.2%} / {ratio / 100:.3%} / {ratio / 500:.3%} |")
    default = next((k for k in KS if all(s["check_over_step"] / k < 0.01 for s in summary.values())), None)
    print(f"\nsmallest K of {KS} under 1% of a step for both: {default}")
    result = {"benchmark": "replica_check", "models": summary, "smallest_k_under_1pct": default,
              "settings": {"processes": PROCS, "backend": "gloo", "global_batch_size": BATCH,
                           "optimizers": {n: o for n, (_, o, _) in MODELS.items()},
                           "steps_per_timing": {n: s for n, (_, _, s) in MODELS.items()}, "repeats": args.repeats},
              "hardware": machine(threads_per_process=max(1, cpu_cores() // PROCS))}
    save(args.out, result)


if __name__ == "__main__":
    main()

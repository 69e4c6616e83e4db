"""What the seams' checks cost a training step (issues 40 and 50): the job's pre-step hook on every optimizer step
(yourloop/job_state.py and outside_params.py: is this the job's optimizer, are its parameters held by a set-up
model?), the set-up model's forward asking whether it is the first training one (yourloop/inputs_alike.py), and
mc.local's fingerprint of each global batch and of torch's random state, compared at the next reduced forward (one
all-reduce); ddp on 2 gloo processes on the CPU.

Result: not measured on an idle machine yet (run the command below on one; the first figures, taken on a busy
2-core machine, are preliminary and not recorded here).

Two loops. The main job: multicard.train's LeNet-5 on mnist-5k (its default recipe), ddp on 2 processes; its
step is the second epoch's seconds over its optimizer steps, and it pays the hook and the forward's question (it
cuts nothing with mc.local). A user loop: LeNet-5, Adam, a global batch of 64 MNIST-shaped noise images cut by
mc.local (two calls a step), 100 steps a timing. In the user loop's two processes, each piece of added work is
timed on its own over many calls (the hook on the loop's own optimizer, the forward's question, mc.local's count
with every 100th call's check: the cost at the default K, spread), and the 100 steps are timed in rotated rounds
as shipped, with the checks taken out (the hook removed, mc.local's check skipped), and with a temperature outside
the model in the set-up optimizer (its gradient averaged at the step, one small all-reduce). The cost per
step is the pieces' sum over the median step; the rounds show the same within the machine's noise.

    .venv/bin/python benchmarks/seams.py [--repeats 5] [--out benchmarks/results/seams.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import load_mnist5k, machine, save
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import multicard
from multicard.jobs.devices import cpu_cores
from multicard.models import LeNet5

PROCS, BATCH, STEPS, CALLS = 2, 64, 100, 20_000  # processes, global batch, steps a timing, calls a piece


def per_call(fn: Callable[[], object], calls: int = CALLS) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def user_loop(mc, repeats: int) -> dict:
    job = mc._job_state  # what the job knows in this process: its hook and its checks, timed and taken out below
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    torch.manual_seed(0)
    model = mc.setup(LeNet5())
    optimizer = mc.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    t = nn.Parameter(torch.ones(()))  # a temperature outside the model
    tempered = mc.setup(LeNet5())
    t_optimizer = mc.setup_optimizers(torch.optim.Adam([*tempered.parameters(), t], lr=1e-3))

    def steps(net, opt, scale: nn.Parameter | None = None) -> Callable[[], None]:
        def run() -> None:
            for _ in range(STEPS):
                opt.zero_grad(set_to_none=True)
                out = net(mc.local(x))
                mc.backward(F.cross_entropy(out * scale if scale is not None else out, mc.local(y)))
                opt.step()
        return run

    def taken_out(run: Callable[[], None]) -> Callable[[], None]:
        def without() -> None:
            job._hook.remove()
            job.warned.add("alike")  # mc.local: no fingerprint, no check
            try:
                run()
            finally:
                job._hook = register_optimizer_step_pre_hook(job._before_step)
                job.warned.discard("alike")
        return without

    kinds = {"as shipped": steps(model, optimizer), "checks taken out": taken_out(steps(model, optimizer)),
             "with a temperature": steps(tempered, t_optimizer, t)}
    for run in kinds.values():  # warm-up (the first training forward's comparison happens here)
        run()
    inputs = ((mc.local(x),), {})

    def two_cuts_and_a_step() -> None:  # a step's two mc.local calls and their comparison, waited for at once
        job.inputs.cut(x)  # (in a loop, the comparison's all-reduce goes by beside the forward and backward:
        job.inputs.cut(y)  # this piece is its cost with nothing to hide it behind)
        job.inputs.compare()
        job.inputs.judge()

    pieces = {"pre-step hook": per_call(lambda: job._before_step(optimizer, (), {})),
              "forward's question": per_call(lambda: job.inputs.forwarded(inputs, True)),
              "mc.local x2 + the step's check": per_call(two_cuts_and_a_step, CALLS // 10)}  # both ranks pair up
    seconds: dict[str, list[float]] = {name: [] for name in kinds}
    names = list(kinds)
    for round_ in range(repeats):
        for name in [*names[round_ % 3:], *names[:round_ % 3]]:
            mc.barrier()
            start = time.perf_counter()
            kinds[name]()
            mc.barrier()
            seconds[name].append((time.perf_counter() - start) / STEPS)
    return {"pieces_s": pieces, "step_s": seconds}


def main_job_step() -> float:
    """Seconds per optimizer step of the main job (its default recipe, 2 epochs: the first is left out), ddp on
    PROCS processes."""
    train, test = load_mnist5k()[:2]
    with tempfile.TemporaryDirectory() as out:
        summary = multicard.train(LeNet5(), train, test, strategy="ddp", devices=f"cpu:{PROCS}", epochs=2, quiet=True,
                                  out=out)
    return summary["global_batch_size"] / summary["train_samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="rotated rounds of the user loop")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/seams.json"))
    args = parser.parse_args()
    loop = multicard.launch(user_loop, args.repeats, devices=f"cpu:{PROCS}")
    main_step = main_job_step()
    pieces = loop["pieces_s"]
    medians = {name: statistics.median(v) for name, v in loop["step_s"].items()}
    user = pieces["pre-step hook"] + pieces["forward's question"] + pieces["mc.local x2 + the step's check"]
    main_added = pieces["pre-step hook"] + pieces["forward's question"]
    rows = {"main job (multicard train)": (main_step, main_added),
            "user loop (mc.local)": (medians["as shipped"], user)}
    print(f"\nddp on {PROCS} gloo processes; pieces over {CALLS:,} calls, the user loop's steps in {args.repeats} "
          f"rotated rounds of {STEPS} (medians)\n")
    print(" | ".join(f"{name} {seconds * 1e6:.2f} µs" for name, seconds in pieces.items()))
    print("\n| loop | step | added per step | cost |\n|---|---:|---:|---:|")
    for name, (step, added) in rows.items():
        print(f"| {name} | {step * 1e3:.2f} ms | {added * 1e6:.1f} µs | {added / step:.3%} |")
    print(f"\nthe user loop as shipped against the checks taken out, by medians: "
          f"{medians['as shipped'] / medians['checks taken out']:.3f}x the step's time")
    print("\n| user loop | step (median) | runs |\n|---|---:|---|")
    for name, runs in loop["step_s"].items():
        print(f"| {name} | {medians[name] * 1e3:.2f} ms | {', '.join(f'{r * 1e3:.2f}' for r in runs)} |")
    save(args.out, {"benchmark": "seams", "pieces_s": pieces, "user_loop_step_s": loop["step_s"],
                    "user_loop_median_s": medians, "main_job_step_s": main_step,
                    "cost_per_step": {name: added / step for name, (step, added) in rows.items()},
                    "settings": {"processes": PROCS, "backend": "gloo", "global_batch_size": BATCH,
                                 "steps_per_timing": STEPS, "calls_per_piece": CALLS, "repeats": args.repeats},
                    "hardware": machine(threads_per_process=max(1, cpu_cores() // PROCS))}, note="\n")


if __name__ == "__main__":
    main()

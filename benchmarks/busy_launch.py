"""A user's 2-process loop on the CPU, started by `multicard run`, by torchrun (plain DDP) and by `accelerate launch`,
beside 0, 2 and 4 spinning processes: whether multicard's launch makes its ranks wait on a busy machine.

Each run is a whole command in a fresh process, timed from start to exit, after one untimed start of each
launcher; benchmarks/_busy_loop.py is the loop (the same model, data and steps under every launcher) and prints
the seconds of its steps. The spinners (`python -c "while True: pass"`) each run in a session of their own, as
other people's work does (with --same-session: in this script's session, as `cmd &` from the user's shell). Runs
are interleaved: each round runs every launcher at every load, the launchers' order rotating. Per load: min /
median / max of the whole command, the median of the loop alone and of the CPU seconds (the command's processes
together), and multicard's median over the fastest other launcher's (the goal: at most 1.00x at every load).

    .venv/bin/python benchmarks/busy_launch.py [--rounds 3] [--steps 300] [--spinners 0,2,4] [--out FILE]

The Accelerate row needs Accelerate in this venv (`.venv/bin/pip install accelerate==1.15.0`); without it the row
is left out, and said so.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import machine, save, spin, stop

LOOP = str(Path(__file__).with_name("_busy_loop.py"))
BIN = Path(sys.executable).parent
LAUNCHERS = {
    "multicard run": [sys.executable, "-m", "multicard", "run", "--quiet", "--devices", "cpu:2", LOOP, "multicard"],
    "torchrun (DDP)": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", LOOP,
                       "ddp"],
    "accelerate launch": [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
                          "1", "--mixed_precision", "no", "--dynamo_backend", "no", LOOP, "accelerate"],
}
CLEARED = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # each launcher's own choice


def run(command: list[str], steps: int, timeout: float) -> dict:
    """One whole command: wall seconds, the loop's seconds and threads (rank 0's line), CPU seconds of all its
    processes, the load average as it ended."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    try:
        done = subprocess.run([*command, "--steps", str(steps)], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"wall_s": None, "loop_s": None, "cpu_s": None, "threads": None, "load": os.getloadavg()[0]}
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    said = [line.split() for line in done.stdout.splitlines() if line.startswith("loop_s ")]
    if done.returncode or not said:
        raise SystemExit(f"{command[0]} ... failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": wall, "loop_s": float(said[0][1]), "cpu_s": cpu, "threads": int(said[0][3]),
            "load": os.getloadavg()[0]}


def spread(runs: list[dict], key: str) -> tuple[float, float, float] | None:
    values = [r[key] for r in runs if r[key] is not None]
    return (min(values), statistics.median(values), max(values)) if values else None


def autogroup() -> str:
    """Whether Linux shares the cores between sessions first (what a launcher's sessions change under load)."""
    try:
        return {"1": "on", "0": "off"}[Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()]
    except (OSError, KeyError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of the loop per run (default: 300)")
    parser.add_argument("--spinners", default="0,2,4", help="spinning processes beside the job, per load "
                        "(default: 0,2,4)")
    parser.add_argument("--same-session", action="store_true", help="spinners in this script's session")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one command may take (default: 900)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/busy_launch.json"))
    args = parser.parse_args()
    launchers = dict(LAUNCHERS)
    if importlib.util.find_spec("accelerate") is None:
        del launchers["accelerate launch"]
        print("accelerate is not installed here: its row is left out (.venv/bin/pip install accelerate==1.15.0)")
    loads = [int(n) for n in args.spinners.split(",")]
    runs: dict = {n: {name: [] for name in launchers} for n in loads}
    names = list(launchers)
    for name in names:  # untimed: the first start of each reads its files from disk (and compiles them, once)
        run(launchers[name], 10, args.timeout)
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for n in loads:
            spinners = spin(n, new_session=not args.same_session)
            try:
                time.sleep(1 if n else 0)  # the spinners are running before the first command starts
                for name in order:
                    r = run(launchers[name], args.steps, args.timeout)
                    runs[n][name].append(r)
                    shown = "timed out" if r["wall_s"] is None else \
                        f"{r['wall_s']:6.1f} s wall, loop {r['loop_s']:6.2f} s, CPU {r['cpu_s']:6.1f} s"
                    print(f"round {round_ + 1}/{args.rounds}  {n} spinning  {name:18s} {shown}  load {r['load']:.1f}",
                          flush=True)
            finally:
                stop(spinners)
    hardware = machine(autogroup=autogroup())
    print(f"\n{hardware['cpu']}, {hardware['cores']} cores, torch {hardware['torch']}, autogroup "
          f"{hardware['autogroup']}; {args.steps} steps, {args.rounds} interleaved rounds; spinners in "
          f"{'this session' if args.same_session else 'sessions of their own'}\n")
    print("| spinning | launcher | wall s min / median / max | loop s (median) | CPU s (median) | threads | "
          "multicard / fastest other (wall medians) |")
    print("|---:|---|---|---:|---:|---:|---:|")
    ratios = {}
    for n in loads:
        wall = {name: spread(runs[n][name], "wall_s") for name in names}
        others = [wall[name][1] for name in names if name != "multicard run" and wall[name]]
        if wall["multicard run"] and others:
            ratios[n] = wall["multicard run"][1] / min(others)
        for name in names:
            w, loop, cpu = wall[name], spread(runs[n][name], "loop_s"), spread(runs[n][name], "cpu_s")
            threads = sorted({r["threads"] for r in runs[n][name] if r["threads"] is not None})
            ratio = f"{ratios[n]:.2f}x" if name == "multicard run" and n in ratios else ""
            cells = [f"{w[0]:.1f} / {w[1]:.1f} / {w[2]:.1f}" if w else "-", f"{loop[1]:.2f}" if loop else "-",
                     f"{cpu[1]:.1f}" if cpu else "-", ",".join(map(str, threads)), ratio]
            print(f"| {n} | {name} | {' | '.join(cells)} |")
    save(args.out, {"benchmark": "busy_launch", "steps": args.steps, "rounds": args.rounds, "spinners": loads,
                    "same_session": args.same_session, "launchers": launchers, "runs": runs,
                    "multicard_over_fastest_other": ratios, "hardware": hardware}, note="\n")


if __name__ == "__main__":
    main()

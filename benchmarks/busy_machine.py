"""The main job's first epochs on an idle machine and beside busy processes: torch's default threads (how multicard
ran before), one thread, and multicard's choice (PASSIVE waiting where the machine is busy as the command starts).

Each run is a whole `python -m multicard train --epochs E` command in a fresh process, timed from start to exit,
with the training seconds of its epochs read from its metrics.jsonl. "Busy" is N processes this script starts
itself (`python -c "while True: pass"`, N = 2 x the cores by default) and stops after the condition's runs. Runs
are interleaved: each round runs every arm, idle and busy, the arms' order rotating. The load average of the
whole machine is printed with every run (other work counts too). It prints the machine, date, command and, per
condition, the medians and their ratios to one thread; writes the JSON to --out.

    .venv/bin/python benchmarks/busy_machine.py [--epochs 3] [--rounds 3] [--busy N] [--out FILE]

The arms, as environments of the command: "torch default" sets GOMP_SPINCOUNT=300000, libgomp's own spin when
OMP_WAIT_POLICY is unset (a way of waiting given, so multicard leaves it: what every run did before);
"one thread" sets OMP_NUM_THREADS=1; "multicard" sets nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from _common import machine, save, spin, stop

ARMS = {"torch default": {"GOMP_SPINCOUNT": "300000"}, "one thread": {"OMP_NUM_THREADS": "1"}, "multicard": {}}
CLEARED = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # this shell's own choices


def run(arm: str, epochs: int, timeout: float) -> dict:
    """One whole command: wall seconds, training seconds (its epochs), test loss and accuracy, the load average."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED} | ARMS[arm]
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "multicard", "train", "--quiet", "--epochs", str(epochs), "--out", out]
        start = time.perf_counter()
        try:
            subprocess.run(command, env=env, check=True, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"wall_s": None, "train_s": None, "load": os.getloadavg()[0]}
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((Path(out) / "summary.json").read_text())
    return {"wall_s": wall, "train_s": sum(r["seconds"] for r in rows), "load": os.getloadavg()[0],
            "test_loss": summary["test_loss"], "test_accuracy": summary["test_accuracy"]}


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the main job per run (default: 3)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--busy", type=int, default=2 * (os.cpu_count() or 1),
                        help="busy processes beside the job (default: 2 x the cores)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one command may take (default: 600)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/busy_machine.json"))
    args = parser.parse_args()
    conditions = {"idle": 0, f"busy ({args.busy} spinning processes)": args.busy}
    runs: dict = {c: {a: [] for a in ARMS} for c in conditions}
    names = list(ARMS)
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for condition, n in conditions.items():
            spinners = spin(n)
            try:
                for arm in order:
                    r = run(arm, args.epochs, args.timeout)
                    runs[condition][arm].append(r)
                    shown = "timed out" if r["wall_s"] is None else \
                        f"{r['wall_s']:6.1f} s wall, {r['train_s']:6.2f} s training, test loss {r['test_loss']:.6f}"
                    print(f"round {round_ + 1}/{args.rounds}  {condition:30s} {arm:14s} {shown}  load {r['load']:.1f}",
                          flush=True)
            finally:
                stop(spinners)
    hardware = machine()
    command = shlex.join([".venv/bin/python", *sys.argv])
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(f"\n{hardware['cpu']}, {hardware['cores']} cores, torch {hardware['torch']}; {command}; {date}")
    print(f"multicard train --epochs {args.epochs}, {args.rounds} interleaved rounds; medians, and each over one "
          f"thread's\n")
    print("| condition | arm | wall s | training s | wall / one thread | training / one thread |")
    print("|---|---|---:|---:|---:|---:|")
    ratios = {}
    for condition in conditions:
        one = {k: median(runs[condition]["one thread"], k) for k in ("wall_s", "train_s")}
        for arm in names:
            m = {k: median(runs[condition][arm], k) for k in ("wall_s", "train_s")}
            r = {k: m[k] / one[k] if m[k] and one[k] else None for k in m}
            ratios[f"{condition}: {arm}"] = r
            cells = [f"{v:.1f}" if v else "-" for v in m.values()] + [f"{v:.2f}x" if v else "-" for v in r.values()]
            print(f"| {condition} | {arm} | {' | '.join(cells)} |")
    record = {"benchmark": "busy_machine", "epochs": args.epochs, "rounds": args.rounds, "busy": args.busy,
              "arms": ARMS, "runs": runs, "ratios_to_one_thread": ratios, "hardware": hardware,
              "command": command}
    save(args.out, record, note="\n")


if __name__ == "__main__":
    main()

"""The main job as a newcomer runs it: `multicard train` (default recipe) and the same with `--strategy ddp
--devices cpu:2`, for several seeds, each a whole command timed from start to exit (imports and data included).

Records per run the final test accuracy on the 1,000 held-out mnist-5k images and the command's wall time, so
the targets can be read off: >= 97% in <= 60 s for the default, and ddp on cpu:2 within 1 point of single.
Runs are interleaved (single, ddp, single, ...).

    .venv/bin/python benchmarks/main_job.py [--seeds 0,1,2] [--out benchmarks/results/main_job.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from _common import machine, source

RUNS = {"single (default)": [], "ddp cpu:2": ["--strategy", "ddp", "--devices", "cpu:2"]}


def run(extra: list[str], seed: int) -> tuple[float, float]:
    """(test accuracy, wall seconds of the whole command)."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "multicard", "train", "--quiet", "--seed", str(seed), "--out", out, *extra]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        wall = time.perf_counter() - start
        return json.loads((Path(out) / "summary.json").read_text())["test_accuracy"], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/main_job.json"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict = {name: {"accuracy": [], "wall_s": []} for name in RUNS}
    for seed in seeds:
        for name, extra in RUNS.items():
            acc, wall = run(extra, seed)
            results[name]["accuracy"].append(acc)
            results[name]["wall_s"].append(wall)
            print(f"seed {seed}  {name:17s} test accuracy {acc:.2%}  {wall:5.1f} s wall", flush=True)
    print("\n| run | seeds | test accuracy (each) | mean | wall s (each) | max wall s |\n|---|---|---|---:|---|---:|")
    for name, r in results.items():
        print(f"| {name} | {args.seeds} | {', '.join(f'{a:.2%}' for a in r['accuracy'])} | "
              f"{statistics.mean(r['accuracy']):.2%} | {', '.join(f'{w:.1f}' for w in r['wall_s'])} | "
              f"{max(r['wall_s']):.1f} |")
    gap = statistics.mean(results["single (default)"]["accuracy"]) - statistics.mean(results["ddp cpu:2"]["accuracy"])
    print(f"\nmean accuracy, single minus ddp cpu:2: {100 * gap:+.2f} points")
    record = {"benchmark": "main_job", "seeds": seeds, "runs": results, "commands": {
        name: shlex.join(["multicard", "train", *extra]) for name, extra in RUNS.items()},
        "single_minus_ddp_points": 100 * gap, "hardware": machine(), "multicard_source": source(),
        "command": shlex.join([".venv/bin/python", *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

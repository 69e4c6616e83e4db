"""The main job as a newcomer runs it: `multicard train` (default recipe) and the same with `--strategy ddp
--devices cpu:2`, for several seeds, each a whole command timed from start to exit (imports and data included).

Records per run the final test accuracy on the 1,000 held-out mnist-5k images and the command's wall time, and
the floor of any command on this machine (Python + `import torch`, + CUDA's start on a card), so the targets can
be read off: >= 98% mean test accuracy, <= 15 s on 2 CPU cores, <= floor + 2.5 s on a card. Runs are interleaved
(single, ddp, single, ...); `--card` runs `--devices 1` alone instead (the main job on one card).

    .venv/bin/python benchmarks/main_job.py [--seeds 0,1,2] [--card] [--out benchmarks/results/main_job.json]
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
from pathlib import Path

from _common import machine, save

ON_CPU = {"single (default)": [], "ddp cpu:2": ["--strategy", "ddp", "--devices", "cpu:2"]}
ON_CARD = {"one card (default)": ["--devices", "1"]}
FLOOR = {"cpu": "import torch", "card": "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"}


def run(extra: list[str], seed: int) -> tuple[float, float]:
    """(test accuracy, wall seconds of the whole command)."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "multicard", "train", "--quiet", "--seed", str(seed), "--out", out, *extra]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        wall = time.perf_counter() - start
        return json.loads((Path(out) / "summary.json").read_text())["test_accuracy"], wall


def floor(where: str) -> float:
    """Wall seconds of `python -c <import torch (and start CUDA)>`: what any command on this machine pays."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR[where]], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--card", action="store_true", help="the main job on one card (--devices 1)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/main_job.json"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs, where = (ON_CARD, "card") if args.card else (ON_CPU, "cpu")
    results: dict = {name: {"accuracy": [], "wall_s": []} for name in runs}
    floors = []
    for seed in seeds:
        floors.append(floor(where))
        for name, extra in runs.items():
            acc, wall = run(extra, seed)
            results[name]["accuracy"].append(acc)
            results[name]["wall_s"].append(wall)
            print(f"seed {seed}  {name:18s} test accuracy {acc:.2%}  {wall:5.1f} s wall", flush=True)
    print(f"\nfloor ({FLOOR[where]}): {', '.join(f'{f:.2f}' for f in floors)} s, "
          f"median {statistics.median(floors):.2f}")
    print("\n| run | seeds | test accuracy (each) | mean | wall s (each) | max wall s |\n|---|---|---|---:|---|---:|")
    for name, r in results.items():
        print(f"| {name} | {args.seeds} | {', '.join(f'{a:.2%}' for a in r['accuracy'])} | "
              f"{statistics.mean(r['accuracy']):.2%} | {', '.join(f'{w:.1f}' for w in r['wall_s'])} | "
              f"{max(r['wall_s']):.1f} |")
    record = {"benchmark": "main_job", "seeds": seeds, "runs": results, "floor_s": floors,
              "floor_command": FLOOR[where],
              "commands": {name: shlex.join(["multicard", "train", *extra]) for name, extra in runs.items()},
              "hardware": machine()}
    if not args.card:
        single, ddp = (statistics.mean(results[name]["accuracy"]) for name in ON_CPU)
        gap = single - ddp
        print(f"\nmean accuracy, single minus ddp cpu:2: {100 * gap:+.2f} points")
        record["single_minus_ddp_points"] = 100 * gap
    save(args.out, record)


if __name__ == "__main__":
    main()

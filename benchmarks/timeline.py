"""Where the main job's seconds go: `multicard train` (default recipe) as one command, start to exit, with a stamp at
each stage: python up -> imports -> model built -> data -> model on the device -> optimizer -> first step ->
last step -> trained (the last evaluation) -> summary -> curves.png -> files written -> published -> exit.

Each run is a fresh `python benchmarks/timeline.py --child ...` that runs the CLI's own entry point with a wrapper
around each stage (nothing of multicard is changed); the parent times the whole process from spawn to exit, as a
user's shell would. On a card (`--card`: `--devices 1`) each stamp synchronizes the card first, so that a stage's
seconds are its work's, not its launches'. Before each run the floor is timed: `python -c "import torch"` (+ CUDA's
first tensor and a synchronize on a card), what any command on the machine pays. Each run also records its test
accuracy and a hash of its model.pt: give a seed twice (--seeds 0,0) to see whether a run repeats bit for bit.
One process only (the stamps are taken where it trains): the main job on the CPU or on one card.

    .venv/bin/python benchmarks/timeline.py [--card] [--seeds 0,1,2] [--cudnn-benchmark] [--out FILE.json]
                                            [-- more train flags, e.g. --deterministic]
"""

from __future__ import annotations

import json
import os
import sys
import time

CHILD = "--child"


def child(stamps_path: str, autotune: bool, argv: list[str]) -> None:
    """The main job with a stamp at each stage, appended to `stamps_path` as it happens."""
    stamps = open(stamps_path, "a", buffering=1)

    def stamp(name: str, at: float | None = None) -> None:
        torch = sys.modules.get("torch")
        if at is None and torch is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the stage's work done, not only launched
        stamps.write(json.dumps([name, at or time.time()]) + "\n")

    stamp("python up")
    import atexit

    from multicard import cli

    atexit.register(stamp, "exit handlers")  # registered first: runs after multicard's own
    command = cli.cmd_train

    def around(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def stamped(*args, **kwargs):
            out = inner(*args, **kwargs)
            stamp(label)
            return out

        setattr(owner, name, stamped)

    def train_with_stamps(args):
        stamp("command line read")
        # what cmd_train imports, imported here first so that the stamp after them is theirs alone
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from multicard import data, models
        from multicard.trainer import outdir, report, run, start  # noqa: F401

        stamp("imports")
        torch.backends.cudnn.benchmark = autotune  # --cudnn-benchmark: what the trainer did before 2026-11-26
        around(models, "build", "model built")
        around(data, "load", "data")
        around(run.Multicard, "setup", "model on the device")
        around(run, "make_optimizer", "optimizer")
        around(run, "fit", "trained")
        around(run, "summarize", "summary")
        around(report, "curves", "curves.png")
        around(report.Report, "finish", "files written")
        around(outdir.Output, "publish", "published")
        steps: list[float] = []

        def step_end(optimizer, args_, kwargs):
            if not steps:
                stamp("first step")
            steps.append(time.time())

        register_optimizer_step_post_hook(step_end)
        try:
            return command(args)
        finally:
            if steps:
                stamp("last step", steps[-1])  # the host's time: the card's work shows in "trained"

    cli.cmd_train = train_with_stamps
    sys.argv = ["multicard", *argv]
    cli.entry()


def one_run(flags: list[str], seed: int, autotune: bool, scratch: str, i: int) -> dict:
    """One main job: its stages (seconds since the spawn), accuracy, and model.pt's hash."""
    import hashlib
    import subprocess
    from pathlib import Path

    stamps_path, out = os.path.join(scratch, f"stamps-{i}.jsonl"), os.path.join(scratch, f"out-{i}")
    command = [sys.executable, __file__, CHILD, stamps_path, str(int(autotune)), *flags, "--seed", str(seed),
               "--out", out]
    began_at, begin = time.time(), time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - begin
    stages = {name: at - began_at for name, at in map(json.loads, Path(stamps_path).read_text().splitlines())}
    stages["exit"] = wall
    summary = json.loads((Path(out) / "summary.json").read_text())
    return {"seed": seed, "stages": dict(sorted(stages.items(), key=lambda kv: kv[1])),
            "test_accuracy": summary["test_accuracy"], "wall_s": wall,
            "model_sha256": hashlib.sha256((Path(out) / "model.pt").read_bytes()).hexdigest()}


def main() -> None:
    import argparse
    import shlex
    import statistics
    import subprocess
    import tempfile
    from pathlib import Path

    from _common import machine, save

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--card", action="store_true", help="the main job on one card (--devices 1)")
    parser.add_argument("--seeds", default="0,1,2", help="one run per seed; a seed given twice shows whether a run "
                        "repeats (default: 0,1,2)")
    parser.add_argument("--cudnn-benchmark", action="store_true", help="turn cuDNN's autotuning on for the run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/timeline.json"))
    parser.add_argument("flags", nargs="*", help="more `multicard train` flags (after --)")
    args = parser.parse_args()
    floor_code = "import torch" + ("; torch.zeros(1, device='cuda'); torch.cuda.synchronize()" if args.card else "")
    flags = ["train", "--quiet", *(["--devices", "1"] if args.card else []), *args.flags]
    seeds = [int(s) for s in args.seeds.split(",")]
    runs, floors = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for i, seed in enumerate(seeds):
            begin = time.perf_counter()
            subprocess.run([sys.executable, "-c", floor_code], check=True)
            floors.append(time.perf_counter() - begin)
            runs.append(one_run(flags, seed, args.cudnn_benchmark, scratch, i))
            r = runs[-1]
            print(f"seed {seed}: {r['wall_s']:.2f} s start to exit (floor {floors[-1]:.2f} s), test accuracy "
                  f"{r['test_accuracy']:.2%}, model.pt {r['model_sha256'][:12]}", flush=True)
    names = list(runs[0]["stages"])
    median = {name: statistics.median(r["stages"][name] for r in runs if name in r["stages"]) for name in names}
    print(f"\n| stage (median of {len(runs)}) | s since start | s in this stage |\n|---|---:|---:|")
    previous = 0.0
    for name in names:
        print(f"| {name} | {median[name]:.2f} | {median[name] - previous:.2f} |")
        previous = median[name]
    floor = statistics.median(floors)
    print(f"\nfloor ({floor_code}): median {floor:.2f} s; the main job: median {median['exit']:.2f} s, "
          f"floor + {median['exit'] - floor:.2f} s")
    repeats = {}
    for seed in sorted(set(seeds)):
        hashes = [r["model_sha256"] for r in runs if r["seed"] == seed]
        if len(hashes) > 1:
            repeats[seed] = len(set(hashes)) == 1
            print(f"seed {seed}, {len(hashes)} runs: model.pt {'the same bits' if repeats[seed] else 'differs'}")
    record = {"benchmark": "timeline", "where": "card" if args.card else "cpu", "runs": runs, "median_s": median,
              "floor_s": floors, "floor_command": floor_code, "repeats_bit_for_bit": repeats,
              "cudnn_benchmark": args.cudnn_benchmark, "train_command": shlex.join(["multicard", *flags]),
              "load_after": os.getloadavg()[0], "hardware": machine(),
              "command": shlex.join([sys.executable, *sys.argv])}
    save(args.out, record)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == CHILD:
        child(sys.argv[2], sys.argv[3] == "1", sys.argv[4:])
    else:
        main()

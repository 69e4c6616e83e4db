"""What the benchmark scripts share: the flags, the data, the interleaved rounds, the table and the JSON.

The scripts import it as a sibling module (`from _common import ...`): run as `.venv/bin/python
benchmarks/<script>.py`, a script's own folder is first on sys.path, and mp.spawn children inherit that path.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch

from multicard.data import mnist5k
from multicard.jobs.devices import cpu_cores
from multicard.tools.bench_report import cpu_name


def machine(**extra) -> dict:
    """CPU model, cores, GPU and torch version, then the script's own entries (thread counts)."""
    return {"cpu": cpu_name(), "cores": cpu_cores(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__, **extra}


def source() -> str:
    """The multicard commit measured, and whether src/ had uncommitted changes."""
    def git(*args):
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=root).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted src/ changes" if git("status", "-s", "src") else "")


def save(out: Path, record: dict, note: str = "") -> None:
    """Writes a benchmark's `record` as JSON to `out`, stamped with the commit measured, the command (unless the
    record names its own) and the date; prints where (after `note`)."""
    record = {**record, "multicard_source": source(),
              "command": record.get("command", shlex.join([".venv/bin/python", *sys.argv])),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{note}wrote {out}")


def parse_args(doc: str, default_out: str, extra: Callable | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs (after one warm-up epoch)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=Path(default_out))
    if extra is not None:  # a script's own flags
        extra(parser)
    return parser.parse_args()


def load_mnist5k():
    """(train, test, x, y, x_test, y_test): the ImageData sets, and each as one normalized float batch."""
    train, test = mnist5k.load(augment=False)
    x, y = train[:]  # ImageData[:]: the whole set as a normalized float batch, exactly as multicard sees it
    x_test, y_test = test[:]
    return train, test, x, y, x_test, y_test


def timed_rate(out: str | Path) -> float:
    """Samples/s of the epochs after the first (the warm-up) of a multicard run, from its metrics.jsonl."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()][1:]
    return sum(r["samples_per_s"] * r["seconds"] for r in rows) / sum(r["seconds"] for r in rows)


def interleaved(names: Sequence[str], repeats: int, run: Callable[[str], tuple[float, float]]
                ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Calls run(name) -> (samples/s, test accuracy) for every name, `repeats` rounds; the order rotates each
    round (with two names, it alternates), so no one always goes first. Returns (rates, accuracies) per name."""
    rates: dict[str, list[float]] = {n: [] for n in names}
    accs: dict[str, list[float]] = {n: [] for n in names}
    width = max(map(len, names)) + 1
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in [*names[shift:], *names[:shift]]:
            rate, acc = run(name)
            rates[name].append(rate)
            accs[name].append(acc)
            print(f"round {round_ + 1}/{repeats}  {name:{width}s} {rate:8,.0f} samples/s  test acc {acc:.2%}",
                  flush=True)
    return rates, accs


def report(benchmark: str, column: str, heading: str, rates: dict[str, list[float]],
           accs: dict[str, list[float]], summary_rates: list[float], settings: dict, hardware: dict,
           out: Path, per_step: int | None = None) -> None:
    """Prints the markdown table (the first name against each other one, by medians) and writes the JSON."""
    names = list(rates)
    first = names[0]
    medians = {n: statistics.median(v) for n, v in rates.items()}
    best = {n: max(v) for n, v in rates.items()}  # the least disturbed run of each, on a shared machine
    ratios = {f"{first}/{n}": medians[first] / medians[n] for n in names[1:]}
    print(f"\n{heading}\n")
    step = " µs/step (median) |" if per_step else ""  # with a batch size given: the time of one step too
    print(f"| {column} | median samples/s | best | runs | median test acc | multicard / this (medians) |{step}")
    print("|---|---:|---:|---|---:|---:|" + "---:|" * bool(per_step))
    for n in names:
        ratio = f"{ratios[f'{first}/{n}']:.2f}x" if n != first else "-"
        micro = f" {1e6 * per_step / medians[n]:,.0f} |" if per_step else ""
        print(f"| {n} | {medians[n]:,.0f} | {best[n]:,.0f} | {', '.join(f'{r:,.0f}' for r in rates[n])} | "
              f"{statistics.median(accs[n]):.2%} | {ratio} |{micro}")
    save(out, {"benchmark": benchmark, "medians_samples_per_s": medians, "ratios": ratios,
               "best_samples_per_s": best, "runs_samples_per_s": rates, "test_accuracy": accs,
               "multicard_summary_samples_per_s_all_epochs": summary_rates, "settings": settings,
               "hardware": hardware, "torch": torch.__version__}, note="\n")


def spin(n: int, new_session: bool = False) -> list[subprocess.Popen]:
    """n processes spinning on a core each, as other people's work on a shared machine (new_session: each in a
    session of its own, as work started elsewhere is; else in this one, as `cmd &` from the user's shell)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=new_session)
            for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()

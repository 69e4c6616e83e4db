"""The relay of a rank's output to a notebook, on a line without a newline (issue 33: 16 MB took 52 s, 8 s to a file).

Part 1, the relay alone: N MB written into a pipe in one line, read by the relay's pump (jobs/streams.py) into an
in-memory stream; seconds from the first byte written to the last one relayed, for each size.
Part 2, a whole launch (devices="cpu:2"): rank 0 prints 16 MB without a newline, then both ranks meet in an
all_reduce. Relayed: the launcher's sys.stdout is a file object that is not file descriptor 1 (as a notebook's
is), so the output comes back through the pipe; to a file: fd 1 is the file, nothing is relayed. Seconds from the
launch to its return, --repeats rounds in alternating order, medians.

    .venv/bin/python benchmarks/relay.py [--repeats 3] [--sizes 1,4,16,64] [--out benchmarks/results/relay.json]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import machine, save

from multicard.jobs import streams

LAUNCH = """
import sys, time, multicard
def job(mc, size):
    if mc.rank == 0:
        sys.stdout.write("x" * size)
        sys.stdout.flush()
    return mc.all_reduce(1.0).item()
if __name__ == "__main__":
    if sys.argv[1] == "relayed":
        sys.stdout = open(sys.argv[2], "w")  # not fd 1: what a notebook's kernel has
    began = time.monotonic()
    multicard.launch(job, int(sys.argv[3]), devices="cpu:2")
    print(time.monotonic() - began, file=sys.stderr)
"""


def pump_seconds(size: int) -> float:
    relay, out = streams.Relay.__new__(streams.Relay), io.StringIO()
    relay.lock = threading.Lock()
    reader, writer = os.pipe()

    def write() -> None:
        with open(writer, "wb") as f:
            f.write(b"x" * size)

    threading.Thread(target=write, daemon=True).start()
    began = time.monotonic()
    relay._pump(open(reader, "rb", buffering=0), out)
    assert len(out.getvalue()) == size
    return time.monotonic() - began


def launch_seconds(how: str, size: int, folder: Path) -> float:
    script, sink = folder / "launch.py", folder / "out.txt"
    script.write_text(LAUNCH)
    with open(sink, "w") as fd1:
        done = subprocess.run([sys.executable, str(script), how.replace(" ", "-"), str(sink), str(size)], stdout=fd1,
                              stderr=subprocess.PIPE, text=True, timeout=600, check=True)
    assert sink.stat().st_size == size
    return float(done.stderr.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="1,4,16,64", help="part 1: MB of each line (comma list)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/relay.json"))
    args = parser.parse_args()
    pump = {mb: pump_seconds(mb << 20) for mb in map(int, args.sizes.split(","))}
    launches: dict[str, list[float]] = {"relayed": [], "to a file": []}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.repeats):
            for how in (["relayed", "to a file"] if round_ % 2 == 0 else ["to a file", "relayed"]):
                launches[how].append(launch_seconds(how, 16 << 20, Path(folder)))
    print("\n| one line of | relay alone, s |\n|---:|---:|")
    for mb, seconds in pump.items():
        print(f"| {mb} MB | {seconds:.3f} |")
    print("\n| launch, rank 0 prints 16 MB in one line | median s | runs |\n|---|---:|---|")
    for how, runs in launches.items():
        print(f"| {how} | {statistics.median(runs):.1f} | {', '.join(f'{r:.1f}' for r in runs)} |")
    result = {"benchmark": "relay", "relay_alone_s": pump, "launch_s": launches, "hardware": machine()}
    save(args.out, result, note='\n')


if __name__ == "__main__":
    main()

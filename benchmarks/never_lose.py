"""Never lose a run: SIGKILLs at random instants against --max-restarts and --resume, on this machine's CPU.

Part 1, restarts: a 2-process ddp job (LeNet5, synthetic data, augmentation on, a checkpoint every 5 steps,
--max-restarts 1). One unkilled reference run; then --runs runs, each with one worker (one of the launcher's two
spawned children, picked at random: which pid is which rank is not known from outside) SIGKILLed at a point
drawn uniformly over the run's progress, from its first checkpoint to one checkpoint interval past its last
(the start of the final evaluation; the rest of the run's ~2.5 s tail, model.pt and the exit, is not sampled),
found by watching its checkpoints appear (see killed_run). Target:
every run finishes, and its model.pt equals the reference's bit for bit. A kill that lands after the job has
already ended (no restart happened) is counted apart from those that caused a restart.

Part 2, kills during checkpoint writes: a 1-process job (the launcher is the training process) writing a
checkpoint every optimizer step, SIGKILLed --kills times. The kills are chained to save start-ups: the run is
killed, then started again with --resume auto into the same --out and killed again, and so on; each kill comes
at a random instant after that attempt's first new checkpoint appears. After every kill, before the next start
(which would clean up), the newest whole checkpoint must be what --resume auto accepts: resolve("auto") finds
it, describe() passes it, torch.load(weights_only=True) reads it and its "model" loads into a fresh LeNet5; every
10th kill, and every kill whose newest checkpoint was taken after an epoch's last step, a copy of --out is
actually resumed by `multicard train --resume auto` to the end of its epoch. How many kills found a step-*.part
folder (the kill landed during a write) is counted: that share is the point. Besides what --resume checks, each
newest checkpoint is checked for being sound (finite weights and optimizer state, a place within the epoch). An
attempt that fails by itself (its error printed before the kill) ends the chain: the next kill starts a fresh
--out. Part 2's processes run on one thread (OMP_NUM_THREADS=1) with augmentation off, so that steps are short
and writes a large share of the time.

Part 3, an earlier run's checkpoints in --out: a one-process run (--lr 0.008, 3 epochs, a checkpoint every 4
steps) is left in --out; then --earlier times a fresh run at another rate (--lr 0.001, 2 epochs) into that --out
is SIGKILLed at a random instant after its own first checkpoint, and `--resume auto` finishes it. Target: every
resume goes on from the fresh run's own checkpoint (never the earlier run's higher step numbers), its model.pt is
bit-identical to an unkilled run at 0.001 in an empty --out, and the earlier run's checkpoints are all still
there (in checkpoints/run-<its id>/).

Part 4, kills during publish: a child process publishes a finished run folder into an --out (empty: a first run;
or showing an earlier run) and SIGKILLs itself at the k-th call that changes the disk (symlink, rename, unlink,
rmtree), for every k until one publish ends without a kill. Target: after each kill --out shows the run before
(nothing, for a first run) or the new one whole, never a mix; and the next run's publish leaves it clean.

Run with the multicard under test on PYTHONPATH (the spawned processes inherit it):

    PYTHONPATH=src .venv/bin/python benchmarks/never_lose.py [--runs 20] [--kills 50] [--earlier 3]
        [--out benchmarks/results/...]       (--runs 0 --kills 0: parts 3 and 4 alone, ~2 min)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from _common import machine

import multicard
from multicard.checkpoints import resume
from multicard.models import LeNet5
from multicard.tools.bench_report import commit
from multicard.trainer.recipe import describe

SEED = 20240611  # the random instants (and which worker) are reproducible from it
MC = [sys.executable, "-m", "multicard", "train"]

# part 1: 1920 / 48 = 40 steps an epoch, 160 in all, so that the training is a few seconds against a start-up of
# ~4-6 s (three Pythons importing torch on 2 cores)
SAVE_EVERY = 5
DDP_ARGS = ["--devices", "cpu:2", "--data", "synthetic", "--synthetic-samples", "1920", "--batch-size", "48",
            "--epochs", "4", "--save-every-steps", str(SAVE_EVERY), "--max-restarts", "1", "--quiet"]
DDP_STEPS_PER_EPOCH = 1920 // 48
DDP_STEPS = DDP_STEPS_PER_EPOCH * 4
# part 2: writes must fill a large share of the time. LeNet's checkpoint (model + Adam, ~0.75 MB) takes ~15 ms to
# write; its step at batch 16, augmentation off, on one thread, about as long. (resnet8's steps are many times
# slower for a checkpoint of the same size; at batch 64, or on 2 threads that spin against the machine's other
# load, a LeNet step takes 5-10x longer: writes were ~5% of the time, against ~35% here.) 50 epochs of 256 steps
# are far more than the chained attempts get through, so no attempt ends on its own.
WRITE_BATCH = 16
WRITE_SAMPLES = 4096
WRITE_ARGS = ["--devices", "cpu", "--model", "lenet5", "--data", "synthetic", "--synthetic-samples", str(WRITE_SAMPLES),
              "--no-augment", "--batch-size", str(WRITE_BATCH), "--save-every-steps", "1", "--keep-checkpoints",
              "2", "--quiet"]
WRITE_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
WRITE_EPOCHS, WRITE_STEPS_PER_EPOCH = 50, WRITE_SAMPLES // WRITE_BATCH
KILL_WINDOW_S = 1.0  # part 2: a kill comes 0..this long after the attempt's first new checkpoint (~10 steps)
POLL_S = 0.01


def workers(launcher: int) -> list[int]:
    """The launcher's spawned children (torch.multiprocessing's spawn_main), not its resource tracker."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)": state, then ppid
        if ppid == launcher and b"spawn_main" in cmdline:
            found.append(int(entry))
    return sorted(found)


def wait_for_workers(proc: subprocess.Popen, n: int = 2, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if len(pids := workers(proc.pid)) >= n:
            return pids
        time.sleep(POLL_S)
    raise RuntimeError(f"the launcher (pid {proc.pid}) never had {n} workers (exit code {proc.poll()})")


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def bit_identical(a: Path, b: Path) -> tuple[bool, str]:
    """Every tensor of two model.pt files equal bit for bit (same names, dtypes, shapes, values)."""
    x, y = (torch.load(p, map_location="cpu", weights_only=True) for p in (a, b))
    if x.keys() != y.keys():
        return False, f"different names: {sorted(x.keys() ^ y.keys())}"
    differ = [k for k in x if x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k])]
    return not differ, f"{len(differ)} of {len(x)} tensors differ (first {differ[0]})" if differ else ""


def steps_of(folder: Path) -> list[tuple[int, str]]:
    """(step, name) of every step-* entry in a checkpoints folder, whole or .part."""
    out = []
    for p in folder.glob("step-*") if folder.is_dir() else []:
        if m := re.fullmatch(r"step-(\d+)(\.part)?", p.name):
            out.append((int(m.group(1)), p.name))
    return sorted(out)


# -- part 1 ----------------------------------------------------------------------------------------------------

def appearances(proc: subprocess.Popen, folder: Path, seen: dict[int, float], t0: float,
                until: int | None = None) -> None:
    """Note in `seen` when each checkpoint step-N (whole or .part) first appears, in seconds after t0, until step
    `until` has appeared or the process ends. Polled every 10 ms: checkpoints come every ~100+ ms, and with
    --keep-checkpoints 2 none is deleted before it is seen."""
    while proc.poll() is None and (until is None or until not in seen):
        now = time.monotonic() - t0
        for step, _ in steps_of(folder):
            seen.setdefault(step, now)
        time.sleep(POLL_S)


def reference(work: Path) -> dict:
    """The unkilled run, watched: when both workers exist, when each checkpoint appears, when it ends."""
    out, log = work / "ref", work / "ref.log"
    seen: dict[int, float] = {}
    with open(log, "w") as f:
        start = time.monotonic()
        proc = subprocess.Popen([*MC, *DDP_ARGS, "--out", str(out)], stdout=f, stderr=subprocess.STDOUT)
        wait_for_workers(proc)
        t0 = time.monotonic()
        appearances(proc, out / "checkpoints", seen, t0)
        code = proc.wait()
        end = time.monotonic() - t0
    if code != 0 or DDP_STEPS not in seen:
        raise RuntimeError(f"the reference run failed (exit {code}):\n{tail(log)}")
    summary = json.loads((out / "summary.json").read_text())
    return {"exit_code": code, "wall_s": end + t0 - start, "workers_at_s": t0 - start,
            "checkpoint_appeared_s": {step: round(t, 3) for step, t in sorted(seen.items())},
            "ended_s": round(end, 3), "restarts": summary["restarts"],
            "optimizer_steps": summary["optimizer_steps"], "out": str(out)}


def killed_run(work: Path, i: int, rng: random.Random, ref_model: Path, ref_interval: float) -> dict:
    """One run, one worker SIGKILLed at a point drawn uniformly over its progress, in optimizer steps, from its
    first checkpoint (step 5) to one checkpoint interval past its last (step 160 + 5: the final evaluation,
    model.pt, the exit). The point is reached by the clock, not by a fixed delay: the machine is shared, and its
    load changes how long start-up and steps take from run to run (a fixed delay measured on a quiet reference
    landed before the first checkpoint in 6 of 14 runs once the load rose). For a point p between checkpoints
    c = 5*floor(p/5) and c+5: wait until step-c appears, then sleep (p-c)/5 of the time this run took from
    step-(c-5) to step-c (for c = 5: the reference run's median interval between checkpoints)."""
    out, log = work / f"run-{i:02d}", work / f"run-{i:02d}.log"
    every = SAVE_EVERY
    point = rng.uniform(every, DDP_STEPS + every)
    pick = rng.randrange(2)
    anchor = int(point // every * every)
    seen: dict[int, float] = {}
    with open(log, "w") as f:
        start = time.monotonic()
        proc = subprocess.Popen([*MC, *DDP_ARGS, "--out", str(out)], stdout=f, stderr=subprocess.STDOUT)
        try:
            pids = wait_for_workers(proc)
            t0 = time.monotonic()
            appearances(proc, out / "checkpoints", seen, t0, until=anchor)
            interval = seen[anchor] - seen[anchor - every] if anchor in seen and anchor - every in seen \
                else ref_interval
            delay = (point - anchor) / every * interval
            time.sleep(delay)
            victim = pids[pick]
            killed_at = time.monotonic() - t0
            try:
                os.kill(victim, signal.SIGKILL)
                delivered = True
            except ProcessLookupError:  # that worker had already ended: the job was over
                delivered = False
            newest = steps_of(out / "checkpoints")
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        wall = time.monotonic() - start
    text = log.read_text(errors="replace")
    failed = re.search(r"rank (\d+) failed; restart", text)
    resumed = re.search(r"resuming from \S*step-(\d+)/state.pt", text)
    row = {"run": i, "kill_at_step": round(point, 2), "anchor_checkpoint": anchor,
           "anchor_seen": anchor in seen, "delay_after_anchor_s": round(delay, 3),
           "killed_at_s_after_workers": round(killed_at, 3), "killed_pid": victim,
           "pid_order": "lower" if pick == 0 else "higher",
           "kill_delivered": delivered, "checkpoints_at_kill": [n for _, n in newest], "exit_code": code,
           "failed_rank_reported": int(failed.group(1)) if failed else None,
           "restart_resumed_from_step": int(resumed.group(1)) if resumed else None,
           # a step checkpoint taken after an epoch's last step (its place: all of the epoch's samples served)
           "resumed_from_an_epoch_end": bool(resumed) and int(resumed.group(1)) % DDP_STEPS_PER_EPOCH == 0,
           "wall_s": round(wall, 2)}
    if code == 0 and (out / "summary.json").exists():
        summary = json.loads((out / "summary.json").read_text())
        same, why = bit_identical(out / "model.pt", ref_model)
        row.update(restarts=summary["restarts"], resumed_from=summary["resumed_from"],
                   optimizer_steps=summary["optimizer_steps"], bit_identical=same)
        if why:
            row["difference"] = why
    else:
        row.update(restarts=None, bit_identical=False, output_tail=tail(log))
    return row


# -- part 2 ----------------------------------------------------------------------------------------------------

def accepts(out: Path) -> dict:
    """What --resume auto would do with --out now: the newest whole checkpoint, described, read, and loaded."""
    try:
        path = resume.resolve("auto", out)
        if path is None:
            return {"accepted": False, "why": "no whole checkpoint"}
        where = describe(path, WRITE_BATCH)
        raw = torch.load(path, map_location="cpu", weights_only=True)
        LeNet5().load_state_dict(raw["model"])  # strict: every name and shape
        missing = [k for k in ("optimizer", "scheduler", "loader", "history", "steps") if k not in raw]
        if missing:
            return {"accepted": False, "why": f"{path} lacks {missing}"}
        # accepted is what --resume checks; sound is what it does not: every weight and optimizer moment a
        # number, and a place in the data within the epoch (an attempt resumed from an epoch's end writes one
        # step past it, 4112 samples into an epoch of 4096, and then fails)
        tensors = [*raw["model"].values(), *(v for state in raw["optimizer"]["state"].values()
                                             for v in state.values() if isinstance(v, torch.Tensor))]
        finite = all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
        samples = raw["loader"]["samples"]
        return {"accepted": True, "checkpoint": path.parent.name, "steps": raw["steps"],
                "epoch": raw["loader"]["epoch"], "samples": samples, "describe": where, "finite": finite,
                "sound": finite and 0 <= samples <= WRITE_SAMPLES,
                # the place after an epoch's last step: all of its samples served
                "epoch_end": samples == WRITE_SAMPLES}
    except Exception as e:  # UsageError from describe, anything from torch.load / load_state_dict
        return {"accepted": False, "why": f"{type(e).__name__}: {e}"}


def resume_to_end(work: Path, out: Path, k: int, check: dict) -> dict:
    """A copy of --out as the kill left it, resumed by `multicard train --resume auto` to its epoch's end."""
    copy = work / f"resume-{k:02d}"
    shutil.copytree(out, copy, symlinks=True)
    epochs = check["epoch"] + 1
    cmd = [*MC, *WRITE_ARGS, "--epochs", str(epochs), "--resume", "auto", "--out", str(copy)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=WRITE_ENV)
    row = {"command": shlex.join(["python", "-m", "multicard", *cmd[3:]]), "exit_code": done.returncode}
    if done.returncode == 0:
        summary = json.loads((copy / "summary.json").read_text())
        row.update(resumed_from=summary["resumed_from"], optimizer_steps=summary["optimizer_steps"],
                   ok=summary["resumed_from"] is not None
                   and Path(summary["resumed_from"]).parent.name == check["checkpoint"]
                   and summary["optimizer_steps"] == epochs * WRITE_STEPS_PER_EPOCH)
    else:
        row.update(ok=False, output_tail=(done.stdout + done.stderr)[-3000:])
    shutil.rmtree(copy, ignore_errors=True)
    return row


def write_kills(work: Path, kills: int, rng: random.Random) -> list[dict]:
    out, rows, chain = work / "writes", [], 0
    for k in range(kills):
        before = steps_of(out / "checkpoints")
        newest_before = max((s for s, n in before if not n.endswith(".part")), default=-1)
        delay = rng.uniform(0, KILL_WINDOW_S)
        log = work / f"write-{k:02d}.log"
        cmd = [*MC, *WRITE_ARGS, "--epochs", str(WRITE_EPOCHS), "--resume", "auto", "--out", str(out)]
        with open(log, "w") as f:
            start = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=WRITE_ENV)
            try:
                while proc.poll() is None:  # this attempt's first new whole checkpoint
                    if any(s > newest_before and not n.endswith(".part") for s, n in steps_of(out / "checkpoints")):
                        break
                    time.sleep(POLL_S)
                first = time.monotonic() - start
                time.sleep(delay)
                ended_first = proc.poll()
                proc.send_signal(signal.SIGKILL)
                code = proc.wait(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        after = steps_of(out / "checkpoints")
        parts = [n for _, n in after if n.endswith(".part")]
        row = {"kill": k, "chain": chain, "delay_s": round(delay, 3), "first_new_checkpoint_s": round(first, 2),
               "exit_code": code, "ended_before_kill": ended_first is not None, "resumed_from_step": newest_before,
               "checkpoints_after": [n for _, n in after], "part_folders": parts,
               "part_contents": {n: sorted(p.name for p in (out / "checkpoints" / n).iterdir()) for n in parts},
               "mid_write": bool(parts), **accepts(out)}
        # an attempt that failed by itself (its error printed, maybe still exiting when the kill came)
        row["attempt_failed"] = ended_first is not None or "multicard: error" in log.read_text(errors="replace")
        if row["attempt_failed"]:
            row["output_tail"] = tail(log)
        if row["accepted"] and ((k + 1) % 10 == 0 or row["epoch_end"] or not row["sound"]):
            row["resume_run"] = resume_to_end(work, out, k, row)
        rows.append(row)
        print(f"  kill {k + 1:2d}/{kills}: {delay:.2f} s after step-{newest_before + 1}  "
              f"{'mid-write ' + ','.join(parts) if parts else 'between writes':36s} "
              f"{'accepted ' + row['checkpoint'] if row['accepted'] else 'REFUSED: ' + row['why']}"
              + ("" if not row["accepted"] or row["sound"] else " (UNSOUND: " + ", ".join(
                  w for w, bad in (("non-finite weights", not row["finite"]),
                                   (f"{row['samples']} samples in", row["samples"] > WRITE_SAMPLES)) if bad) + ")")
              + ("  (an epoch's end)" if row.get("epoch_end") else "")
              + ("  attempt failed by itself: " + row["output_tail"].splitlines()[-1] if row["attempt_failed"]
                 else "")
              + (f"  resume run {'ok' if row['resume_run']['ok'] else 'FAILED'}" if "resume_run" in row else ""),
              flush=True)
        if row["attempt_failed"]:  # what it left is no run to go on with (shown once): start a fresh one
            shutil.rmtree(out, ignore_errors=True)
            chain += 1
    return rows


# -- part 3 ----------------------------------------------------------------------------------------------------

EARLIER_ARGS = ["--devices", "cpu", "--model", "lenet5", "--data", "synthetic", "--synthetic-samples", "384",
                "--no-augment", "--batch-size", "32", "--save-every-steps", "4", "--keep-checkpoints", "2", "--quiet"]
EARLIER_STEPS = 384 // 32  # an epoch


def train_into(out: Path, log: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MC, *EARLIER_ARGS, *extra, "--out", str(out)], stdout=log.open("w"),
                          stderr=subprocess.STDOUT, env=WRITE_ENV, timeout=600)


def earlier_runs(work: Path, cases: int, rng: random.Random) -> dict:
    base, fresh = work / "earlier", ["--lr", "0.001", "--epochs", "2"]
    if train_into(base, work / "earlier.log", "--lr", "0.008", "--epochs", "3").returncode:
        raise RuntimeError(f"part 3's earlier run failed:\n{tail(work / 'earlier.log')}")
    earlier_steps = [p.name for p in resume.whole(base)]
    unkilled = work / "unkilled"
    train_into(unkilled, work / "unkilled.log", *fresh)
    rows = []
    for i in range(cases):
        out, log = work / f"earlier-{i}", work / f"earlier-{i}.log"
        shutil.copytree(base, out, symlinks=True)
        delay = rng.uniform(0, 0.5)
        with open(log, "w") as f:
            proc = subprocess.Popen([*MC, *EARLIER_ARGS, *fresh, "--out", str(out)], stdout=f,
                                    stderr=subprocess.STDOUT, env=WRITE_ENV)
            while proc.poll() is None and not (out / "checkpoints" / "step-00000004" / "state.pt").is_file():
                time.sleep(POLL_S)
            time.sleep(delay)
            proc.kill()
            proc.wait()
        owner = (resume.owner(out) or {}).get("run")
        kept = sorted(p.name for p in (out / "checkpoints").glob("run-*/step-*"))
        done = train_into(out, work / f"earlier-{i}-resume.log", *fresh, "--resume", "auto")
        summary = json.loads((out / "summary.json").read_text()) if done.returncode == 0 else {}
        from_path = Path(summary.get("resumed_from") or "")
        same, why = bit_identical(out / "model.pt", unkilled / "model.pt") if summary else (False, "no model")
        rows.append({"case": i, "delay_s": round(delay, 3), "resume_exit": done.returncode,
                     "resumed_from": summary.get("resumed_from"),
                     "resumed_own_run": from_path.is_file() and resume.run_of(from_path.parent) == owner,
                     "lr": summary.get("config", {}).get("lr"), "bit_identical": same, "difference": why,
                     "earlier_kept": kept == earlier_steps,
                     "ok": same and kept == earlier_steps and from_path.parent.parent.name == "checkpoints"})
        print(f"  case {i + 1}: killed {delay:.2f} s after its step 4; resumed from "
              f"{summary.get('resumed_from')}; bit-identical {same}; earlier run's {earlier_steps} kept "
              f"{kept == earlier_steps}", flush=True)
    return {"earlier_checkpoints": earlier_steps, "cases": rows, "ok": sum(r["ok"] for r in rows)}


# -- part 4 ----------------------------------------------------------------------------------------------------

PUBLISHER = """
import os, shutil, signal, sys
from pathlib import Path
from multicard.trainer.outdir import FILES, Output
out, point, first = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "first"

def finished(output, tag, events):
    folder = output.new_run()
    for name in FILES:
        (folder / name).write_text(tag + " " + name)
    if events:
        (folder / "tensorboard").mkdir()
    return folder

with Output(str(out)) as output:
    if not first:
        output.publish(finished(output, "old", True))
    new = finished(output, "new", False)
    left = [point]
    def dies(real):
        def call(*args, **kwargs):
            left[0] -= 1
            if left[0] < 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return call
    os.symlink, os.replace, shutil.rmtree, Path.unlink = (dies(f) for f in (os.symlink, os.replace, shutil.rmtree,
                                                                            Path.unlink))
    output.publish(new)
"""


def shown_files(out: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(out.iterdir()) if not p.name.startswith(".") and p.is_file()}


def publish_kills(work: Path) -> list[dict]:
    from multicard.trainer.outdir import FILES, Output

    script = work / "publisher.py"
    script.write_text(PUBLISHER)
    rows = []
    for first in (True, False):
        point = 0
        while True:
            out = work / f"publish-{'first' if first else 'later'}-{point}"
            code = subprocess.run([sys.executable, str(script), str(out), str(point),
                                   "first" if first else "later"]).returncode
            now = shown_files(out)
            old = {} if first else {name: f"old {name}" for name in FILES}
            new = {name: f"new {name}" for name in FILES}
            whole = now in (old, new) and not ((out / "tensorboard").exists() and now == new)
            with Output(str(out)) as output:  # the next run
                folder = output.new_run()
                for name in FILES:
                    (folder / name).write_text(f"next {name}")
                output.publish(folder)
            clean = shown_files(out) == {name: f"next {name}" for name in FILES} and \
                len(list(out.glob(".run-*"))) == 1 and not list(out.glob("*.part"))
            rows.append({"first_run": first, "killed_at_call": point, "killed": code == -signal.SIGKILL,
                         "exit_code": code, "showed": "before" if now == old else "new" if now == new else "MIX",
                         "whole": whole, "next_run_clean": clean})
            print(f"  {'first' if first else 'later'} run, kill at call {point}: "
                  f"{'killed' if code == -signal.SIGKILL else f'exit {code}'}, showed {rows[-1]['showed']}, "
                  f"next run clean {clean}", flush=True)
            if code != -signal.SIGKILL or point > 40:
                break
            point += 1
    return rows


# -- main ------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="part 1: killed ddp runs")
    parser.add_argument("--kills", type=int, default=50, help="part 2: kills of the checkpoint-writing run")
    parser.add_argument("--earlier", type=int, default=3, help="part 3: killed fresh runs into an --out holding "
                        "an earlier run's checkpoints")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "never_lose.json")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders and logs")
    args = parser.parse_args()
    rng = random.Random(SEED)
    work = Path(tempfile.mkdtemp(prefix="never-lose-"))
    began = time.monotonic()

    runs, ref, ref_interval = [], {}, None
    if args.runs:
        print(f"part 1: reference run ({shlex.join(DDP_ARGS)})", flush=True)
        ref = reference(work)
        times = ref["checkpoint_appeared_s"]
        at = list(times.values())
        ref_interval = statistics.median(b - a for a, b in zip(at, at[1:], strict=False))
        print(f"  {ref['wall_s']:.1f} s; workers at {ref['workers_at_s']:.1f} s; checkpoints from "
              f"{times[SAVE_EVERY]:.2f} s to {times[DDP_STEPS]:.2f} s after both workers exist, every "
              f"{ref_interval:.3f} s (median); ended at {ref['ended_s']:.2f} s", flush=True)
        for i in range(args.runs):
            row = killed_run(work, i, rng, Path(ref["out"]) / "model.pt", ref_interval)
            runs.append(row)
            print(f"  run {i + 1:2d}/{args.runs}: kill at step {row['kill_at_step']:6.2f} ({row['pid_order']} pid)  "
                  f"exit {row['exit_code']}  restarts {row['restarts']}  resumed from step "
                  f"{row['restart_resumed_from_step']}{' (an epoch end)' if row['resumed_from_an_epoch_end'] else ''}"
                  f"  bit-identical {row['bit_identical']}"
                  + (f"  {row['difference']}" if "difference" in row else ""), flush=True)
            if "output_tail" in row:
                print("    " + row["output_tail"].replace("\n", "\n    "), flush=True)
    part1_s = time.monotonic() - began

    print(f"part 2: {args.kills} kills of a run writing a checkpoint every step ({shlex.join(WRITE_ARGS)})",
          flush=True)
    kills = write_kills(work, args.kills, rng) if args.kills else []
    part2_s = time.monotonic() - began - part1_s
    print(f"part 3: {args.earlier} fresh runs killed in an --out holding an earlier run's checkpoints", flush=True)
    earlier = earlier_runs(work, args.earlier, rng) if args.earlier else {"cases": [], "ok": 0}
    print("part 4: a kill at each point of publish", flush=True)
    published = publish_kills(work)
    total = time.monotonic() - began

    finished = sum(r["exit_code"] == 0 for r in runs)
    identical = sum(r["bit_identical"] for r in runs)
    restarted = sum(r["failed_rank_reported"] is not None for r in runs)  # the launcher said it restarted
    after_end = sum(r["exit_code"] == 0 and r["restarts"] == 0 for r in runs)
    accepted = sum(r["accepted"] for r in kills)
    mid = sum(r["mid_write"] for r in kills)
    mid_ok = sum(r["accepted"] and r["mid_write"] for r in kills)
    resumed = [r["resume_run"] for r in kills if "resume_run" in r]
    counts = {"runs": len(runs), "finished": finished, "bit_identical": identical, "kills_that_caused_a_restart":
              restarted, "kills_after_the_job_had_ended": after_end,
              "bit_identical_of_restarted": sum(r["bit_identical"] and r["restarts"] == 1 for r in runs),
              "kills": len(kills), "accepted": accepted, "kills_mid_write": mid, "accepted_of_mid_write": mid_ok,
              "mid_write_share": mid / max(len(kills), 1), "resume_runs": len(resumed),
              "resume_runs_ok": sum(r["ok"] for r in resumed),
              "restarts_from_an_epoch_end": sum(r["resumed_from_an_epoch_end"] for r in runs),
              "restarts_from_an_epoch_end_finished": sum(r["resumed_from_an_epoch_end"] and r["exit_code"] == 0
                                                         for r in runs),
              "restarts_from_elsewhere_finished": sum(r["restarts"] == 1 and not r["resumed_from_an_epoch_end"]
                                                      for r in runs),
              "kills_leaving_an_epoch_end_checkpoint": sum(r.get("epoch_end", False) for r in kills),
              "accepted_and_sound": sum(r["accepted"] and r["sound"] for r in kills),
              "accepted_and_sound_not_epoch_end": sum(r["accepted"] and r["sound"] and not r["epoch_end"]
                                                      for r in kills),
              "attempts_that_failed_by_themselves": sum(r["attempt_failed"] for r in kills),
              "epoch_end_resume_runs_ok": sum(r["resume_run"]["ok"] for r in kills
                                              if r.get("epoch_end") and "resume_run" in r),
              "earlier_cases": len(earlier["cases"]), "earlier_cases_ok": earlier["ok"],
              "publish_kills": sum(r["killed"] for r in published),
              "publish_kills_whole": sum(r["killed"] and r["whole"] for r in published),
              "publish_next_run_clean": sum(r["next_run_clean"] for r in published)}

    print("\n| target | result |\n|---|---:|")
    print(f"| killed ddp runs that finish (--max-restarts 1) | {finished}/{len(runs)} |")
    print(f"| their model.pt bit-identical to the unkilled run's | {identical}/{len(runs)} |")
    print(f"| kills that caused a restart (the others landed after the job ended) | {restarted}/{len(runs)} |")
    print(f"| kills during checkpointing whose newest whole checkpoint --resume auto accepts | "
          f"{accepted}/{len(kills)} |")
    print(f"| of those kills, landed mid-write (a step-*.part was there) | {mid}/{len(kills)} "
          f"({mid / max(len(kills), 1):.0%}); accepted {mid_ok}/{mid} |")
    print(f"| kills whose accepted checkpoint is also sound (finite weights and Adam state, place in the epoch) | "
          f"{counts['accepted_and_sound']}/{len(kills)} |")
    print(f"| attempts that failed by themselves before their kill (fresh chain after each) | "
          f"{counts['attempts_that_failed_by_themselves']} |")
    print(f"| copies actually resumed by multicard train --resume auto to their epoch's end | "
          f"{counts['resume_runs_ok']}/{len(resumed)} |")
    print(f"| restarts from a checkpoint taken after an epoch's last step that finished | "
          f"{counts['restarts_from_an_epoch_end_finished']}/{counts['restarts_from_an_epoch_end']} |")
    print(f"| part 2 kills whose newest checkpoint is at an epoch's end; their resume runs ok | "
          f"{counts['kills_leaving_an_epoch_end_checkpoint']}; {counts['epoch_end_resume_runs_ok']} |")
    print(f"| fresh runs killed beside an earlier run's checkpoints, resumed from their own, bit-identical, the "
          f"earlier kept | {earlier['ok']}/{len(earlier['cases'])} |")
    print(f"| kills at each point of publish leaving --out showing one whole run; next run clean | "
          f"{counts['publish_kills_whole']}/{counts['publish_kills']}; {counts['publish_next_run_clean']}/"
          f"{len(published)} |")
    print(f"\ntotal wall time {total / 60:.1f} min (part 1 {part1_s / 60:.1f} min)")

    result = {
        "benchmark": "never_lose", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": machine(), "torch": torch.__version__,
        "multicard_source": {"commit": commit(), "path": str(Path(multicard.__file__).parent)},
        "command": (f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else "")
        + shlex.join([Path(sys.executable).name, *sys.argv]),
        "commands": {"part1": shlex.join(["python", "-m", "multicard", "train", *DDP_ARGS, "--out", "DIR"]),
                     "part2": "OMP_NUM_THREADS=1 " + shlex.join(["python", "-m", "multicard", "train", *WRITE_ARGS,
                                                                 "--epochs", str(WRITE_EPOCHS), "--resume", "auto",
                                                                 "--out", "DIR"]),
                     "part2_resume_check": "part2 with --epochs <the checkpoint's epoch + 1>, on a copy of DIR"},
        "settings": {"seed": SEED, "part1_kill": "SIGKILL of one of the launcher's 2 spawned workers (picked at "
                     f"random), at a point drawn uniformly over steps {SAVE_EVERY}..{DDP_STEPS + SAVE_EVERY}: after "
                     "checkpoint c = 5*floor(p/5) appears, (p-c)/5 of this run's last checkpoint interval",
                     "part1_reference_checkpoint_interval_s": ref_interval,
                     "part2_kill": f"SIGKILL of the (single) training process, 0-{KILL_WINDOW_S} s (uniform) after "
                     "that attempt's first new whole checkpoint; chained: each next attempt is --resume auto into "
                     "the same --out", "part2_accept": "resolve('auto') + describe() + torch.load(weights_only=True)"
                     " + LeNet5().load_state_dict(strict); every 10th: a copy resumed by multicard train to its "
                     "epoch's end (exit 0, resumed from that checkpoint, all steps of the epochs counted)"},
        "counts": counts, "reference": ref, "runs": runs, "kills": kills, "earlier": earlier,
        "publish": published,
        "wall_s": {"total": total, "part1": part1_s, "part2": part2_s,
                                                              "parts3_4": total - part1_s - part2_s},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    failed = finished < len(runs) or identical < len(runs) or accepted < len(kills) or \
        counts["resume_runs_ok"] < len(resumed) or earlier["ok"] < len(earlier["cases"]) or \
        counts["publish_kills_whole"] < counts["publish_kills"]
    if args.keep or failed:
        print(f"runs and logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

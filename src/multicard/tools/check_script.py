"""`multicard check script.py [its arguments]`: the user's own script (one written for `multicard run`) run twice
under our launcher, on one process and on N, each rank recorded (recorder.py); then what the two runs trained is
compared step by step: every weight of the set-up models after each optimizer step, to a tolerance, and the
losses passed to mc.backward beside them. The verdict names the first step and weight where the runs part, and
the causes the recorder saw (dropout, BatchNorm per process, draws per process, seeds per rank, bf16/fp16).
Weights are compared whole: ddp, dp and dp-balanced (fsdp's shards are not gathered)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UsageError, note
from ..jobs import protocol

WHOLE = ("ddp", "dp", "dp-balanced")  # strategies whose ranks hold whole weights


@dataclass
class Verdict:
    script: str
    one: str  # where each run ran, in words
    many: str
    tolerance: float
    steps: int  # steps compared
    worst: float = 0.0  # the largest weight difference over every step compared
    worst_at: tuple[int, str] = (0, "")
    parted: tuple[int, str, float] | None = None  # the first step, weight and difference beyond the tolerance
    short: str = ""  # where one run took fewer steps than the other
    losses: list[tuple[float, float]] = field(default_factory=list)  # each step's loss, on one and on N
    causes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.parted is None and not self.short

    def lines(self) -> list[str]:
        head = (f"check {self.script}: {self.steps} optimizer step{'s' * (self.steps != 1)} on {self.one} and on "
                f"{self.many}, every weight of the set-up models compared after each")
        if self.parted:
            step, name, diff = self.parted
            out = [f"{head}: the runs part at step {step}: {name} differs by {diff:.2e} (tolerance "
                   f"{self.tolerance:.0e}): FAIL"]
        else:
            step, name = self.worst_at
            out = [f"{head}: the largest difference {self.worst:.2e}" + (f" (step {step}, {name})" * bool(name))
                   + f"; tolerance {self.tolerance:.0e}: {'PASS' if self.ok else 'FAIL'}"]
        if self.short:
            out.append(self.short)
        if self.losses:
            at = (self.parted[0] if self.parted else 1) - 1
            if at < len(self.losses):
                one, many = self.losses[at]
                worst = max(abs(a - b) for a, b in self.losses)
                out.append(f"loss passed to mc.backward at step {at + 1}: {one:.6f} on one process, {many:.6f} on "
                           f"{self.many.split(' (')[0]} (mean over ranks); the largest difference over "
                           f"{len(self.losses)} steps: {worst:.2e}")
        if not self.ok:
            out += ["possible cause: " + c for c in self.causes or
                    ["none seen; look for code that depends on the rank or the number of processes"]]
        return out


def run(args: Any, flags: dict[str, Any]) -> int:
    """multicard check script.py: the verdict printed; 0 where the runs agree, else 1. `flags`: the training flags
    typed (only --devices and --strategy are this check's)."""
    builtin = [f"--{name.replace('_', '-')}" for name in flags if name not in ("devices", "strategy")]
    if builtin:
        raise UsageError(f"check {args.script}: {builtin[0]} belongs to the built-in check (no script): your script "
                         f"builds its own model and data")
    verdict = check_script(args.script, args.args, flags.get("devices", "auto"), flags.get("strategy", "auto"),
                           args.tolerance, args.steps)
    print("\n".join(verdict.lines()))
    return 0 if verdict.ok else 1


def check_script(script: str, script_args: list[str], devices: str, strategy: str = "auto",
                 tolerance: float = 1e-4, steps: int | None = None) -> Verdict:
    """Run `script` on one process and on `devices` (N of them) under `strategy` (auto: ddp) and compare."""
    from .. import strategies
    from ..jobs.devices import select
    from ..jobs.dist import job_from_env
    from ..trainer.config import TrainConfig
    from .parity import runnable

    if not os.path.isfile(script):
        raise UsageError(f"check: no such script {script}")
    if not 0 <= tolerance < float("inf"):
        raise UsageError(f"--tolerance {tolerance}: must be a number of 0 or more")
    if steps is not None and steps < 1:
        raise UsageError(f"--steps {steps}: must be at least 1")
    strategy = "ddp" if strategy == "auto" else strategy
    if strategy not in WHOLE:
        raise UsageError(f"check {script}: --strategy {strategy}: the check compares whole weights, under "
                         f"{', '.join(WHOLE)}")
    job = job_from_env()
    if job.launched:
        raise UsageError(f"check: this shell is one process of a job already ({job.launcher} set RANK); run the "
                         f"check outside it")
    try:
        devices = runnable(TrainConfig(devices=devices))[1]  # auto: every card, else cpu:2; 2 or more
        many = strategies.create(strategy, select(devices), job)
    except UsageError as e:
        raise UsageError(f"check {script}: {e}") from None
    one_device = "cpu" if many.devices.kind == "cpu" else "cuda:0"  # the first of the chosen cards
    n = many.devices.count
    one_words, many_words = f"1 process ({one_device})", f"{n} processes ({strategy}, {devices})"
    if many.processes == 1:  # dp, dp-balanced: one process drives the cards
        many_words = f"{n} cards ({strategy}, {devices})"
    with tempfile.TemporaryDirectory(prefix="multicard-check-") as folder:
        one = recorded(script, script_args, "single", one_device, 1, os.path.join(folder, "one"), steps,
                       "one process")
        if not one[0]["models"]:
            raise UsageError(f"check: {script} set up no model (mc.setup): the check compares the models a script "
                             f"sets up, as written for multicard run")
        if not one[0]["steps"]:
            raise UsageError(f"check: {script} took no optimizer step on a set-up model's weights: nothing to "
                             f"compare")
        others = recorded(script, script_args, strategy, many.devices.spec, many.processes,
                          os.path.join(folder, "many"), steps, many_words)
    return compare(script, one, others, one_words, many_words, tolerance)


def recorded(script: str, script_args: list[str], strategy: str, devices: str, processes: int, folder: str,
             steps: int | None, where: str) -> list[dict[str, Any]]:
    """Run the script as `multicard run` runs it, every rank recorded; each rank's records, by rank."""
    from ..jobs.failures import Stopped
    from ..jobs.launcher import run_command
    from ..yourloop.replicas import MODE_VAR
    from .recorder import RECORDS, STEPS

    os.makedirs(folder)
    env = {protocol.STRATEGY: strategy, protocol.DEVICES: devices, RECORDS: folder,
           MODE_VAR: os.environ.get(MODE_VAR, "warn")}  # replicas that part are compared here, not stopped at
    if steps:
        env[STEPS] = str(steps)
    note(f"check: running {script} on {where}")
    said = io.StringIO()
    with contextlib.redirect_stderr(said):  # the launcher's own lines: folded into the one line below
        code = run_command([sys.executable, "-m", "multicard.tools.recorder", script, *script_args], processes, env)
    if code > 128:  # a signal stopped the job (or a closed stdout ended it)
        raise Stopped(code - 128)
    if code:
        told = "; ".join(line.removeprefix("multicard: ").removeprefix("error: ") for line in
                         said.getvalue().splitlines() if line.strip())
        raise UsageError(f"check: {script} failed on {where}" + (f": {told}" if told else f" (exit status {code})"))
    sys.stderr.write(said.getvalue())
    missing = [r for r in range(processes) if not os.path.isfile(os.path.join(folder, f"rank-{r}.pt"))]
    if missing:  # os._exit, or a child of fork() that went on as the script
        raise UsageError(f"check: {script} on {where}: rank {missing[0]} ended without leaving Python's way "
                         f"(os._exit?), so what it trained was not written")
    return [torch.load(os.path.join(folder, f"rank-{r}.pt"), weights_only=True) for r in range(processes)]


def compare(script: str, one: list[dict], many: list[dict], one_words: str, many_words: str,
            tolerance: float) -> Verdict:
    """The verdict on the records of the one-process run and the N-process run (ranks' records in order)."""
    first, other = one[0]["steps"], many[0]["steps"]
    label = names(one[0]["models"])
    verdict = Verdict(script, one_words, many_words, tolerance, min(len(first), len(other)))
    if len(first) != len(other):
        verdict.short = (f"the runs took different numbers of optimizer steps: {len(first)} on one process, "
                         f"{len(other)} on {many_words.split(' (')[0]}")
    for step, (a, b) in enumerate(zip(first, other, strict=False), 1):
        diffs = {label(key): difference(a["weights"][key], b["weights"].get(key)) for key in a["weights"]}
        name = max(diffs, key=lambda k: (diffs[k] != diffs[k], diffs[k]))  # the largest (not a number first)
        if diffs[name] > verdict.worst or diffs[name] != diffs[name]:
            verdict.worst, verdict.worst_at = diffs[name], (step, name)
        if not (diffs[name] <= tolerance) and not verdict.parted:
            verdict.parted = (step, name, diffs[name])
        verdict.losses.append((loss([one[0]["steps"][step - 1]]), loss([r["steps"][step - 1] for r in many])))
    if not verdict.ok:
        verdict.causes = causes(one, many)
    return verdict


def difference(one: torch.Tensor, other: torch.Tensor | None) -> float:
    """The largest difference of two tensors of a weight (inf: the other run has no such weight, or another
    shape)."""
    if other is None or one.shape != other.shape:
        return float("inf")
    return (one.double() - other.double()).abs().max().item() if one.numel() else 0.0


def names(models: list[dict]) -> Any:
    """How a weight is named: its name in its model, led by the model's class where the script set up several."""
    return lambda key: key[1] if len(models) == 1 else f"{models[key[0]]['name']}.{key[1]}"


def loss(ranks: list[dict]) -> float:
    """A step's loss: what its micro-batches passed to mc.backward, summed, then averaged over the ranks (summed,
    for reduction="sum")."""
    each = [sum(value for value, _ in step["losses"]) for step in ranks]
    summed = any(how == "sum" for step in ranks for _, how in step["losses"])
    return sum(each) if summed else sum(each) / len(each)


def causes(one: list[dict], many: list[dict]) -> list[str]:
    """What the recorders saw that parts N processes from one."""
    out, models = [], many[0]["models"]
    world = models[0]["world"]
    dropout = [f"{m['name']} ({', '.join(m['dropout'])})" for m in models if m["dropout"]]
    if dropout:
        out.append(f"dropout in {'; '.join(dropout)}: each process draws the masks of its own rows, so {world} "
                   f"processes draw other masks than one; compare with dropout at 0 (or the model in eval())")
    norms = [f"{m['name']} ({', '.join(m['batchnorm'][:3])}{', ...' * (len(m['batchnorm']) > 3)})" for m in models
             if m["batchnorm"] and not m["sync_batchnorm"] and m["strategy"] == "ddp"]
    if norms:
        out.append(f"BatchNorm per process in {'; '.join(norms)}: each computes its statistics over its 1/{world} of "
                   f"the batch; Multicard(sync_batchnorm=True) computes them over the whole batch")
    seeds = [r["models"][0]["seed"] for r in many]
    if len(set(seeds)) > 1:
        out.append(f"the processes are seeded apart (torch.initial_seed() {', '.join(map(str, seeds))} on ranks "
                   f"0..{len(seeds) - 1}: torch.manual_seed(mc.rank)?): data or draws made from it differ per "
                   f"process; seed every process alike")
    drew = next((s for s, (a, b) in enumerate(zip(one[0]["steps"], many[0]["steps"], strict=False), 1)
                 if a["random"] != b["random"]), 0)
    if not dropout and (drew or one[0]["models"][0]["random"] != models[0]["random"]):
        where = f"by step {drew}" if drew else "before setup"
        out.append(f"draws per process: rank 0 drew other random numbers than the one process {where} (dropout, "
                   f"noise or augmentation drawn per row: each process draws for its own rows)")
    precision = sorted({m["precision"] for m in models} - {"fp32"})
    if precision:
        out.append(f"precision {', '.join(precision)}: autocast rounds each op to 16 bits (bf16 keeps about 3 "
                   f"significant digits), so rounding alone can part the runs; compare in fp32, or raise --tolerance")
    return out

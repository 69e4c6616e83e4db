"""`multicard run script.py`: the user's own script as every process of a job on this machine, with a line as the
job starts (strategy, processes, devices, threads) and one as it ends well (its time), and a line where one of
run's own flags came after the script (it went to the script). They go to stderr: stdout stays the script's."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

from .. import rules
from ..errors import UsageError, note

if TYPE_CHECKING:
    from ..strategies import Strategy


def run(args: argparse.Namespace, own_flags: dict[str, bool]) -> int:
    """Start args.script with its arguments (args.args) as every rank of the job run's flags name. `own_flags`:
    run's own flags, each with whether it takes a value."""
    grace = rules.stop_grace(args.stop_grace, f"--stop-grace {args.stop_grace:g}")
    if not args.script:
        raise UsageError("run: name the script to run (multicard run [--devices D] script.py [its arguments])")
    if not args.module and not os.path.isfile(args.script):
        raise UsageError(f"run: no such script {args.script}")
    from .. import strategies
    from ..jobs.devices import select
    from ..jobs.dist import job_from_env
    from ..jobs.launcher import job_choice, ranks_env, run_command
    from ..yourloop import determinism

    started = time.monotonic()
    job = job_from_env()
    if job.launched:
        raise UsageError(f"run: this shell is one process of a job already ({job.launcher} set RANK); start the "
                         f"script directly, or unset RANK and WORLD_SIZE")
    try:
        strategy = strategies.create(args.strategy, select(args.devices), job)
    except UsageError as e:
        raise UsageError(f"run: {e}") from None
    command = ["-m"] * args.module + [args.script, *args.args]
    env = ranks_env(strategy.processes, {**job_choice(strategy), **replicas_env(args),
                                         **(determinism.environment() if args.deterministic else {})})
    if not args.quiet:
        if strategy.processes == 1 and (wrong := misplaced(args.script, args.args, own_flags)):
            note(wrong)
        note(start_line(args.script, strategy, env))
    code = run_command([sys.executable, *command], strategy.processes, env, grace)
    if code == 0 and not args.quiet:  # a failure has said its own line
        n = strategy.processes
        note(f"done: {args.script} ended well on {n} process{'es' * (n > 1)} in {time.monotonic() - started:.1f} s "
            f"(exit status 0)")
    return code



def start_line(script: str, strategy: Strategy, env: dict[str, str]) -> str:
    """What the job is: the strategy, its processes on which devices, torch's threads in each; with several
    processes, that each runs the whole script."""
    n, devices = strategy.processes, strategy.devices
    where = "the CPU" if devices.kind == "cpu" else f"{devices.count} card{'s' * (devices.count > 1)}"
    threads = threads_each(env)
    line = (f"running {script}: strategy {strategy.name}, {n} process{'es' * (n > 1)} on {where}, {threads} "
            f"thread{'s' * (threads != '1')}{' each' * (n > 1)}")
    if n > 1:
        line += " (each runs the whole script: mc.print prints on rank 0 alone, mc.save writes one file)"
    return line


def threads_each(env: dict[str, str]) -> str:
    """torch's intra-op threads in each rank: OMP_NUM_THREADS where the launcher set it for the ranks (2+
    processes), else what torch in this process made of the user's (up to the cores), else the count a process of
    its own takes (jobs/devices.py)."""
    import torch

    from ..jobs.devices import cpu_threads

    if env.get("OMP_NUM_THREADS") and not os.environ.get("OMP_NUM_THREADS"):
        return env["OMP_NUM_THREADS"]
    return str(cpu_threads(1, torch.get_num_threads()))


def misplaced(script: str, script_args: list[str], own_flags: dict[str, bool]) -> str:
    """Where the script's arguments hold one of run's own flags: the line that says it went to the script, and
    where it goes for run to take it ("" where none). The flag stays the script's: it may have its own."""
    for i, arg in enumerate(script_args):
        flag, equals, value = arg.partition("=")
        if flag not in own_flags:
            continue
        if own_flags[flag] and not equals and i + 1 < len(script_args):
            value = script_args[i + 1]
        typed = f"{flag} {value}" if own_flags[flag] and value else flag
        return (f"{typed} came after {script}, so it went to the script and this job runs 1 process; for multicard "
                f"run, put it first: multicard run {typed} {script}")
    return ""


def replicas_env(args: argparse.Namespace) -> dict[str, str]:
    """run's --replica-check flags, for the script's Multicard (yourloop/replicas.py reads them): only those given."""
    from ..yourloop.replicas import EVERY_VAR, MODE_VAR

    if args.replica_check_every is not None:
        rules.replica_check_every(args.replica_check_every, f"--replica-check-every {args.replica_check_every}")
    given = ((MODE_VAR, args.replica_check), (EVERY_VAR, args.replica_check_every))
    return {name: str(value) for name, value in given if value is not None}

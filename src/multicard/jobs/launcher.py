"""Start the processes of a job on this machine, or join the job a launcher (torchrun, srun) started.

`spawn` runs a Python function in N fresh processes (multicard.launch, multicard.train); `run_command` runs a
command N times (`multicard run script.py`, and a script whose Multicard needs more processes than it has).
Either way the processes meet at a store that this process holds on a port the system picked, as torchrun's
agent does: never a fixed 29500, and no moment in which another program can take the port first.

No process outlives its launcher, and none fails silently: when one fails, the others are stopped at once and
a rank is named (where one timed out waiting, the rank it waited for: stopped by a signal, or the one whose
progress is oldest); SIGINT, SIGTERM or SIGHUP to the launcher stops them all; and a launcher that dies by any
means (SIGKILL included) takes them along, through the kernel.

Each rank runs in a session of its own, as torchrun's ranks do. Linux shares the cores between sessions first
(autogroup scheduling, on by default), so ranks left in the user's shell session share one session's part of a
busy machine with everything else that shell started, where torchrun's get one part each: the same job waited
for cores, with the same CPU time (benchmarks/busy_launch.py). Out of the terminal's reach, a rank hears of Ctrl-C
and Ctrl-Z from this process (Signals), which passes them on.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import UsageError, note
from . import broken_pipe, jobdir, launcher_watch, progress, shipping, spawned, streams
from .devices import openmp_env
from .failures import RankFailed, Stopped
from .job_end import (
    FAILED_GRACE_S,
    STOP_GRACE_S,
    blame,
    first_failure,
    first_failure_of,
    parted,
    slot_path,
    stop,
    to_group,
    what_rank_left,
)
from .protocol import OURS, Handed, to_env


def free_port() -> int:
    """A port free right now (for tests and benchmarks that start torchrun themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def store():
    """The job's rendezvous store, held by this process on a port the system picks (port 0)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def job_env(rank: int, world: int, port: int, folder: str = "") -> dict[str, str]:
    """What a process of a job started here finds in its environment: torchrun's variables, the store, the
    launcher's pid (a process whose parent it is not is no rank: see launcher_watch.inherited) and (given the job's
    folder) the file where it shows its progress."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                TORCHELASTIC_USE_AGENT_STORE="True",  # every rank is a client of the store held here
                **to_env(Handed(OURS, str(os.getpid()), slot_path(folder, rank) if folder else None)))


class Signals:
    """While entered (in the main thread: only it may set handlers), SIGINT, SIGTERM and SIGHUP raise Stopped;
    while `held`, the first one waits for release; SIGTSTP (Ctrl-Z) pauses the ranks (`ranks`: their pids) with this
    process, and they go on with it; SIGUSR1 and SIGUSR2 (a cluster's warning before it stops the job: SLURM's
    --signal) are passed on to every rank, whose script's handler runs (`passed`: those passed on). A signal this
    process was started to ignore (SIGHUP under nohup, SIGINT for a shell's `cmd &`) stays ignored: that is what
    the user asked for."""

    def __init__(self):
        self.previous: dict[int, Any] = {}
        self.held, self.pending = False, 0
        self.ranks: list[int] = []
        self.passed: set[int] = set()

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            handlers = {signal.SIGINT: self._stop, signal.SIGTERM: self._stop, signal.SIGHUP: self._stop,
                        signal.SIGTSTP: self._pause, signal.SIGUSR1: self._pass, signal.SIGUSR2: self._pass}
            for s, handler in handlers.items():
                if signal.getsignal(s) is not signal.SIG_IGN:
                    self.previous[s] = signal.signal(s, handler)
        return self

    def __exit__(self, kind: Any, error: BaseException | None, trace: Any) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: a handler set outside Python
        if isinstance(error, Stopped):  # a script that lets it reach its top level ends as the signal would end it
            progress.hook_failures()

    def _stop(self, signum: int, frame: Any) -> None:
        if not self.held:
            raise Stopped(signum)
        self.pending = self.pending or signum

    def _pause(self, signum: int, frame: Any) -> None:
        for pid in self.ranks:
            to_group(pid, signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)  # as Ctrl-Z would have; the shell's `fg` (SIGCONT) goes on from here
        for pid in self.ranks:  # (a stop that comes meanwhile wakes them as it ends them: outcome.stop)
            to_group(pid, signal.SIGCONT)

    def _pass(self, signum: int, frame: Any) -> None:
        self.passed.add(signum)
        for pid in self.ranks:  # the rank alone: its DataLoader workers would die of it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        self.held = True
        try:
            yield
        finally:
            self.held = False
        if self.pending:
            raise Stopped(self.pending)


def spawn(fn: Callable, nprocs: int, args: tuple, named: tuple = (), stop_grace: float = STOP_GRACE_S) -> Any:
    """fn(*args) in `nprocs` fresh processes, ranks 0..nprocs-1 of one job; returns what rank 0's returned.
    The first failure stops them all: RankFailed names the rank to blame (UsageError for a bad input only a
    process could see). SIGINT, SIGTERM or SIGHUP here is passed on to every rank, which gets `stop_grace`
    seconds to act on it (a save) before SIGKILL; then Stopped is raised: not a failure to retry. From a notebook,
    `python -` or `-c`, what `__main__` defined goes by value (shipping.py) and what the processes print comes
    back here (streams.py). `named`: (name, object) for each thing the user passed, to name the one that cannot
    be sent."""
    import multiprocessing

    spawned.end_if_started_again()
    server = store()
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this one's threads or CUDA
    processes: list = []
    stopping, ended = 0, False  # the signal that stopped the job; whether it ended well
    relay = streams.Relay(context)
    with Signals() as signals, jobdir.job_folder() as folder:
        try:
            # fn and its arguments go through a file, not the pipe multiprocessing starts a process with: a rank that
            # ends before it reads them (a script without the __main__ guard) would leave this process blocked for
            # ever writing more than the pipe holds, deaf to every signal
            jobdir.write(os.path.join(folder, spawned.WORK), shipping.pack((fn, args), named),  # read as body says
                         "cannot start the job: fn and its arguments",
                         ", or pass less (large data: pass its path, and load it inside fn)")
            # every process started is known before a signal is acted on
            with signals.holding(), shipping.main_left_out():
                _tracker()
                with _blocked(signal.SIGINT):  # each rank starts with it blocked: see spawned.body
                    for rank in range(nprocs):
                        progress.new_slot(slot_path(folder, rank))
                        ends = relay.ends()
                        env = job_env(rank, nprocs, server.port, folder)
                        process = context.Process(target=spawned.body, name=f"multicard rank {rank}",
                                                  args=(rank, folder, os.getpid(), env, ends))
                        process.start()
                        processes.append(process)
                        signals.ranks.append(process.pid)
                        relay.started(ends)
            failed = first_failure_of(processes, folder)
            if failed is None:
                ended = True
                with open(os.path.join(folder, "result"), "rb") as f:
                    return pickle.load(f)
            raise _failure(failed, processes, folder, signals.passed)
        except Stopped as e:
            stopping = e.signum
            raise
        finally:
            signals.held = True  # stopping is under way: a second Ctrl-C must not cut it short
            stop(processes, stopping or signal.SIGTERM, stop_grace if stopping else FAILED_GRACE_S, groups=not ended)
            relay.finish()  # what they printed last shows before what this raises


def _tracker() -> None:
    """Start multiprocessing's resource tracker (the job's processes share it) with SIGHUP blocked, as it blocks
    SIGINT and SIGTERM itself: SIGHUP to the job's process group would end it, and every rank's cleanup would
    then start a new one that knows none of their semaphores (a traceback per rank)."""
    from multiprocessing import resource_tracker

    with _blocked(signal.SIGHUP):
        resource_tracker.ensure_running()


@contextlib.contextmanager
def _blocked(signum: int) -> Iterator[None]:
    """`signum` blocked in this thread while inside: held until then, and blocked in the processes started
    meanwhile (a rank unblocks SIGINT once a Ctrl-C stops it quietly, not while it imports torch)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signum})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _failure(rank: int, processes: list, folder: str, passed: set[int] = frozenset()) -> Exception:
    """What to raise for the failed `rank`: what it said of itself, else the rank it timed out waiting for,
    else its bad input, its traceback, or how it ended (`passed`: the signals this launcher passed on)."""
    kind, text = what_rank_left(folder, rank)
    if kind == "said":  # it was interrupted or stopped, by a signal to it alone
        return RankFailed(rank, text, meant=True)
    if not kind and processes[rank].exitcode == spawned.UNGUARDED:
        return UsageError(spawned.unguarded())
    if broken_pipe.by_pipe(processes[rank].exitcode) and broken_pipe.stdout_closed():  # `| head` read what it wanted
        return Stopped(signal.SIGPIPE)
    blamed = parted(rank, {r: p.exitcode for r, p in enumerate(processes)}, folder) or \
        blame(rank, {r: p.pid for r, p in enumerate(processes) if r != rank and p.is_alive()}, folder, len(processes))
    if blamed:
        return RankFailed(*blamed)
    if kind == "usage":
        return UsageError(text)
    if kind == "trace":
        return RankFailed(rank, text)
    return RankFailed(rank, ended_by(rank, processes[rank].exitcode, passed))


def ended_by(rank: int, code: int, passed: set[int]) -> str:
    """How rank `rank` ended with exit status `code` (negative: a signal), in a sentence; a signal this launcher
    passed on that the script has no handler for is named as such."""
    if -code in passed:
        name = signal.Signals(-code).name
        return f"rank {rank} ended on {name}, which this launcher passed on to every rank: the script has no handler " \
               f"for it (set one with signal.signal({name}, ...) to act on it, e.g. save a checkpoint)"
    return f"rank {rank} ended with {_how(code)} (its output is above)"


def _how(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def ranks_env(nprocs: int, env: dict[str, str]) -> dict[str, str]:
    """`env`, and what else each of `nprocs` ranks started here finds in its environment besides this process's own:
    torch's threads and how they wait (devices.openmp_env), where neither says."""
    return {**openmp_env(nprocs, {**os.environ, **env}), **env}


def run_command(command: list[str], nprocs: int, env: dict[str, str] | None = None,
                stop_grace: float = STOP_GRACE_S) -> int:
    """Run `command` as ranks 0..nprocs-1 of one job; return 0 when all end well, else the first failure's
    exit code (128 + N for signal N). A signal to this process stops them all: each gets it, and `stop_grace`
    seconds to act on it before SIGKILL."""
    server = store()
    procs: list[subprocess.Popen] = []
    env = ranks_env(nprocs, env or {})
    stopping, ended = 0, False  # the signal that stopped the job; whether it ended well
    with Signals() as signals, jobdir.job_folder() as folder:
        try:
            parent = os.getpid()
            with signals.holding():  # every process started is known before a signal is acted on
                for rank in range(nprocs):
                    progress.new_slot(slot_path(folder, rank))
                    procs.append(subprocess.Popen(command, env={**os.environ, **env,
                                                                **job_env(rank, nprocs, server.port, folder)},
                                                  start_new_session=True,
                                                  preexec_fn=lambda: launcher_watch.die_with(parent)))
                    signals.ranks.append(procs[-1].pid)
            failed = first_failure(procs, folder)
            if failed is None:
                ended = True
                return 0
            rank, code = failed
            if broken_pipe.by_pipe(code) and broken_pipe.stdout_closed():  # `| head` read what it wanted: no word
                return broken_pipe.SIGPIPE_EXIT
            kind, text = what_rank_left(folder, rank)
            if kind == "usage":  # the same bad input on every rank: said once
                note(f"error: {text}")
                return 2
            blamed = parted(rank, {r: p.poll() for r, p in enumerate(procs)}, folder) or \
                blame(rank, {r: p.pid for r, p in enumerate(procs) if r != rank and p.poll() is None}, folder, nprocs)
            if blamed:
                note(f"{blamed[1]}; every rank was stopped")
            else:
                others = "; the other ranks were stopped" if nprocs > 1 else ""
                said = text if kind == "lost" else ended_by(rank, code, signals.passed).replace(" ended with ",
                                                                                               " failed with ", 1)
                note(f"{said}{others}")
            return 128 - code if code < 0 else code
        except Stopped as e:
            stopping = e.signum  # passed on as it came: the script sees its KeyboardInterrupt on Ctrl-C, as alone
            note(f"stopped by {e}; every rank was stopped")
            return 128 + e.signum
        finally:
            signals.held = True  # stopping is under way: a second Ctrl-C must not cut it short
            stop(procs, stopping or signal.SIGTERM, stop_grace if stopping else FAILED_GRACE_S, groups=not ended)


def relaunch(strategy: Any) -> None:
    """Run this script again as each rank of a job, wait, and end this process with their exit code. `strategy`:
    the Strategy (its name, processes and devices; a layer above this one, so not imported here)."""
    if not shipping.main_runs_again():
        raise UsageError(f"strategy {strategy.name} on {strategy.devices.count} devices needs "
                         f"{strategy.processes} processes, and a notebook (or python -, -c, the REPL) cannot run "
                         f"again as each of them: put the loop in a function fn(mc) and call "
                         f"multicard.launch(fn, devices=...) (or mc.launch(fn)); see docs/notebooks.md")
    if not sys.argv or sys.argv[0] in ("", "-c"):
        raise UsageError(f"strategy {strategy.name} on {strategy.devices.count} devices needs "
                         f"{strategy.processes} processes: put the work in fn(mc) and call mc.launch(fn), or "
                         f"start the script with multicard run")
    command = [sys.executable, *sys.orig_argv[1:]]
    sys.exit(run_command(command, strategy.processes, job_choice(strategy)))


def job_choice(strategy: Any) -> dict[str, str]:
    """What a launcher tells the processes it starts: the strategy, and the devices as they see them (it has
    narrowed CUDA_VISIBLE_DEVICES to the chosen cards already, where CUDA had not started)."""
    return to_env(Handed(strategy=strategy.name, devices=strategy.devices.spec))

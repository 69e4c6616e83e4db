"""Start the processes of a job on this machine, or join the job a launcher (torchrun, srun) started.

`spawn` runs a Python function in N fresh processes (multicard.launch, multicard.train); `run_command` runs a
command N times (`multicard run script.py`, and a script whose Multicard needs more processes than it has).
Either way the processes meet at a store that this process holds on a port the system picked, as torchrun's
agent does: never a fixed 29500, and no moment in which another program can take the port first.

No process outlives its launcher, and none fails silently: when one fails, the others are stopped at once and
a rank is named (where one timed out waiting, the rank it waited for: stopped by a signal, or the one whose
progress is oldest); SIGINT, SIGTERM or SIGHUP to the launcher stops them all; and a launcher that dies by any
means (SIGKILL included) takes them along, through the kernel.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from . import dist, lifeline
from .errors import UsageError

if TYPE_CHECKING:
    from .strategies import Strategy

STOP_GRACE_S = 5  # a stopped process gets this long to go on SIGTERM before SIGKILL
KILLED_S = 5  # and this long to be gone after SIGKILL: one frozen in the kernel (a cgroup freezer) is not waited for
MISMATCH_S = 2  # a rank timed out waiting: how long the others get to time out too (then none stopped: a mismatch)
PEER_S = 3  # a rank that failed because another was lost: how long the others get to say they failed first


class RankFailed(Exception):
    """Rank `rank` of a job failed: `trace` is its traceback, or, where there is none to show, a sentence
    that starts with "rank N " (it was interrupted, it stopped making progress, it ended with a signal).
    `meant`: someone stopped that rank on purpose (SIGINT or SIGTERM to it alone), so it is not restarted."""

    def __init__(self, rank: int, trace: str, meant: bool = False):
        super().__init__(trace if said(rank, trace) else f"rank {rank} failed:\n{trace}")
        self.rank, self.trace, self.meant = rank, trace, meant

    def __reduce__(self):
        return RankFailed, (self.rank, self.trace, self.meant)


def said(rank: int, trace: str) -> bool:
    """Whether a RankFailed's trace is a sentence about the rank rather than a traceback."""
    return trace.startswith(f"rank {rank} ")


class Stopped(BaseException):
    """A signal to the launcher (SIGINT, SIGTERM, SIGHUP) stopped the job. A BaseException, as
    KeyboardInterrupt is: no `except Exception` (a retry loop, a user's handler) takes it for a failure."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def free_port() -> int:
    """A port free right now (for tests and benchmarks that start torchrun themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def store():
    """The job's rendezvous store, held by this process on a port the system picks (port 0)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def job_env(rank: int, world: int, port: int, folder: str = "", launcher: int = 0) -> dict[str, str]:
    """What a process of a job started here finds in its environment: torchrun's variables, the store, the
    launcher's pid (a process whose parent it is not is no rank: see dist.inherited) and (given the job's folder)
    the file where it shows its progress."""
    env = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MULTICARD_LAUNCHER="multicard",
               TORCHELASTIC_USE_AGENT_STORE="True")  # every rank is a client of the store held here
    env[dist.LAUNCHER_PID] = str(launcher or os.getpid())
    if folder:
        env[dist.PROGRESS] = slot_path(folder, rank)
    return env


def slot_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"progress-{rank}")


class Signals:
    """While entered (in the main thread: only it may set handlers), SIGINT, SIGTERM and SIGHUP raise Stopped;
    while `held`, the first one waits for release. A signal this process was started to ignore (SIGHUP under
    nohup, SIGINT for a shell's `cmd &`) stays ignored: that is what the user asked for."""

    def __init__(self):
        self.previous: dict[int, Any] = {}
        self.held, self.pending = False, 0

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(s) is not signal.SIG_IGN:
                    self.previous[s] = signal.signal(s, self._stop)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: a handler set outside Python

    def _stop(self, signum: int, frame: Any) -> None:
        if not self.held:
            raise Stopped(signum)
        self.pending = self.pending or signum

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        self.held = True
        try:
            yield
        finally:
            self.held = False
        if self.pending:
            raise Stopped(self.pending)


def spawn(fn: Callable, nprocs: int, args: tuple, grace_s: float = 3) -> Any:
    """fn(*args) in `nprocs` fresh processes, ranks 0..nprocs-1 of one job; returns what rank 0's returned.
    The first failure stops them all: RankFailed names the rank to blame (UsageError for a bad input only a
    process could see). SIGINT, SIGTERM or SIGHUP here stops them all and raises Stopped: not a failure to
    retry."""
    import multiprocessing

    server = store()
    folder = tempfile.mkdtemp(prefix="multicard-job-")
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this one's threads or CUDA
    processes: list = []
    with Signals() as signals:
        try:
            work = pickle.dumps((fn, args))  # opened in each process as _child says (not before it starts)
            with signals.holding():  # every process started is known before a signal is acted on
                _tracker()
                for rank in range(nprocs):
                    dist.new_slot(slot_path(folder, rank))
                    process = context.Process(target=_child, name=f"multicard rank {rank}",
                                              args=(rank, work, nprocs, server.port, folder, os.getpid()))
                    process.start()
                    processes.append(process)
            failed = _first_failure(processes, folder)
            if failed is None:
                with open(os.path.join(folder, "result"), "rb") as f:
                    return pickle.load(f)
            raise _failure(failed, processes, folder)
        finally:
            signals.held = True  # stopping is under way: a second Ctrl-C must not cut it short
            _stop(processes, grace_s)
            shutil.rmtree(folder, ignore_errors=True)


def _tracker() -> None:
    """Start multiprocessing's resource tracker (the job's processes share it) with SIGHUP blocked, as it blocks
    SIGINT and SIGTERM itself: SIGHUP to the job's process group would end it, and every rank's cleanup would
    then start a new one that knows none of their semaphores (a traceback per rank)."""
    from multiprocessing import resource_tracker

    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _first_failure(processes: list, folder: str) -> int | None:
    """Wait until every process ended well (None), or one failed: its rank (see first_to_fail)."""
    from multiprocessing.connection import wait

    sentinels = {p.sentinel: rank for rank, p in enumerate(processes)}

    def ended(running: set[int], timeout: float | None) -> list[int]:
        ready = [sentinels[s] for s in wait([processes[r].sentinel for r in running], timeout)]
        for rank in ready:
            processes[rank].join()
        return ready

    return first_to_fail(len(processes), ended, lambda rank: processes[rank].exitcode, folder)


def first_to_fail(nprocs: int, ended: Callable[[set[int], float | None], list[int]], code: Callable[[int], int],
                  folder: str) -> int | None:
    """The rank whose failure ended the job (None: all ended well). `ended(running, timeout)` waits for ranks to
    end (the first to end first). A rank that failed because another was lost (its peer closed the connection)
    is not the cause: the others get PEER_S to fail on their own, and the first of those is named."""
    running, failed, deadline = set(range(nprocs)), None, None
    while running:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done = ended(running, timeout)
        for rank in done:
            running.discard(rank)
            if code(rank):
                if dist.read_slot(slot_path(folder, rank))[2] != dist.LOST_PEER:
                    return rank
                if failed is None:
                    failed, deadline = rank, time.monotonic() + PEER_S
        if deadline is not None and not done and time.monotonic() >= deadline:
            break
    return failed


def _failure(rank: int, processes: list, folder: str) -> Exception:
    """What to raise for the failed `rank`: what it said of itself, else the rank it timed out waiting for,
    else its bad input, its traceback, or how it ended."""
    kind, text = told(folder, rank)
    if kind == "said":  # it was interrupted or stopped, by a signal to it alone
        return RankFailed(rank, text, meant=True)
    blamed = blame(rank, {r: p.pid for r, p in enumerate(processes) if r != rank and p.is_alive()}, folder,
                   len(processes))
    if blamed:
        return RankFailed(*blamed)
    if kind == "usage":
        return UsageError(text)
    if kind == "trace":
        return RankFailed(rank, text)
    return RankFailed(rank, f"rank {rank} ended with {_how(processes[rank].exitcode)} (its output is above)")


def _how(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def blame(failed: int, others: dict[int, int], folder: str, world: int = 0) -> tuple[int, str] | None:
    """Where rank `failed` timed out waiting, the rank it waited for among `others` (rank: pid, still
    running), and why: one stopped by a signal (a frozen process); else, where every other rank of the `world`
    timed out waiting too, none: they called different collectives; else the one whose progress is oldest."""
    _, timeout, state = dist.read_slot(slot_path(folder, failed))
    if state != dist.TIMED_OUT_STATE or not (others or world > 1):
        return None
    stopped = [r for r, pid in sorted(others.items()) if _state(pid) in ("T", "t")]
    if stopped:
        rank, why = stopped[0], "it was stopped by a signal"
    elif world > 1 and (waiting := _waiting_too(failed, world, folder)):
        return failed, (f"rank {failed} timed out waiting for {waiting} after {timeout:g} s, and {waiting} for it: "
                        f"the ranks called different collectives (or the same ones in another order)")
    elif not others:
        return None
    else:
        last = {r: dist.read_slot(slot_path(folder, r))[0] for r in others}
        rank = min(last, key=lambda r: (last[r], r))
        why = f"no progress from it for {time.monotonic() - last[rank]:.0f} s" if last[rank] else \
            "it made no progress at all"
    return rank, (f"rank {rank} stopped making progress ({why}; rank {failed} timed out waiting for it after "
                  f"{timeout:g} s)")


def _waiting_too(failed: int, world: int, folder: str) -> str:
    """"rank 1" or "ranks 1 and 2": every rank but `failed`, where each timed out waiting within MISMATCH_S (they
    started to wait about together); "" where one did not (it is the one that stopped making progress)."""
    others = [r for r in range(world) if r != failed]
    deadline = time.monotonic() + MISMATCH_S
    while any(dist.read_slot(slot_path(folder, r))[2] != dist.TIMED_OUT_STATE for r in others):
        if time.monotonic() > deadline:
            return ""
        time.sleep(0.05)
    return f"rank{'s' * (len(others) > 1)} {dist.listed([str(r) for r in others])}"


def _state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped by a signal, t: by a debugger); '?' where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "?"


def _stop(processes: list, grace_s: float) -> None:
    """SIGTERM to every process still running (and SIGCONT: a stopped one must wake up to act on it), SIGKILL
    to any still there after grace_s. One that ends on SIGTERM cleans up after itself: nothing it made (its
    semaphores) is left for the resource tracker to warn about."""
    import multiprocessing.process

    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
            os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    deadline = time.monotonic() + KILLED_S
    for rank, p in enumerate(processes):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            _left_behind(rank, p.pid)
            multiprocessing.process._children.discard(p)  # else Python's exit would wait for it without limit


def _child(rank: int, work: bytes, nprocs: int, port: int, folder: str, launcher: int) -> None:
    """The body of a spawned process: fn(*args) (pickled in `work`), and what became of it left in the job's
    folder."""
    lifeline.die_with(launcher)  # first: a launcher gone already, or going later, takes this process along
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # stopped as by Ctrl-C: its cleanup runs
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, _raise_stopped)
    os.environ.update(job_env(rank, nprocs, port, folder, launcher))
    fn, args = _unpickled(work, rank, folder)
    try:
        out = fn(*args)
        if _signalled:  # raised where Python swallows exceptions (a __del__, a callback): the job still fails
            raise KeyboardInterrupt if _signalled[0] == signal.SIGINT else Stopped(_signalled[0])
    except KeyboardInterrupt:  # SIGINT to this process alone: the job fails, naming it (never an exit 0)
        _fail("said", f"rank {rank} was interrupted (SIGINT)")
    except Stopped as e:
        _fail("said", f"rank {rank} was stopped by {e}")
    except UsageError as e:  # a bad input that only a process could see: one line, as anywhere else
        _fail("usage", str(e))
    except Exception as e:
        dist.failed(e)
        _fail("trace", traceback.format_exc())
    if rank == 0:
        with open(os.path.join(folder, "result"), "wb") as f:
            pickle.dump(out, f)


def _unpickled(work: bytes, rank: int, folder: str) -> tuple[Callable, tuple]:
    """fn and its arguments. The modules they come from are imported here as modules: with no command line (the
    launcher's flags are not theirs: a top-level argparse would refuse them), and one that ends the program when
    imported fails the job in a line."""
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        return pickle.loads(work)
    except SystemExit as e:
        _fail("usage", f"importing what rank {rank} runs ended the program (exit {e.code}): a module "
                                     f"that runs a script at import? put that under `if __name__ == \"__main__\":`")
    finally:
        sys.argv = argv


_signalled: list[int] = []  # the signals this spawned process got: SIGINT, SIGTERM or SIGHUP


def _raise_stopped(signum: int, frame: Any) -> None:
    _signalled.append(signum)
    if len(_signalled) > 1:  # a second signal (SIGHUP to the group, then SIGTERM from the launcher): the cleanup
        return  # the first began goes on (the launcher's SIGKILL still bounds it)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signum)


def _fail(kind: str, text: str) -> None:
    dist.tell_launcher(kind, text)
    sys.exit(1)


def told(folder: str, rank: int) -> tuple[str, str]:
    """What rank `rank` left in the job's folder of how it failed (dist.tell_launcher): (kind, text), or empty."""
    try:
        with open(os.path.join(folder, f"error-{rank}"), "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return "", ""


def run_command(command: list[str], nprocs: int, env: dict[str, str] | None = None) -> int:
    """Run `command` as ranks 0..nprocs-1 of one job; return 0 when all end well, else the first failure's
    exit code (128 + N for signal N). A signal to this process stops them all."""
    server = store()
    folder = tempfile.mkdtemp(prefix="multicard-job-")
    procs: list[subprocess.Popen] = []
    with Signals() as signals:
        try:
            parent = os.getpid()
            with signals.holding():  # every process started is known before a signal is acted on
                for rank in range(nprocs):
                    dist.new_slot(slot_path(folder, rank))
                    procs.append(subprocess.Popen(command, env={**os.environ, **(env or {}),
                                                                **job_env(rank, nprocs, server.port, folder)},
                                                  preexec_fn=lambda: lifeline.die_with(parent)))
            failed = first_failure(procs, folder)
            if failed is None:
                return 0
            rank, code = failed
            kind, text = told(folder, rank)
            if kind == "usage":  # the same bad input on every rank: said once
                print(f"multicard: error: {text}", file=sys.stderr)
                return 2
            blamed = blame(rank, {r: p.pid for r, p in enumerate(procs) if r != rank and p.poll() is None}, folder,
                           nprocs)
            if blamed:
                print(f"multicard: {blamed[1]}; every rank was stopped", file=sys.stderr)
            else:
                others = "; the other ranks were stopped" if nprocs > 1 else ""
                print(f"multicard: rank {rank} failed with {_how(code)} (its output is above){others}",
                      file=sys.stderr)
            return 128 - code if code < 0 else code
        except Stopped as e:
            print(f"multicard: stopped by {e}; every rank was stopped", file=sys.stderr)
            return 128 + e.signum
        finally:
            signals.held = True  # stopping is under way: a second Ctrl-C must not cut it short
            terminate(procs)
            shutil.rmtree(folder, ignore_errors=True)


def first_failure(procs: list[subprocess.Popen], folder: str) -> tuple[int, int] | None:
    """Wait until every process ended well (None), or one failed: (its rank, its exit code)."""
    ranks = {p.pid: rank for rank, p in enumerate(procs)}

    def ended(running: set[int], timeout: float | None) -> list[int]:
        pid = None
        if timeout is None:
            pid = _wait_for_any_child()
        else:
            time.sleep(min(timeout, 0.05))
        # the child the system reported first: with several ended, the order of the ranks is not theirs
        order = sorted(running, key=lambda rank: (rank != ranks.get(pid), rank))
        return [rank for rank in order if procs[rank].poll() is not None]

    rank = first_to_fail(len(procs), ended, lambda rank: procs[rank].returncode, folder)
    return None if rank is None else (rank, procs[rank].returncode)


def _wait_for_any_child() -> int | None:
    """Block until some child has ended (left for poll() to collect): its pid."""
    try:
        pid = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT).si_pid
    except (AttributeError, ChildProcessError):  # no waitid here, or no child left to wait for
        time.sleep(0.05)
        return None
    time.sleep(0.01)  # a child this loop does not own would be seen again at once: never spin
    return pid


def terminate(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (and SIGCONT, for one stopped by a signal) to each process still running; SIGKILL after
    STOP_GRACE_S."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
                os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    deadline = time.monotonic() + KILLED_S
    for rank, p in enumerate(procs):
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _left_behind(rank, p.pid)


def _left_behind(rank: int, pid: int) -> None:
    print(f"multicard: rank {rank} (pid {pid}) did not end on SIGKILL: it is frozen in the kernel (a cgroup "
          f"freezer?) and ends once thawed; not waiting for it", file=sys.stderr)


def relaunch(strategy: Strategy) -> None:
    """Run this script again as each rank of a job, wait, and end this process with their exit code."""
    if not sys.argv or sys.argv[0] in ("", "-c") or not getattr(sys.modules["__main__"], "__file__", None):
        raise UsageError(f"strategy {strategy.name} on {strategy.devices.count} devices needs "
                         f"{strategy.processes} processes: put the work in fn(mc) and call mc.launch(fn), or "
                         f"start the script with multicard run")
    command = [sys.executable, *sys.orig_argv[1:]]
    sys.exit(run_command(command, strategy.processes, job_choice(strategy)))


def job_choice(strategy: Strategy) -> dict[str, str]:
    """What a launcher tells the processes it starts: the strategy, and the kind of device (it has narrowed
    CUDA_VISIBLE_DEVICES to the chosen cards already)."""
    return {"MULTICARD_STRATEGY": strategy.name, "MULTICARD_DEVICES": strategy.devices.kind}

"""Start the processes of a job on this machine, or join the job a launcher (torchrun, srun) started.

`spawn` runs a Python function in N fresh processes (multicard.launch, multicard.train); `run_command` runs a
command N times (`multicard run script.py`, and a script whose Multicard needs more processes than it has).
Either way the processes meet at a store that this process holds on a port the system picked, as torchrun's
agent does: never a fixed 29500, and no moment in which another program can take the port first. When any
process fails, the others are stopped at once and the failing rank is named.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import UsageError

if TYPE_CHECKING:
    from .strategies import Strategy

STOP_GRACE_S = 5  # a stopped process gets this long to go on SIGTERM before SIGKILL


class RankFailed(Exception):
    def __init__(self, rank: int, trace: str):
        super().__init__(f"rank {rank} failed:\n{trace}")
        self.rank, self.trace = rank, trace

    def __reduce__(self):
        return RankFailed, (self.rank, self.trace)


def free_port() -> int:
    """A port free right now (for tests and benchmarks that start torchrun themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def store():
    """The job's rendezvous store, held by this process on a port the system picks (port 0)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def job_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What a process of a job started here finds in its environment: torchrun's variables, and the store."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MULTICARD_LAUNCHER="multicard",
                TORCHELASTIC_USE_AGENT_STORE="True")  # every rank is a client of the store held here


def spawn(fn: Callable, nprocs: int, args: tuple, grace_s: float = 3) -> Any:
    import torch.multiprocessing as mp

    server = store()
    fd, result = tempfile.mkstemp(prefix="multicard-result-")
    os.close(fd)
    context = mp.start_processes(_child, (fn, args, nprocs, server.port, result), nprocs, join=False,
                                 start_method="spawn")
    try:
        while not context.join(grace_period=grace_s):
            pass
        with open(result, "rb") as f:
            return pickle.load(f)
    except mp.ProcessRaisedException as e:
        trace = e.msg.split("following error:\n", 1)[-1]
        last = trace.strip().splitlines()[-1] if trace.strip() else ""
        if last.startswith("multicard.errors.UsageError: "):  # a bad input that only a process could see
            raise UsageError(last.split(": ", 1)[1]) from None
        raise RankFailed(e.error_index, trace) from None
    except mp.ProcessExitedException as e:
        how = f"signal {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
        raise RankFailed(e.error_index, f"the process ended with {how} (see its output above)") from None
    finally:
        for process in context.processes:  # Ctrl-C, or anything else: leave no process behind
            if process.is_alive():
                process.kill()
                process.join()
        os.unlink(result)


def _child(index: int, fn: Callable, args: tuple, nprocs: int, port: int, result: str) -> None:
    os.environ.update(job_env(index, nprocs, port))
    out = fn(*args)
    if index == 0:
        with open(result, "wb") as f:
            pickle.dump(out, f)


class Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_command(command: list[str], nprocs: int, env: dict[str, str] | None = None) -> int:
    """Run `command` as ranks 0..nprocs-1 of one job; return 0 when all end well, else the first failure's
    exit code (128 + N for signal N). A signal to this process stops them all."""
    server = store()
    procs: list[subprocess.Popen] = []

    def stop(signum, frame):
        raise Stopped(signum)

    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} if main else {}
    try:
        parent = os.getpid()
        for rank in range(nprocs):
            procs.append(subprocess.Popen(command, env={**os.environ, **(env or {}),
                                                        **job_env(rank, nprocs, server.port)},
                                          preexec_fn=lambda: _die_with(parent)))
        failed = first_failure(procs)
        if failed is None:
            return 0
        rank, code = failed
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        others = "; the other ranks were stopped" if nprocs > 1 else ""
        print(f"multicard: rank {rank} failed with {how} (its output is above){others}", file=sys.stderr)
        return 128 - code if code < 0 else code
    except Stopped as e:
        print(f"multicard: stopped by {e}; every rank was stopped", file=sys.stderr)
        return 128 + e.signum
    finally:
        terminate(procs)
        for s, handler in previous.items():
            signal.signal(s, handler)


def first_failure(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """Wait until every process ended well (None), or one failed: (its rank, its exit code)."""
    running = set(range(len(procs)))
    while running:
        _wait_for_any_child()
        for rank in sorted(running):
            code = procs[rank].poll()
            if code is not None:
                running.discard(rank)
                if code != 0:
                    return rank, code
    return None


def _wait_for_any_child() -> None:
    """Block until some child has ended (left for poll() to collect), so the first to fail is the one seen."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
    except (AttributeError, ChildProcessError):  # no waitid here, or no child left to wait for
        time.sleep(0.05)
    else:
        time.sleep(0.01)  # a child this loop does not own would be seen again at once: never spin


def terminate(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _die_with(parent: int) -> None:
    """In a child, before it runs: the kernel kills it when this launcher dies, whatever the cause (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


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

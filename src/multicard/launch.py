"""Run a function in N processes on this machine, or join the job a launcher (torchrun, srun) started.

Spawned processes meet on a loopback port picked free at start (never a fixed 29500). When any process
fails, the others are stopped at once and the failing rank's own traceback is what the user sees.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

from .dist import job_from_env
from .errors import UsageError

PORT_TRIES = 3  # a port found free can be taken by someone else before rank 0 binds it: then pick again


class RankFailed(Exception):
    def __init__(self, rank: int, trace: str):
        super().__init__(f"rank {rank} failed:\n{trace}")
        self.rank, self.trace = rank, trace

    def __reduce__(self):
        return RankFailed, (self.rank, self.trace)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(fn: Callable, nprocs: int, args: tuple = ()) -> None:
    """fn(*args) in `nprocs` fresh processes, each with RANK / WORLD_SIZE / MASTER_* set; or right here when
    one process is enough or this process is already one rank of a launched job."""
    if nprocs == 1 or job_from_env().launched:
        fn(*args)
        return
    for attempt in range(PORT_TRIES):
        try:
            spawn(fn, nprocs, args, free_port())
            return
        except RankFailed as e:
            if "address already in use" not in e.trace.lower() or attempt == PORT_TRIES - 1:
                raise


def spawn(fn: Callable, nprocs: int, args: tuple, port: int, grace_s: float = 3) -> None:
    import torch.multiprocessing as mp

    context = mp.start_processes(_child, (fn, args, nprocs, port), nprocs, join=False, start_method="spawn")
    try:
        while not context.join(grace_period=grace_s):
            pass
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


def _child(index: int, fn: Callable, args: tuple, nprocs: int, port: int) -> None:
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      MULTICARD_LAUNCHER="multicard")
    fn(*args)

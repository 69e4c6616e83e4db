"""A process of a job lives no longer than the job: a rank no longer than its launcher (ours, torchrun's agent, srun's
step), and what a rank started (its DataLoader workers, its subprocesses: they stay in the process group the rank
leads) no longer than a job that was stopped or lost its launcher, as torchrun ends a rank's group. What a rank
forks is never killed while the rank lives, nor when it ends well, as under plain Python. Nothing of a job keeps
training, or writes into --out, after the job has ended."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable

from ..errors import note
from .protocol import from_env

WATCH_S = 0.5  # how often a rank looks whether its launcher is still there

# the launcher this rank belongs to, once watched: module level, as the process is a rank of one launcher and the
# fork and signal paths that read it have no object to ask
_parent: int | None = None
_FIRST_PARENT = os.getppid()  # as multicard was first imported: a launcher that dies while its rank still imports
# torch is seen gone once the rank watches (the parent then is whoever took the orphan, not the launcher)


def die_with(parent: int) -> None:
    """In a rank, before it does anything: the kernel kills it with SIGKILL when `parent` (the launcher's thread
    that started it) dies, whatever the cause (Linux); one whose parent died already ends now. Once the rank
    watches its launcher (watch_parent), that watch ends the rank's whole process group instead."""
    if _parent_death_signal(signal.SIGKILL) and os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def _parent_death_signal(signum: int) -> bool:
    """The signal the kernel sends this process when the thread that started it dies (Linux); whether it could
    be set."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(1, signum) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def in_worker(init: Callable[[int], None] | None, deterministic: bool = False) -> Callable[[int], None] | None:
    """A DataLoader's worker_init_fn: where deterministic algorithms are on, the worker takes them first (a spawned
    worker does not inherit them), then `init` (the user's own) runs; else `init` as it is. A worker is tied to
    nothing: it lives in its rank's process group, which a stopped job ends whole (outcome.stop)."""
    return functools.partial(_worker_started, init) if deterministic else init


def _worker_started(init: Callable[[int], None] | None, worker_id: int) -> None:
    import torch

    torch.use_deterministic_algorithms(True)
    if init is not None:
        init(worker_id)


def watch_parent(rank: int) -> None:
    """Follow this rank's launcher (its parent): once it is gone, say so and end at once, with every process the
    rank started that stays in its process group (its DataLoader workers, its subprocesses). torchrun's agent does
    not take its ranks along when it is killed outright; they would train on, and publish into --out. The kernel
    then wakes the rank (SIGCONT, where Ctrl-Z stopped it), for the watch to act."""
    global _parent
    if _parent is not None:
        return
    _parent = _FIRST_PARENT
    end_if_orphaned(rank)
    _parent_death_signal(signal.SIGCONT)

    def watch() -> None:
        while True:
            time.sleep(WATCH_S)
            end_if_orphaned(rank)

    threading.Thread(target=watch, name="multicard parent watch", daemon=True).start()


def end_if_orphaned(rank: int) -> None:
    """End this process now, with one line, where its launcher is gone: the job it belonged to has ended, and
    nothing it would do from here (a checkpoint, publishing the run) is wanted."""
    if _parent is not None and os.getppid() != _parent:  # watched since it joined the job, and gone
        note(f"rank {rank}: its launcher (pid {_parent}) is gone; this rank ends")
        if os.getpgid(0) == os.getpid():  # it leads its group (ours and torchrun's ranks do): all of it ends
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def inherited(env=os.environ) -> bool:
    """Whether the job in `env` was started by multicard but not for this process: its launcher is not our
    parent (a rank's own child, or a shell under it, finds the variables too)."""
    handed = from_env(env)
    return handed.ours and handed.launcher_pid not in (None, str(os.getppid()))

"""A process of a job lives no longer than what started it: a rank no longer than its launcher (ours, torchrun's
agent, srun's step), a DataLoader worker no longer than its rank. Nothing of a job keeps training, or writes into
--out, after the job has ended."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable

from ..errors import note

LAUNCHER_PID = "MULTICARD_LAUNCHER_PID"  # our launcher names itself here: a process whose parent it is not is no rank
WATCH_S = 0.5  # how often a rank looks whether its launcher is still there

_parent: int | None = None  # the launcher this rank belongs to, once watched
_FIRST_PARENT = os.getppid()  # as multicard was first imported: a launcher that dies while its rank still imports
# torch is seen gone once the rank watches (the parent then is whoever took the orphan, not the launcher)
_forking: list[int] = []  # the pid of the process forking right now (set before the fork, read in the child)


def die_with(parent: int) -> None:
    """In a child, before it does anything: the kernel kills it with SIGKILL when `parent` (the thread that
    started it) dies, whatever the cause (Linux); one whose parent died already ends now."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def tie_forks() -> None:
    """Every process forked from this one from now on (DataLoader workers, with the default fork start) dies with
    it: a rank killed outright leaves no worker behind, nor the resource tracker those workers keep alive."""
    if not _forking:
        _forking.append(0)
        os.register_at_fork(before=lambda: _forking.__setitem__(0, os.getpid()),
                            after_in_child=lambda: die_with(_forking[0]))


def in_worker(init: Callable[[int], None] | None, deterministic: bool = False) -> Callable[[int], None]:
    """A DataLoader's worker_init_fn: the worker is first tied to this process (it dies with it, however it was
    started: fork or spawn), takes its deterministic algorithms where they are on (a spawned worker does not
    inherit them), then `init` (the user's own) runs."""
    return functools.partial(_worker_started, os.getpid(), init, deterministic)


def _worker_started(parent: int, init: Callable[[int], None] | None, deterministic: bool, worker_id: int) -> None:
    die_with(parent)
    if deterministic:
        import torch

        torch.use_deterministic_algorithms(True)
    if init is not None:
        init(worker_id)


def watch_parent(rank: int) -> None:
    """Follow this rank's launcher (its parent): once it is gone, say so and end at once. torchrun's agent does
    not take its ranks along when it is killed outright; they would train on, and publish into --out."""
    global _parent
    if _parent is not None:
        return
    _parent = _FIRST_PARENT
    end_if_orphaned(rank)

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
        os.kill(os.getpid(), signal.SIGKILL)


def inherited(env=os.environ) -> bool:
    """Whether the job in `env` was started by multicard but not for this process: its launcher is not our
    parent (a rank's own child, or a shell under it, finds the variables too)."""
    return env.get("MULTICARD_LAUNCHER") == "multicard" and env.get(LAUNCHER_PID, str(os.getppid())) != \
        str(os.getppid())

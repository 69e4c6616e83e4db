"""How a job's processes end: wait for them, name the rank whose failure ended the job (not a rank that only
lost it, nor the victim of a frozen one), and stop the rest within a bound, however they resist."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import time
from collections.abc import Callable

from ..errors import note
from . import dist
from .protocol import LOST_PEER, TIMED_OUT_STATE, read_slot

STOP_GRACE_S = 30.0  # a job stopped by a signal: its ranks get this long to act on it (a save) before SIGKILL, as
# torchrun gives them (multicard run --stop-grace, launch(stop_grace=))
FAILED_GRACE_S = 5.0  # a job a rank failed: the others get this long to end on SIGTERM before SIGKILL
KILLED_S = 5  # and this long to be gone after SIGKILL: one frozen in the kernel (a cgroup freezer) is not waited for
MISMATCH_S = 2  # a rank timed out waiting: how long the others get to time out too (then none stopped: a mismatch)
PEER_S = 3  # a rank that failed because another was lost: how long the others get to say they failed first


def slot_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"progress-{rank}")


def first_failure_of(processes: list, folder: str) -> int | None:
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
                if read_slot(slot_path(folder, rank)).state != LOST_PEER:
                    return rank
                if failed is None:
                    failed, deadline = rank, time.monotonic() + PEER_S
        if deadline is not None and not done and time.monotonic() >= deadline:
            break
    return failed


def blame(failed: int, others: dict[int, int], folder: str, world: int = 0) -> tuple[int, str] | None:
    """Where rank `failed` timed out waiting, the rank it waited for among `others` (rank: pid, still
    running), and why: one stopped by a signal (a frozen process); else, where every other rank of the `world`
    timed out waiting too, none: they called different collectives; else the one whose progress is oldest."""
    slot = read_slot(slot_path(folder, failed))
    if slot.state != TIMED_OUT_STATE or not (others or world > 1):
        return None
    stopped = [r for r, pid in sorted(others.items()) if _state(pid) in ("T", "t")]
    if stopped:
        rank, why = stopped[0], "it was stopped by a signal"
    elif world > 1 and (waiting := _waiting_too(failed, world, folder)):
        return failed, (f"rank {failed} timed out waiting for {waiting} after {slot.timeout:g} s, and {waiting} for "
                        f"it: the ranks called different collectives (or the same ones in another order)")
    elif not others:
        return None
    else:
        last = {r: read_slot(slot_path(folder, r)).last for r in others}
        rank = min(last, key=lambda r: (last[r], r))
        why = f"no progress from it for {time.monotonic() - last[rank]:.0f} s" if last[rank] else \
            "it made no progress at all"
    return rank, (f"rank {rank} stopped making progress ({why}; rank {failed} timed out waiting for it after "
                  f"{slot.timeout:g} s)")


def parted(failed: int, codes: dict[int, int | None], folder: str) -> tuple[int, str] | None:
    """Where the ranks parted ways before rank `failed` failed, the rank to name and why: a loader every process
    reads whole that served one rank more batches than another, whose pass had ended (whatever followed: a rank
    left waiting, gloo's abort on mismatched collectives); else a rank that ended well (`codes`: rank: exit code,
    None while running) while `failed` waited for it in a collective (it left early: a sys.exit on one rank)."""
    slots = {rank: read_slot(slot_path(folder, rank)) for rank in sorted(codes)}
    for short, ended in slots.items():
        for more, read in slots.items():
            if ended.passes > read.passes and ended.batches < read.batches:
                return more, (f"rank {more} read {int(read.batches)} batches, rank {short} read "
                              f"{int(ended.batches)} and its loader ended there: a loader that every process reads "
                              f"whole (an IterableDataset, a batch sampler) must serve each process as many batches")
    gone = [rank for rank, code in sorted(codes.items()) if rank != failed and code == 0]
    if gone and read_slot(slot_path(folder, failed)).state in (TIMED_OUT_STATE, LOST_PEER):
        return gone[0], (f"rank {gone[0]} ended (exit code 0) while rank {failed} still waited for it in a "
                         f"collective: every rank must make the same calls between processes before it ends (a "
                         f"sys.exit or a return on one rank only?)")
    return None


def _waiting_too(failed: int, world: int, folder: str) -> str:
    """"rank 1" or "ranks 1 and 2": every rank but `failed`, where each timed out waiting within MISMATCH_S (they
    started to wait about together); "" where one did not (it is the one that stopped making progress)."""
    others = [r for r in range(world) if r != failed]
    deadline = time.monotonic() + MISMATCH_S
    while any(read_slot(slot_path(folder, r)).state != TIMED_OUT_STATE for r in others):
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


def stop(processes: list, signum: int = signal.SIGTERM, grace_s: float = FAILED_GRACE_S, groups: bool = True) -> None:
    """Stop a job's ranks (subprocess.Popen or multiprocessing processes): `signum` to each rank still running,
    SIGCONT to its process group (a rank stopped by Ctrl-Z, and what it started, must wake to act on it); once
    they have ended, or after grace_s, SIGKILL to what is left: with `groups`, each rank's whole process group (the
    processes it started, its DataLoader workers: torchrun ends a rank's group so), else the rank alone. A rank
    that ends on SIGTERM cleans up after itself: nothing it made (its semaphores) is left for the resource tracker
    to warn about."""
    import multiprocessing.process

    alive = [p for p in processes if _running(p)]
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signum)
        to_group(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    for p in alive:
        _wait(p, deadline - time.monotonic())
    for p in processes:
        if groups:
            to_group(p.pid, signal.SIGKILL)
        elif _running(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + KILLED_S
    for rank, p in enumerate(processes):
        if not _wait(p, deadline - time.monotonic()):
            _left_behind(rank, p.pid)
            multiprocessing.process._children.discard(p)  # else Python's exit would wait for it without limit


def to_group(pid: int, signum: int) -> None:
    """`signum` to the process group rank `pid` leads (the rank, and the processes it started that stay in it);
    to the rank alone where it leads none yet (spawn's own set-up); nothing where all of it is gone."""
    with contextlib.suppress(ProcessLookupError):
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            os.kill(pid, signum)


def _running(p) -> bool:
    return p.poll() is None if isinstance(p, subprocess.Popen) else p.is_alive()


def _wait(p, timeout: float) -> bool:
    """Wait up to `timeout` s for a rank to end; whether it has."""
    if isinstance(p, subprocess.Popen):
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, timeout))
    else:
        p.join(max(0.0, timeout))
    return not _running(p)


def what_rank_left(folder: str, rank: int) -> tuple[str, str]:
    """What rank `rank` left in the job's folder of how it failed (progress.tell_launcher): (kind, text), or empty."""
    try:
        with open(os.path.join(folder, f"error-{rank}"), "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return "", ""


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


def _left_behind(rank: int, pid: int) -> None:
    note(f"rank {rank} (pid {pid}) did not end on SIGKILL: it is frozen in the kernel (a cgroup "
         f"freezer?) and ends once thawed; not waiting for it")

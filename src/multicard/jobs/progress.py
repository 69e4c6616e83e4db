"""A rank's progress slot: a small file our launcher makes for each rank, mapped into the rank's memory, where
the rank shows how far it got and how it failed; the launcher reads it to name the rank to blame."""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import re
import stat
import struct
import sys
import time
from collections.abc import Callable, Iterator

from ..errors import UsageError, note
from . import closed, jobdir
from .failures import ERROR_FILE, tell_torchrun
from .lifeline import inherited

PROGRESS = "MULTICARD_PROGRESS"  # our launchers name here the file where a rank shows how far it got
# that file: a mark (only a file our launcher made is written to), last progress (time.monotonic()), the timeout,
# and how the rank failed (0, TIMED_OUT_STATE or LOST_PEER)
SLOT = struct.Struct("8s3d")
# after it, what the rank read from loaders every process reads whole: batches served, passes that ended (a rank whose
# pass ended before another's is named with both counts, rather than the rank left waiting)
READS = struct.Struct("2d")
MARK = b"mcslot1\n"
# how a wait that ran out of time reads: gloo's, the store's, NCCL's watchdog (and our rendezvous sets it itself)
TIMED_OUT = re.compile(r"Timed out waiting|wait timeout after|collective operation timeout|Socket Timeout")
# how a wait reads that ended because another process went away (gloo, the store, NCCL): not the cause
LOST = re.compile(r"[Cc]onnection (closed|reset) by peer|Broken pipe|ECONNRESET|EPIPE|remote process exit")
TIMED_OUT_STATE, LOST_PEER = 1.0, 2.0  # what the slot's last number says of how a rank failed

_slot: memoryview | list[float] | None = None
_hooked = False  # whether this rank's failures are told to its launcher (hook_failures)
_explainers: list[Callable[[BaseException], BaseException | None]] = []  # the upper layers' one-line readings


def progress() -> None:
    """Say that this process moved on (a batch was served). Cheap enough for every batch: one store into
    memory shared with the launcher (nothing at all leaves the process outside a job multicard started).
    When a rank times out waiting for another, our launcher names the rank that stopped making progress."""
    (_slot if _slot is not None else progress_slot())[0] = time.monotonic()


def read_batch() -> None:
    """A loader that every process reads whole served this process a batch (one store, as progress())."""
    (_slot if _slot is not None else progress_slot())[3] += 1


def pass_ended() -> None:
    """And its pass ended here: every process must have been served as many batches by then."""
    progress_slot()[4] += 1


@contextlib.contextmanager
def watched() -> Iterator[None]:
    """Around a collective of the user's: a wait that ran out of time (or lost another process) is told to the
    launcher as it happens, even where the user's code catches it and ends otherwise."""
    try:
        yield
    except Exception as e:
        failed(e)
        raise


def failed(error: BaseException) -> None:
    """A rank ends with `error`: when it is a wait that ran out of time, or one that lost another process, tell
    the launcher (which then looks for the cause elsewhere)."""
    if TIMED_OUT.search(str(error)):
        slot_timed_out()
    elif LOST.search(str(error)):
        progress_slot()[2] = LOST_PEER


def explain_with(fn: Callable[[BaseException], BaseException | None]) -> None:
    """fn(error): a UsageError saying in one line why `error` (torch's) ended the rank, or None. Tried on every
    error that ends a rank of a job our launcher started (a script's, or fn's under launch)."""
    if fn not in _explainers:
        _explainers.append(fn)


def explained(error: BaseException) -> BaseException:
    """The one-line UsageError an explainer reads `error` as, or `error` itself."""
    for fn in _explainers:
        said = fn(error)
        if said is not None:
            return said
    return error


@contextlib.contextmanager
def plainly() -> Iterator[None]:
    """Around work whose error ends the caller (launch's fn in this process): an error an explainer reads is
    raised as its one line instead."""
    try:
        yield
    except Exception as error:
        said = explained(error)
        if said is error:
            raise
        raise said from None


def lost_peer(error: BaseException) -> bool:
    return bool(LOST.search(str(error))) and not TIMED_OUT.search(str(error))


def by_closed_stdout(error: BaseException) -> bool:
    """Whether a rank ending with `error` ends because its stdout was closed (`| head`): a BrokenPipeError of its
    own print, or another rank lost (which ended so), while stdout is a pipe nobody reads."""
    return (isinstance(error, BrokenPipeError) or lost_peer(error)) and closed.stdout_closed()


def hook_failures() -> None:
    """In a rank of a job our launcher started, an error that ends it is told to the launcher, which says once
    what went wrong: a timeout (it names the rank waited for), a bad input (one line, not a traceback per rank),
    another rank lost (that rank is the one to name: here, one line instead of gloo's traceback). Under torchrun,
    a rank's one line also goes where torchrun's summary reads it (failures.tell_torchrun); Python prints as ever."""
    global _hooked
    ours = isinstance(progress_slot(), memoryview)
    if _hooked or not (ours or os.environ.get(ERROR_FILE)):
        return
    _hooked, previous = True, sys.excepthook

    def hook(kind, error, trace):
        said = explained(error)
        tell_torchrun(said)
        if not ours:
            previous(kind, error, trace)
            return
        error = said
        failed(error)
        if by_closed_stdout(error):
            closed.end_by_sigpipe()
        if isinstance(error, UsageError):
            tell_launcher("usage", str(error))
        elif lost_peer(error):  # the launcher says it where no other rank's failure is the one to name
            lost = LOST.search(str(error)).group()
            tell_launcher("lost", f"rank {os.environ.get('RANK')} lost another rank ({lost})")
        else:
            previous(kind, error, trace)

    sys.excepthook = hook


def tell_launcher(kind: str, text: str) -> None:
    """Leave in the job's folder how this rank failed ("usage", "said", "trace" or "lost"), for our launcher to
    say. Where the folder takes nothing more (a disk filled by another), the rank says it on stderr itself: the
    launcher then names the rank, and says its output is above."""
    path = os.path.join(os.path.dirname(os.environ[PROGRESS]), f"error-{os.environ.get('RANK', '0')}")
    try:
        with open(path, "wb") as f:
            pickle.dump((kind, text), f)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(path)  # half a pickle would be read as nothing said
        if kind == "trace":  # the traceback, as Python would have printed it
            print(text, end="", file=sys.stderr, flush=True)
        else:  # "said" and "lost" name the rank already
            note(f"rank {os.environ.get('RANK', '0')}: {text}" if kind == "usage" else text)


def slot_timed_out() -> None:
    progress_slot()[2] = TIMED_OUT_STATE


def progress_slot() -> memoryview | list[float]:
    """This rank's slot in the file our launcher made (MULTICARD_PROGRESS), mapped into memory; a plain list
    (read by nobody) in any other process, and where the variable names a file that is not such a slot: the
    variable alone never makes this process write into a file."""
    global _slot
    if _slot is None:
        path = os.environ.get(PROGRESS)
        slot = _map_slot(path) if path and not inherited() else [0.0] * 5
        if slot is None:
            note(f"{PROGRESS}={path} is not a progress file a multicard launcher made; ignored")
        _slot = [0.0] * 5 if slot is None else slot
    return _slot


def _map_slot(path: str) -> memoryview | None:
    """The slot's numbers in `path`, mapped: only a plain file of this user's, of the slot's size, that starts
    with the mark (no link followed); None for anything else."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != SLOT.size + READS.size or info.st_uid != os.getuid() or \
                os.pread(fd, len(MARK), 0) != MARK:
            return None
        return memoryview(mmap.mmap(fd, SLOT.size + READS.size))[len(MARK):].cast("d")
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def new_slot(path: str) -> None:
    """For the launcher: the empty progress file of one rank (the mark, then zeros: no progress yet). Written
    whole (never a sparse file), so that no write to its mapping can meet a full disk."""
    try:
        with open(path, "xb") as f:
            f.write(SLOT.pack(MARK, 0.0, 0.0, 0.0) + READS.pack(0.0, 0.0))
    except OSError as e:  # the job's folder goes with everything in it
        raise UsageError(f"cannot start the job: its ranks' progress files could not be written into the job's "
                         f"folder in {os.path.dirname(os.path.dirname(path))}: {jobdir.cause(e)}; "
                         f"{jobdir.remedy(e)}") from None


def read_slot(path: str) -> tuple[float, float, float]:
    """For the launcher: (last progress, the rank's timeout, how it failed: 0, TIMED_OUT_STATE or LOST_PEER);
    zeros if unreadable."""
    try:
        with open(path, "rb") as f:
            _, last, timeout, state = SLOT.unpack(f.read(SLOT.size))
    except (OSError, struct.error):
        return 0.0, 0.0, 0.0
    return last, timeout, state


def read_reads(path: str) -> tuple[int, int]:
    """For the launcher: (batches served, passes ended) of the loaders the rank read whole; zeros if unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(SLOT.size)
            batches, passes = READS.unpack(f.read(READS.size))
    except (OSError, struct.error):
        return 0, 0
    return int(batches), int(passes)

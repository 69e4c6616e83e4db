"""A rank's progress slot: a small file our launcher makes for each rank, mapped into the rank's memory, where
the rank shows how far it got and how it failed; the launcher reads it to name the rank to blame. Its fields, and
the file's layout: protocol.py."""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import re
import sys
import time
from collections.abc import Iterator

from ..errors import UsageError, note
from . import broken_pipe, failures, jobdir, protocol
from .failures import tell_torchrun
from .launcher_watch import inherited
from .protocol import LOST_PEER, PROGRESS, TIMED_OUT_STATE, Slot

# how a wait that ran out of time reads: gloo's, the store's, NCCL's watchdog (and our rendezvous sets it itself)
TIMED_OUT = re.compile(r"Timed out waiting|wait timeout after|collective operation timeout|Socket Timeout")
# how a wait reads that ended because another process went away (gloo, the store, NCCL): not the cause
LOST = re.compile(r"[Cc]onnection (closed|reset) by peer|Broken pipe|ECONNRESET|EPIPE|remote process exit")

# the jobs open in this process (yourloop/job_state.py's JobState), newest last: module level, as the process's
# excepthook and torch's step hooks (process-wide) must reach them; each reads an error in one line (`explain`)
_open: list = []


def progress() -> None:
    """Say that this process moved on (a batch was served). Cheap enough for every batch: one store into
    memory shared with the launcher (nothing at all leaves the process outside a job multicard started).
    When a rank times out waiting for another, our launcher names the rank that stopped making progress."""
    progress_slot().last = time.monotonic()


def read_batch() -> None:
    """A loader that every process reads whole served this process a batch (one store, as progress())."""
    progress_slot().batches += 1


def pass_ended() -> None:
    """And its pass ended here: every process must have been served as many batches by then."""
    progress_slot().passes += 1


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
        progress_slot().state = LOST_PEER


def job_opened(job: object) -> None:
    """A job joined in this process: job.explain(error), a UsageError saying in one line why `error` (torch's)
    ends the process, or None, is tried on every error that ends it (a script's, or fn's under launch)."""
    if not any(job is j for j in _open):
        _open.append(job)


def job_closed(job: object) -> None:
    if any(job is j for j in _open):
        _open.remove(job)


def open_jobs() -> tuple:
    return tuple(_open)


def explained(error: BaseException) -> BaseException:
    """The one-line UsageError an explainer reads `error` as, or `error` itself."""
    for job in reversed(_open):
        said = job.explain(error)
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
    return (isinstance(error, BrokenPipeError) or lost_peer(error)) and broken_pipe.stdout_closed()


def hook_failures() -> None:
    """multicard's one sys.excepthook, put in front of the one found, once per process (it marks itself). An
    error that reaches the top of the program is first read by the jobs open in it (one line for torch's error,
    or a note under its message); a Stopped ends the process as its signal would (failures.end_as_signal). In a
    rank of a job our launcher started, how it failed is told to the launcher, which says once what went wrong: a
    timeout (it names the rank waited for), a bad input (one line, not a traceback per rank), another rank lost
    (that rank is the one to name: one line instead of gloo's traceback). Under torchrun, a rank's one line also goes
    where torchrun's summary reads it (failures.tell_torchrun). Anything else: the hook found before."""
    previous = sys.excepthook
    if getattr(previous, "multicard", False):
        return

    def hook(kind, error, trace):
        if isinstance(error, failures.Stopped):
            failures.end_as_signal(error)
            return
        said = explained(error)
        tell_torchrun(said)
        if said is not error:
            kind, error, trace = type(said), said, None
        if not progress_slot().mapped:
            previous(kind, error, trace)
            return
        failed(error)
        if by_closed_stdout(error):
            broken_pipe.end_by_sigpipe()
        if isinstance(error, UsageError):
            tell_launcher("usage", str(error))
        elif lost_peer(error):  # the launcher says it where no other rank's failure is the one to name
            lost = LOST.search(str(error)).group()
            tell_launcher("lost", f"rank {os.environ.get('RANK')} lost another rank ({lost})")
        else:
            previous(kind, error, trace)

    hook.multicard = True
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
    progress_slot().state = TIMED_OUT_STATE


@functools.cache  # mapped once a process, on first use: the file the launcher named it for its life
def progress_slot() -> Slot:
    """This rank's slot in the file our launcher made (PROGRESS names it), mapped into memory; plain numbers (read
    by nobody) in any other process, and where the variable names a file that is not such a slot: the variable
    alone never makes this process write into a file."""
    path = os.environ.get(PROGRESS)
    slot = protocol.mapped(path) if path and not inherited() else Slot()
    if slot is None:
        note(f"{PROGRESS}={path} is not a progress file a multicard launcher made; ignored")
    return Slot() if slot is None else slot


def new_slot(path: str) -> None:
    """For the launcher: the empty progress file of one rank (the mark, then zeros: no progress yet). Written
    whole (never a sparse file), so that no write to its mapping can meet a full disk."""
    try:
        with open(path, "xb") as f:
            f.write(Slot().packed())
    except OSError as e:  # the job's folder goes with everything in it
        raise UsageError(f"cannot start the job: its ranks' progress files could not be written into the job's "
                         f"folder in {os.path.dirname(os.path.dirname(path))}: {jobdir.cause(e)}; "
                         f"{jobdir.remedy(e)}") from None

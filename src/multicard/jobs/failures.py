"""How a job ended badly, as the caller sees it: RankFailed (a rank failed: its traceback, or a sentence naming
it) and Stopped (a signal to the launcher stopped the job). In a notebook each shows briefly (_render_traceback_).
Under torchrun, a rank's one line goes where torchrun's summary reads how the rank failed (tell_torchrun).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import time

from ..errors import UsageError, note

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # torchrun's agent names here the file it reads when this rank fails


class RankFailed(Exception):
    """Rank `rank` of a job failed: `trace` is its traceback, or, where there is none to show, a sentence
    that starts with "rank N " (it was interrupted, it stopped making progress, it ended with a signal).
    `meant`: someone stopped that rank on purpose (SIGINT or SIGTERM to it alone), so it is not restarted."""

    def __init__(self, rank: int, trace: str, meant: bool = False):
        super().__init__(trace if said(rank, trace) else f"rank {rank} failed:\n{trace}")
        self.rank, self.trace, self.meant = rank, trace, meant

    def __reduce__(self):
        return RankFailed, (self.rank, self.trace, self.meant)

    def _render_traceback_(self) -> list[str]:
        """What IPython (a notebook) shows: the rank's own traceback once, then one line naming the rank (not
        the launcher's frames, nor the traceback again inside the message)."""
        if said(self.rank, self.trace):
            return [f"RankFailed: {self.trace.rstrip()}"]
        return [*self.trace.rstrip().splitlines(), f"RankFailed: rank {self.rank} failed (its traceback is above); "
                                                   f"every other rank was stopped"]


def said(rank: int, trace: str) -> bool:
    """Whether a RankFailed's trace is a sentence about the rank rather than a traceback."""
    return trace.startswith(f"rank {rank} ")


class Stopped(BaseException):
    """A signal to the launcher (SIGINT, SIGTERM, SIGHUP) stopped the job. A BaseException, as
    KeyboardInterrupt is: no `except Exception` (a retry loop, a user's handler) takes it for a failure."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for a kernel interrupt (the stop button) during a launch: one line."""
        return [f"Stopped: stopped by {self}; every rank was stopped"]


def end_as_signal(error: Stopped) -> None:
    """A Stopped that reached the top of the program uncaught (a script that calls launch or train) ends it as the
    signal would have: one line instead of a traceback, the exit handlers run, then the signal's own exit status
    (a shell shows 128+N), as Python ends on a Ctrl-C (progress.py's excepthook calls it)."""
    if error.signum != signal.SIGPIPE:  # a closed stdout (`| head`) ends a program without a word
        note(f"stopped by {error}; every rank was stopped")
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a stream closed or gone: nothing left to show
            stream.flush()
    signal.signal(error.signum, signal.SIG_DFL)
    os.kill(os.getpid(), error.signum)


def tell_torchrun(error: BaseException) -> None:
    """A rank torchrun started ends with one line (`error`, a UsageError: bad input, or an error multicard read as
    one): the line goes into the rank's error file, written as torch's ErrorHandler writes one (JSON), so that
    torchrun's summary shows it as the root cause instead of "To enable traceback see: ...". Called from the hook
    that sees the rank's uncaught error; nothing happens outside torchrun or for any other error."""
    path = os.environ.get(ERROR_FILE)
    if not path or not isinstance(error, UsageError):
        return
    line = f"{type(error).__name__}: {error}"  # shown as the failure's "traceback"
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError), open(path, "w") as f:  # (torch's own writer ignores a failure too)
        json.dump(data, f)

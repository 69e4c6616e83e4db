"""A job whose stdout was closed under it (`multicard run script.py | head -2`): it ends as other command-line
tools end there, quietly and by SIGPIPE (a shell shows 141), its ranks with it; no traceback, no line blaming a
rank for "losing" another.

Python ignores SIGPIPE, so a write into a pipe nobody reads raises BrokenPipeError in the rank that printed; the
other ranks then lose it. A rank that ends with either while its stdout is such a pipe ends by SIGPIPE, and the
launcher, seeing its rank end so, stops the rest and ends the same way.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys

SIGPIPE_EXIT = 128 + signal.SIGPIPE  # how a shell shows a process SIGPIPE ended


def stdout_closed() -> bool:
    """Whether this process's stdout is a pipe whose reading end is gone (poll says POLLERR for it)."""
    try:
        poller = select.poll()
        poller.register(1, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, AttributeError):  # no fd 1, or no poll() on this system
        return False


def by_pipe(code: int | None) -> bool:
    """Whether an exit status `code` (subprocess's: -N for signal N; or 128 + N) is SIGPIPE's."""
    return code in (-signal.SIGPIPE, SIGPIPE_EXIT)


def end_by_sigpipe() -> None:
    """End this process now, as a write into a closed pipe ends a C program: by SIGPIPE, saying nothing. What is
    still buffered for stdout goes nowhere (Python would otherwise complain as it exits)."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)
    os._exit(SIGPIPE_EXIT)  # where the signal could not end it


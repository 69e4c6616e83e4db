"""torch's C++ log, kept off the user's screen while the store is tried: a store that cannot be reached logs each
retry as a warning with a page of C++ frames (84 lines before our one line, on an unreachable MASTER_ADDR), and
TORCH_CPP_LOG_LEVEL is read once, as torch loads, so it cannot be set for one call."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

# what c10's log writes: "[W1125 12:13:37.384089179 TCPStore.cpp:340] ...", then the frames of its exception
CPP_LOG = re.compile(r"\[[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ |Exception raised from |frame #\d+: |<omitting python frames>")


@contextlib.contextmanager
def cpp_log_hidden() -> Iterator[None]:
    """While inside, what reaches this process's stderr (file descriptor 2, where C++ writes) is held, and on the
    way out everything but the C++ log is written out as it came."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all (closed by a daemon): nothing to keep off it
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if line.strip() and not CPP_LOG.match(line)]  # its entries end with a blank line
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()

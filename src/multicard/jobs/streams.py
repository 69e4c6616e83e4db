"""What the processes of a job print, shown where this process's own print shows.

The processes write to file descriptors 1 and 2, which they share with this process. In a terminal that is
where sys.stdout goes; in a Jupyter kernel it is not (sys.stdout is the kernel's stream to the notebook, and
what reaches fd 1 never shows in the cell). There, each process's stdout and stderr come back through a pipe,
and a thread here writes them to sys.stdout and sys.stderr as they arrive: whole lines (or progress bars'
"\r" lines), in order for each process.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import sys
import threading
import time
from typing import Any

FINISH_S = 2.0  # once the processes ended: how long what they printed last may take to arrive


def relayed(stream: Any, fd: int) -> bool:
    """Whether output written to `fd` would not show where `stream` shows (a notebook's cell; a capture)."""
    if stream is None:
        return False
    try:
        return stream.fileno() != fd
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: a stream with no descriptor
        return True


class Relay:
    """The pipes of a job's processes, for those of fds 1 and 2 that do not show where this process's print
    shows; nothing at all in a terminal."""

    def __init__(self, context: Any):
        self.context = context
        self.targets = {fd: name for fd, name in ((1, "stdout"), (2, "stderr"))
                        if relayed(getattr(sys, name), fd)}
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.writers: list[Any] = []  # the write ends given to processes (closed here once each has started)

    def ends(self) -> list[tuple[int, Any]]:
        """For one process, before it starts: (fd, write end) for each stream relayed; a thread reads the
        other end from now on."""
        given = []
        for fd, name in self.targets.items():
            reader, writer = self.context.Pipe(duplex=False)
            self.writers.append(writer)
            thread = threading.Thread(target=self._pump, args=(reader, getattr(sys, name)), daemon=True,
                                      name=f"multicard relay {name}")
            thread.start()
            self.threads.append(thread)
            given.append((fd, writer))
        return given

    def started(self, given: list[tuple[int, Any]]) -> None:
        """The process that took `given` has started: this process lets go of the write ends (the pipe ends
        when the process, and anything it started, has ended)."""
        for _, writer in given:
            writer.close()

    def finish(self) -> None:
        """Wait (a bounded time) until what the ended processes printed has been written here."""
        deadline = time.monotonic() + FINISH_S
        for writer in self.writers:  # those of a process that never started
            writer.close()
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _pump(self, reader: Any, out: Any) -> None:
        """Whole lines from `reader` to `out`. Only what arrived is looked at for a line end: a long line without
        one (16 MB) is gathered in pieces, not looked through again with each piece (the time would grow with its
        square, and the rank that wrote it would wait on a full pipe, taken for a rank that stopped)."""
        decoder, pending = codecs.getincrementaldecoder("utf-8")("replace"), []  # pending: a line not ended yet
        fd = reader.fileno()
        try:
            while chunk := os.read(fd, 1 << 16):
                text = decoder.decode(chunk)
                end = max(text.rfind("\n"), text.rfind("\r")) + 1  # a progress bar ends its lines with "\r"
                if end:
                    self._write(out, "".join([*pending, text[:end]]))
                    pending = []
                pending.append(text[end:])
        except OSError:
            pass
        finally:
            self._write(out, "".join(pending) + decoder.decode(b"", final=True))
            reader.close()

    def _write(self, out: Any, text: str) -> None:
        if text:
            with self.lock, contextlib.suppress(Exception):  # a stream closed meanwhile: lose the output, not the job
                out.write(text)
                out.flush()


def take(given: list[tuple[int, Any]]) -> None:
    """In a started process, first thing: its fds 1 and 2 (where relayed) become the pipes to its launcher, and
    its print writes through line by line (a pipe would otherwise hold the lines back until it ends)."""
    for fd, writer in given:
        stream = sys.stdout if fd == 1 else sys.stderr
        with contextlib.suppress(Exception):
            stream.flush()
        os.dup2(writer.fileno(), fd)
        writer.close()
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=True)

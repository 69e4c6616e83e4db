"""mc.stop_requested: the cluster asks a job to stop (SIGTERM, or SLURM's `--signal=USR1@90`), and every rank
learns it at the same step, so that all of them save the same checkpoint and leave together.

A rank that saves and leaves alone leaves the others waiting in its next collective (a DDP backward, a save's
barrier) until the timeout, and its checkpoint holds none of their parts. So a signal is only recorded here, and
the ranks agree on it where they meet: every rank reads at the same points (once per optimizer step), so the n-th
read is the same moment of the job on every rank, and at some of them, agreed at the meeting before, they meet
in one all-reduce of two numbers: the first signal each recorded (0: none; the max wins) and how many reads each
would let pass before the next meeting (about MEET_S seconds of its reads, and no more than it has read so far:
reads 1, 2, 4, 8, ... meet, until a second's worth is more; the fewest wins). The reads between
cost nothing (a step of the main job on 2 CPU processes lost 5-10% to an all-reduce at every read), and a stop is
agreed about MEET_S seconds after the signal at most. Once agreed, every read says True without a collective.

The handlers are installed at the first read, in the main thread (the only one Python lets set them), and
recorded on the object (never a module global: two Multicards, one closed, do not share a stop); close() puts
the previous ones back. Until the first read nothing changes: a script that never asks is stopped by these
signals as before. A signal the process was started to ignore stays ignored. Two Multicards that both read it
(one in train(), one in evaluate()) both learn of a signal: the later one's handler passes it on to the earlier
one's, and whichever closes last puts back what was there before either.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import torch

from ..errors import UsageError
from ..jobs.progress import watched

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
MEET_S = 1.0  # about how often the ranks meet to agree on a stop: far within a cluster's warning and the stop grace
MOST_READS = 10_000  # reads between two meetings at the most (a loop of very short steps still meets often)


class Stops:
    """The stop signals one Multicard recorded, what its ranks agreed, and the handlers its own replaced."""

    def __init__(self) -> None:
        self.got = 0  # the first stop signal this process recorded (0: none)
        self.agreed = 0  # the signal every rank agreed on (0: no stop yet)
        self.previous: dict[int, Any] = {}  # signal -> the handler ours replaced
        self.installed = self.closed = False
        self.handler = self.record  # one bound method: getsignal hands back this very object
        self.reads = 0  # how often this process read stop_requested (alike on every rank)
        self.meet = 1  # the read at which the ranks meet next (agreed at the meeting before)
        self.met: tuple[int, float] | None = None  # the read and the time of the last meeting

    def record(self, signum: int, frame: Any) -> None:
        """The handler: note the signal, nothing else (the loop acts on it at its next read)."""
        if not self.got:
            self.got = signum
        if ours(before := self.previous.get(signum)):  # another Multicard's, installed before this one's
            before(signum, frame)

    def install(self) -> None:
        if self.installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise UsageError("mc.stop_requested: read it first in the main thread (only there can Python set the "
                             "handlers of SIGTERM and SIGUSR1)")
        for s in SIGNALS:
            if signal.getsignal(s) is not signal.SIG_IGN:
                self.previous[s] = signal.signal(s, self.handler)
        self.installed = True

    def requested(self, strategy: Any) -> bool:
        """Whether a stop is agreed: on 2+ processes a collective every rank must reach at the same point."""
        self.install()
        if self.agreed:
            return True
        self.reads += 1
        if strategy.world == 1:
            self.agreed = self.got
        elif self.reads >= self.meet:
            now = time.monotonic()  # the reads of about MEET_S, and no more than so far: a short run meets too
            per_s = 0 if self.met is None else (self.reads - self.met[0]) / max(now - self.met[1], 1e-6)
            spacing = max(1, min(self.reads, MOST_READS, int(per_s * MEET_S)))
            said = torch.tensor([self.got, -spacing], dtype=torch.int64, device=strategy.device)
            with watched():  # a rank that never reads it is named once the timeout runs out
                got, fewest = strategy.all_reduce(said, "max").tolist()
            self.agreed, self.meet, self.met = got, self.reads - fewest, (self.reads, now)
        return bool(self.agreed)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.agreed).name if self.agreed else None

    def restore(self) -> None:
        """The handlers ours replaced, back (only where ours is still the one set; only the main thread can); where
        that is the handler of another Multicard closed already, what that one replaced."""
        self.closed = True
        if not self.previous or threading.current_thread() is not threading.main_thread():
            return
        for s, handler in self.previous.items():
            if signal.getsignal(s) is self.handler:
                while ours(handler) and handler.__self__.closed:
                    handler = handler.__self__.previous.get(s, signal.SIG_DFL)
                signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: set outside Python


def ours(handler: Any) -> bool:
    """Whether a signal handler is a Stops' recorder."""
    return getattr(handler, "__func__", None) is Stops.record


class Stopping:
    """Methods of Multicard: a stop every rank agrees on (uses its _start(), _stops and _strategy)."""

    @property
    def stop_requested(self) -> bool:
        """Whether the job was told to stop: True on every rank at the same read once any rank got SIGTERM or
        SIGUSR1 (SLURM's `--signal=USR1@90`), so that all save the same checkpoint and leave together.

        The first read installs handlers for SIGTERM and SIGUSR1 (in the main thread) that only record the signal
        on this object; before it they stop the process as they did; close() puts the previous handlers back. On
        2+ processes every rank must read it at the same points, e.g. once per optimizer step, after
        optimizer.step(): about once a second, at a read they agreed on, they meet in one small all-reduce, and the
        reads between cost nothing; a stop is agreed within about a second of the signal (stopping.py). The loop
        then saves (mc.save, every rank) and ends; `mc.stop_signal` names the signal."""
        self._start()
        return self._stops.requested(self._strategy)

    @property
    def stop_signal(self) -> str | None:
        """The signal of the stop the ranks agreed on ("SIGTERM" or "SIGUSR1"; the highest number where ranks got
        different ones), or None while mc.stop_requested has said False. No collective."""
        return self._stops.name

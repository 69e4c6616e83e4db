"""The body of a process that multicard.launch spawned: fn(*args), and what became of it left in the job's folder
for the launcher (rank 0's return value, or how the rank failed), so that the launcher says what went wrong once.

A rank is quiet where a line is due: a Ctrl-C while it still imports torch (the launcher starts it with SIGINT
blocked, and the launcher, which got the Ctrl-C too, says the one line), a return value that cannot be sent back,
a thread fn left running, a script that runs the launch again as each rank starts (no `__main__` guard).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import pickle
import signal
import sys
import tempfile
import threading
import traceback
import zipfile
from collections.abc import Callable
from typing import Any

from ..errors import UsageError, note
from . import broken_pipe, jobdir, launcher_watch, progress, shipping, streams
from .dist import listed
from .failures import Stopped

UNGUARDED = 86  # how a rank ends that met the launch again as it started (spawn runs the script's top level)
WORK = "work"  # the file in the job's folder holding fn and its arguments, pickled
THREADS_S = 120.0  # how long threads fn left running may take to end, where the job set no timeout


def end_if_started_again() -> None:
    """In a rank still starting (spawn runs the script's top level again, as `__mp_main__`), a launch means the
    script has no `if __name__ == "__main__":` guard: end at once, quietly, for the launcher to say so
    (multiprocessing would refuse with a page of traceback per rank)."""
    import multiprocessing

    me = multiprocessing.current_process()
    if getattr(me, "_inheriting", False) and me.name.startswith("multicard rank "):
        sys.exit(UNGUARDED)


def unguarded() -> str:
    """What the launcher says when its ranks ended with UNGUARDED."""
    script = os.path.basename(getattr(sys.modules.get("__main__"), "__file__", None) or "the script")
    return (f"{script} calls multicard.launch (or train) at its top level, which every process it starts runs again: "
            f"put that call under `if __name__ == \"__main__\":`")


def body(rank: int, folder: str, launcher: int, env: dict[str, str], ends: list = ()) -> None:
    """fn(*args) (pickled in the job's `folder`, file WORK) as rank `rank`; `env`: the job's variables; `ends`: the
    pipes its stdout and stderr go to, where the launcher shows them itself (a notebook)."""
    launcher_watch.die_with(launcher)  # first: a launcher gone already, or going later, takes this process along
    os.setsid()  # a session of its own, as run's ranks have: see launcher.py
    streams.take(ends)
    os.environ.update(env)
    try:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # stopped as by Ctrl-C: its cleanup runs
            if signal.getsignal(s) is not signal.SIG_IGN:
                signal.signal(s, _raise_stopped)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a Ctrl-C held since the start arrives now
        with open(os.path.join(folder, WORK), "rb") as f:
            fn, args = _unpickled(f.read(), rank)
        shipping.workers_by_fork()
        out = fn(*args)
        if _signalled:  # raised where Python swallows exceptions (a __del__, a callback): the job still fails
            raise KeyboardInterrupt if _signalled[0] == signal.SIGINT else Stopped(_signalled[0])
        if rank == 0:
            _send(out, folder)
    except KeyboardInterrupt:  # SIGINT to this process alone: the job fails, naming it (never an exit 0)
        _fail("said", f"rank {rank} was interrupted (SIGINT)")
    except Stopped as e:
        _fail("said", f"rank {rank} was stopped by {e}")
    except UsageError as e:  # a bad input that only a process could see: one line, as anywhere else
        _fail("usage", str(e))
    except Exception as e:
        said = progress.explained(e)  # torch's error, read in one line where an upper layer knows it
        if isinstance(said, UsageError):
            _fail("usage", str(said))
        progress.failed(e)
        if progress.by_closed_stdout(e):  # `| head` read what it wanted: this rank ends as a command-line tool would
            broken_pipe.end_by_sigpipe()
        _fail("trace", traceback.format_exc())
    _end_after_threads(rank)


def _send(out: Any, folder: str) -> None:
    """Rank 0's return value into the job's folder (an instance of a class a notebook defined comes back as one).
    One that cannot be pickled is one line naming the part that cannot; what fn did stays done."""
    try:
        data = shipping.dumps(out)
    except Exception as e:  # pickling fails with many kinds: TypeError, PicklingError, AttributeError, ...
        raise UsageError(shipping.return_refused(out, e)) from None
    jobdir.write(os.path.join(folder, "result"), data, "the job ran, but fn's return value on rank 0 could not be "
                 "handed back: it", ", or return less (save a large result to a file in fn, and return its path); "
                 "what fn did (its files) is kept")


def _unpickled(work: bytes, rank: int) -> tuple[Callable, tuple]:
    """fn and its arguments. The modules they come from are imported here as modules: with no command line (the
    launcher's flags are not theirs: a top-level argparse would refuse them), and one that ends the program when
    imported fails the job in a line."""
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        return pickle.loads(work)
    except SystemExit as e:
        _fail("usage", f"importing what rank {rank} runs ended the program (exit {e.code}): a module "
                       f"that runs a script at import? put that under `if __name__ == \"__main__\":`")
    finally:
        sys.argv = argv


# the signals this spawned process got (SIGINT, SIGTERM or SIGHUP): module level, as a signal handler writes it
_signalled: list[int] = []


def _raise_stopped(signum: int, frame: Any) -> None:
    _signalled.append(signum)
    if len(_signalled) > 1:  # a second signal (SIGHUP to the group, then SIGTERM from the launcher): the cleanup
        return  # the first began goes on (the launcher's SIGKILL still bounds it)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signum)


def _ending() -> None:
    """From here on this rank ends: a stop signal (the launcher stopping the job as this rank ends already, another
    rank having failed) is noted and lets the ending go on, quietly (the launcher's SIGKILL still bounds it), where
    a Stopped raised in its exit handlers would print a traceback."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) is _raise_stopped:
            signal.signal(s, lambda signum, frame: _signalled.append(signum))


def _fail(kind: str, text: str) -> None:
    _ending()
    progress.tell_launcher(kind, text)
    _end(1)  # threads fn left running are not waited for: the launcher learns of the failure once this rank ended


def _end(code: int) -> None:
    """End this rank as the interpreter's teardown would end it, for what the script sees: multiprocessing's
    finalizers, the exit handlers, then what fn left open finished (finish_left_open: an archive gets its end, a
    temporary file is removed) and every stream flushed; then os._exit, not the teardown itself. There a thread
    still in torch's C++ code (a gloo worker dropping a finished collective's tensors, a daemon thread mid-op)
    takes the GIL as the interpreter goes, and the process aborts (SIGABRT, "terminate called without an active
    exception") after fn had succeeded; and it tears down thousands of torch's modules one by one."""
    _ending()
    from multiprocessing import util

    util._exit_function()  # multiprocessing's finalizers (a Queue's last items sent), its children ended
    atexit._run_exitfuncs()  # logging's, tempfile's, the user's own
    _flush()
    finish_left_open()
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)  # what C and C++ code printed (stdio buffers a pipe or a file)


LEFT_OPEN = (io.IOBase, zipfile.ZipFile, tempfile._TemporaryFileWrapper)  # what the teardown finishes as it frees it


def finish_left_open() -> None:
    """Close what the script left open (a module's global, say), as the interpreter's teardown does when it frees
    it: a gzip or zip archive gets its end written, a NamedTemporaryFile is removed, a file is flushed and closed.
    The outermost first (a TextIOWrapper before the gzip file it writes into, that before the file beneath it);
    the process's own streams are only flushed. A thread still writing into one ends quietly. Types are asked with
    type(): isinstance would ask each object its __class__, and some of torch's warn when asked."""
    threading.excepthook = lambda args: None  # a daemon thread writing into a file closed here: this process ends
    own = {id(layer) for s in (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__)
           for layer in (s, getattr(s, "buffer", None), getattr(getattr(s, "buffer", None), "raw", None))}
    left = [o for o in gc.get_objects() if issubclass(type(o), LEFT_OPEN) and id(o) not in own and _open(o)]
    while left:
        ids = {id(o) for o in left}
        inner = {id(r) for o in left for r in _parts(o) if id(r) in ids and r is not o}
        outer = [o for o in left if id(o) not in inner] or left[:1]  # (a cycle: one at a time)
        for o in outer:
            with contextlib.suppress(Exception):
                o.close()
        done = {id(o) for o in outer}
        left = [o for o in left if id(o) not in done and _open(o)]


def _open(o: Any) -> bool:
    with contextlib.suppress(Exception):
        return o.fp is not None if issubclass(type(o), zipfile.ZipFile) else not o.closed
    return False


def _parts(o: Any) -> list:
    """What `o` holds: what the collector sees of it, and its attributes."""
    held = gc.get_referents(o)
    with contextlib.suppress(TypeError):
        held += list(vars(o).values())
    return held


def _running() -> list[threading.Thread]:
    """The threads still running that Python waits for before this process ends (not daemons)."""
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]


def _end_after_threads(rank: int) -> None:
    """fn returned: this rank ends once the threads it left running (not daemons) have, as Python would end it;
    Python would wait for them without limit, and the launch with it. They get the job's timeout (after their exit
    handlers: an idle ThreadPoolExecutor ends at once); then a watch ends this process without those still running,
    naming them."""
    timeout = progress.progress_slot().timeout or THREADS_S

    def end() -> None:
        if left := _running():
            names, several = listed([repr(t.name) for t in left]), len(left) > 1
            note(f"rank {rank}: fn returned, but its thread{'s' * several} {names} still ran {timeout:g} "
                 f"s later (the job's timeout); this rank ended without {'them' if several else 'it'}: join threads "
                 f"before fn returns, or start them with daemon=True")
            sys.stdout.flush()  # what fn printed is not lost with the threads (stderr: note flushed it)
            os._exit(0)

    watch = threading.Timer(timeout, end)
    watch.daemon, watch.name = True, "multicard thread watch"
    watch.start()
    try:
        threading._shutdown()  # as Python's exit: threading's exit handlers (an idle executor's workers end), a join
        _end(0)
    except (KeyboardInterrupt, Stopped):  # stopped while it waited for them: it ends without them, and says so
        _fail("said", f"rank {rank} was stopped by {signal.Signals(_signalled[0]).name} after fn returned, while "
                      f"it waited for the threads fn left running")

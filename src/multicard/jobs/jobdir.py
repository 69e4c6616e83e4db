"""A job's folder on this machine (its ranks' progress slots, how each failed, rank 0's return value), in the
temporary folder, and the folders of launchers that died without removing theirs (SIGKILL, the OOM killer),
removed at the next start.

A folder's name holds its launcher's pid, and the launcher holds a lock on the folder while it runs (flock: the
kernel lets go when the process ends, however it ends). A folder is a dead launcher's when that pid is gone and
the lock can be taken: a live launcher in another pid namespace (a container sharing /tmp) still holds its lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import resource
import shutil
import stat
import tempfile
from collections.abc import Iterator

from ..errors import UsageError

PREFIX = "multicard-job-"
_OURS = re.compile(re.escape(PREFIX) + r"(\d+)-")  # this version's names: earlier ones had no pid, and are left


@contextlib.contextmanager
def job_folder() -> Iterator[str]:
    """A new folder for one job, locked while inside and removed on the way out; dead launchers' folders are
    removed first."""
    clean_stale()
    try:
        folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    except OSError as e:  # a full disk, a temporary folder that is gone or not ours to write
        raise UsageError(f"cannot start the job: its folder could not be made in {tempfile.gettempdir()}: "
                         f"{cause(e)}; {remedy(e)}") from None
    lock = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(lock)


def write(path: str, data: bytes, what: str, then: str = "") -> None:
    """`data` into the file `path` in a job's folder. Where it cannot be written whole (a full disk, the file-size
    limit), the part written is removed (its space is free again, for the rank's word on it) and a UsageError
    says in one line: `what` (a sentence's start that "(N MB pickled)" follows), where, why, what to do (`then`
    adds to that)."""
    try:
        with open(path, "wb") as f:  # closed inside: a disk that fills at the flush is caught too
            f.write(data)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise UsageError(f"{what} ({size(len(data))} pickled) could not be written into the job's folder in "
                         f"{os.path.dirname(os.path.dirname(path))}: {cause(e)}; {remedy(e)}{then}") from None


def size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def cause(error: OSError) -> str:
    """Why a write failed, as the system says it; with the limit, where it is the file-size limit (ulimit -f)."""
    said = os.strerror(error.errno) if error.errno else str(error)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if error.errno == errno.EFBIG and limit != resource.RLIM_INFINITY:
        said += f" (the file-size limit, ulimit -f, is {size(limit)})"
    return said


def remedy(error: OSError) -> str:
    if error.errno == errno.EFBIG:
        return "raise the limit (ulimit -f)"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space there, or set TMPDIR to a folder with room"
    return "set TMPDIR to a folder this user can write to"


def clean_stale(root: str | None = None) -> list[str]:
    """Remove the job folders in `root` (the temporary folder) whose launcher is dead; returns their paths.
    Only folders of ours: a plain folder (never a link) of this user's, named as this version names them."""
    root = root or tempfile.gettempdir()
    try:
        entries = [e for e in os.scandir(root) if _OURS.match(e.name)]
    except OSError:  # no temporary folder to read: nothing of ours there
        return []
    removed = []
    for entry in entries:
        if _stale(entry.path, int(_OURS.match(entry.name).group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)  # works through descriptors: follows no link inside
            removed.append(entry.path)
    return removed


def _stale(path: str, pid: int) -> bool:
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or _alive(pid):
            return False
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live launcher: BlockingIOError
        return os.fstat(fd).st_ino == info.st_ino
    except OSError:
        return False
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has the pid now: taken for alive, the folder left
        pass
    return True

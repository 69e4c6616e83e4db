"""A job's folder on this machine (its ranks' progress slots, how each failed, rank 0's return value), in the
temporary folder, and the folders of launchers that died without removing theirs (SIGKILL, the OOM killer),
removed at the next start.

A folder's name holds its launcher's pid, and the launcher holds a lock on the folder while it runs (flock: the
kernel lets go when the process ends, however it ends). A folder is a dead launcher's when that pid is gone and
the lock can be taken: a live launcher in another pid namespace (a container sharing /tmp) still holds its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator

PREFIX = "multicard-job-"
_OURS = re.compile(re.escape(PREFIX) + r"(\d+)-")  # this version's names: earlier ones had no pid, and are left


@contextlib.contextmanager
def job_folder() -> Iterator[str]:
    """A new folder for one job, locked while inside and removed on the way out; dead launchers' folders are
    removed first."""
    clean_stale()
    folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    lock = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(lock)


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

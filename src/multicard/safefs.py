"""Files in --out read and written without trusting what is already there: another user of the machine (or an
earlier mistake) may have planted a link, a FIFO, a device or a huge file under a name multicard uses.

Rules: never follow a link multicard did not make (lstat, O_NOFOLLOW); open only regular files, without blocking
(O_NONBLOCK: a FIFO would wait forever for a writer); read no more than a file of that kind can hold; create
temporaries under a fresh random name with O_EXCL, so a name planted in advance is never written through.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path

from .errors import UsageError

SMALL = 64 * 1024  # markers and run.json: a few dozen bytes by construction


def kind(path: Path) -> str | None:
    """What is at `path` itself (a link is not followed): "file", "folder", "link", "fifo", ... or None."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "link"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "device"),
                       (stat.S_ISBLK, "device")):
        if test(mode):
            return name
    return "special file"


def is_folder(path: Path) -> bool:
    """A real folder, not a link to one."""
    return kind(path) == "folder"


def read_bytes(path: Path, limit: int, what: str | None = None) -> bytes:
    """The bytes of the regular file at `path`, refused in one line if it is anything else (a link, a FIFO, a
    device, a folder) or larger than `limit`. `what`: how the line names it (default: the path)."""
    what = what or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        found = kind(path)
        if found not in (None, "file"):
            raise UsageError(f"{what}: is a {found}, not a file multicard wrote; move it elsewhere") from None
        raise UsageError(f"{what}: cannot be read ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{what}: is a {kind(path) or 'special file'}, not a file multicard wrote; move it "
                             f"elsewhere")
        if info.st_size > limit:
            raise UsageError(f"{what}: is {info.st_size} bytes, more than the {limit} a file of its kind holds; "
                             f"not multicard's (move it elsewhere)")
        chunks, got = [], 0
        while got <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - got))):
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:  # grew while read
            raise UsageError(f"{what}: more than the {limit} bytes a file of its kind holds; not multicard's")
        return b"".join(chunks)
    except OSError as e:
        raise UsageError(f"{what}: cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)


def temporary_name(stem: str) -> str:
    """A fresh random name beginning with `stem`, as every temporary in --out is named."""
    return f"{stem}.{secrets.token_hex(6)}.part"


def is_temporary(name: str, stem: str) -> bool:
    """Whether `name` is one temporary_name(stem) gives."""
    return re.fullmatch(re.escape(stem) + r"\.[0-9a-f]{12}\.part", name) is not None


def create(folder: Path, stem: str) -> tuple[int, Path]:
    """A new file in `folder` under a fresh random name beginning with `stem`, made here and now (O_EXCL, never
    through a link); mode as this user's umask gives. Returns its descriptor and path."""
    for _ in range(100):
        path = folder / temporary_name(stem)
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"{folder}: no free temporary name")


def write_file(path: Path, data: bytes) -> None:
    """`data` into `path` as one whole: written to a fresh temporary beside it, then renamed over it (a link or
    a file planted at `path` is replaced, never written through)."""
    fd, tmp = create(path.parent, path.name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def make_folder(path: Path, what: str) -> Path:
    """`path` as a real folder: made if missing; a link, a file or anything else there is refused in one line."""
    try:
        path.mkdir()
    except FileExistsError:
        pass
    except OSError as e:
        raise UsageError(f"{what}: cannot be made ({e.strerror})") from None
    found = kind(path)
    if found != "folder":
        raise UsageError(f"{what}: is a {found}, not a folder multicard made; move it elsewhere")
    return path

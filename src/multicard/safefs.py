"""Files in --out read and written without trusting what is already there: another user of the machine (or an
earlier mistake) may have planted a link, a FIFO, a device or a huge file under a name multicard uses.

Rules: never follow a link multicard did not make (lstat, O_NOFOLLOW); open only regular files, without blocking
(O_NONBLOCK: a FIFO would wait forever for a writer); read no more than a file of that kind can hold; create
temporaries under a fresh random name with O_EXCL, so a name planted in advance is never written through.

And against a user who can write where multicard writes, while it writes: a folder multicard makes is held open
(Folder) and written through that descriptor, never again by its name, so renaming it and planting a link in its
place redirects nothing; a folder others could rename things in is refused (trainer/trust.py), as ssh refuses
such a home.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, NamedTuple

from .errors import UsageError

MARK = ".multicard"  # in every folder multicard makes in --out: what proves it may delete it
SMALL = 64 * 1024  # markers and run.json: a few dozen bytes by construction
FOLDER_MODE = 0o755  # a folder multicard makes: nobody else may add, rename or remove in it, whatever the umask
MAGIC = Path("/proc/self/fd")  # Linux: /proc/self/fd/N/name is `name` in the folder descriptor N holds, wherever it is
# descriptor -> the path a held folder is named by in messages: module level, as descriptors are the process's
_shown: dict[int, Path] = {}


def kind(path: Path) -> str | None:
    """What is at `path` itself (a link is not followed): "file", "folder", "link", "fifo", ... or None."""
    try:
        return kind_of(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None


def kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "link"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "device"),
                       (stat.S_ISBLK, "device")):
        if test(mode):
            return name
    return "special file"


def kind_in(fd: int, name: str) -> str | None:
    """kind() of `name` in the folder held as `fd`."""
    try:
        return kind_of(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None


def is_folder(path: Path) -> bool:
    """A real folder, not a link to one."""
    return kind(path) == "folder"


def read_bytes(path: Path, limit: int, what: str | None = None) -> bytes:
    """The bytes of the regular file at `path`, refused in one line if it is anything else (a link, a FIFO, a
    device, a folder) or larger than `limit`. `what`: how the line names it (default: the path)."""
    what = what or str(path)
    fd, size = _open_file(path, what)
    try:
        if size > limit:
            raise UsageError(f"{what}: is {size} bytes, more than the {limit} a file of its kind holds; "
                             f"not multicard's (move it elsewhere)")
        got = _read(fd, limit + 1, what)
        if len(got) > limit:  # grew while read
            raise UsageError(f"{what}: more than the {limit} bytes a file of its kind holds; not multicard's")
        return got
    finally:
        os.close(fd)


def first_bytes(path: Path, n: int, what: str | None = None) -> bytes:
    """At most the first `n` bytes of the regular file at `path`, refused as read_bytes refuses anything else."""
    what = what or str(path)
    fd, _ = _open_file(path, what)
    try:
        return _read(fd, n, what)
    finally:
        os.close(fd)


def _open_file(path: Path, what: str) -> tuple[int, int]:
    """The regular file at `path` opened for reading (never through a link, never blocking on a FIFO), and its
    size; anything else is one line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        found = kind(path)
        if found not in (None, "file"):
            raise UsageError(f"{what}: is a {found}, not a file multicard wrote; move it elsewhere") from None
        raise UsageError(f"{what}: cannot be read ({e.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UsageError(f"{what}: is a {kind_of(info.st_mode)}, not a file multicard wrote; move it elsewhere")
    return fd, info.st_size


def _read(fd: int, most: int, what: str) -> bytes:
    chunks, got = [], 0
    try:
        while got < most and (chunk := os.read(fd, min(1 << 20, most - got))):
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise UsageError(f"{what}: cannot be read ({e.strerror})") from None
    return b"".join(chunks)


def temporary_name(stem: str) -> str:
    """A fresh random name beginning with `stem`, as every temporary in --out is named."""
    return f"{stem}.{secrets.token_hex(6)}.part"


def is_temporary(name: str, stem: str) -> bool:
    """Whether `name` is one temporary_name(stem) gives."""
    return re.fullmatch(re.escape(stem) + r"\.[0-9a-f]{12}\.part", name) is not None


def write_file(path: Path, data: bytes) -> None:
    """`data` into `path` as one whole: written to a fresh temporary beside it, then renamed over it (a link or
    a file planted at `path` is replaced, never written through)."""
    with Folder.open(path.parent) as folder:
        folder.write(path.name, lambda f: f.write(data))


def make_folder(path: Path, what: str) -> Path:
    """`path` as a real folder: made if missing; a link, a file or anything else there is refused in one line."""
    try:
        path.mkdir(FOLDER_MODE)
    except FileExistsError:
        pass
    except OSError as e:
        raise UsageError(f"{what}: cannot be made ({e.strerror})") from None
    found = kind(path)
    if found != "folder":
        raise UsageError(f"{what}: is a {found}, not a folder multicard made; move it elsewhere")
    return path


class Made(NamedTuple):
    """A folder multicard made, as another process of the job finds it again: its path and what it is. Reads as
    its path (run / "model.pt", open(run)) where a caller only names it."""
    path: Path
    dev: int
    ino: int

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def __fspath__(self) -> str:
        return str(self.path)


class Folder:
    """A folder held open. What is written through it lands in that very folder, wherever it has been moved and
    whatever has been put under its name since; `via` names it for an API that takes a path (torch.save's
    callers, DCP, TensorBoard)."""

    def __init__(self, fd: int, shown: Path):
        self.fd, self.shown = fd, Path(shown)
        info = os.fstat(fd)
        self.made = Made(self.shown, info.st_dev, info.st_ino)
        _shown[fd] = self.shown

    @classmethod
    def open(cls, path: Path, what: str | None = None) -> Folder:
        """The folder at `path` as given (links on the way followed: the path is the caller's)."""
        try:
            return cls(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), Path(shown(path)))
        except OSError as e:
            raise UsageError(f"{what or path}: cannot be opened as a folder ({e.strerror})") from None

    @classmethod
    def reopened(cls, made: Made, what: str) -> Folder:
        """In another process: the folder `made` names, only where it is still that one (not a link, not
        another folder put under its name)."""
        try:
            folder = cls(os.open(made.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC), made.path)
        except OSError:
            raise UsageError(replaced(what)) from None
        if folder.made != made:
            folder.close()
            raise UsageError(replaced(what))
        return folder

    @property
    def via(self) -> Path:
        return MAGIC / str(self.fd) if sys.platform.startswith("linux") else self.shown

    def make(self, name: str, what: str) -> Folder:
        """A new folder `name` in this one, made here and now and held: nobody else may write into it. What
        mkdir raises (a name taken, a full disk) is raised."""
        os.mkdir(name, FOLDER_MODE, dir_fd=self.fd)
        return self.take(name, what)

    def take(self, name: str, what: str, ino: int | None = None) -> Folder:
        """The folder `name` in this one, held: a link there is refused, and so is a folder not this user's (or,
        given `ino`, not the one another process made)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            raise UsageError(replaced(what)) from None
        folder = Folder(fd, self.shown / name)
        if os.fstat(fd).st_uid != os.geteuid() or ino not in (None, folder.made.ino):
            folder.close()
            raise UsageError(replaced(what))
        return folder

    def child(self, name: str, what: str, make: bool = False) -> Folder | None:
        """The folder `name` in this one, held (made first where it is missing and `make`; else None then). A
        link, a file or anything else under that name is one line: never followed, never replaced."""
        for attempt in (0, 1):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
                return Folder(fd, self.shown / name)
            except FileNotFoundError:
                if not make or attempt:
                    return None
            except OSError as e:
                found = kind_in(self.fd, name)
                if found not in (None, "folder"):
                    raise UsageError(f"{what}: is a {found}, not a folder multicard made; move it elsewhere") from None
                raise UsageError(f"{what}: cannot be opened as a folder ({e.strerror})") from None
            try:
                os.mkdir(name, FOLDER_MODE, dir_fd=self.fd)
            except FileExistsError:
                pass
            except OSError as e:
                raise UsageError(f"{what}: cannot be made ({e.strerror})") from None
        return None

    def holds(self, name: str, folder: Folder) -> bool:
        """Whether `name` here is still `folder` (not renamed away, nothing put in its place)."""
        try:
            info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == folder.made[1:]

    def write(self, name: str, fill: Callable[[IO[bytes]], object]) -> None:
        """`name` here as one whole: fill(file) writes a fresh temporary (O_EXCL, never through a link), which is
        then renamed over `name` (a link or a file planted there is replaced, never written through)."""
        tmp = temporary_name(name)  # 48 random bits: no name planted in advance is this one
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                fill(f)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            _shown.pop(self.fd, None)
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit its modules may be gone: the system closes it
            self.close()


def marked(folder: Path) -> bool:
    """A real folder (not a link) holding multicard's marker as a regular file (not a link to one)."""
    return is_folder(folder) and kind(folder / MARK) == "file"


def drop_half_marked(folder: Path) -> bool:
    """Remove `folder` if it is a real folder holding nothing but marker temporaries (or nothing): one multicard
    made and was killed in before its marker was in place. Its files one by one, then the folder, empty (what
    anyone puts there meanwhile stops it)."""
    if not is_folder(folder):
        return False
    entries = list(folder.iterdir())
    if not all(is_temporary(e.name, MARK) and kind(e) == "file" for e in entries):
        return False
    for entry in entries:
        entry.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        return False
    return True


def replaced(what: str) -> str:
    return (f"{what}: was replaced after multicard made it (by a user who can write into its folder?); nothing "
            f"was written there")


def shown(path: Path | str) -> str:
    """`path` as messages name it: one through a held folder's descriptor, by that folder's own path."""
    parts = Path(path).parts
    if len(parts) > 4 and Path(*parts[:4]) == MAGIC and parts[4].isdigit() and int(parts[4]) in _shown:
        return str(_shown[int(parts[4])].joinpath(*parts[5:]))
    return str(path)

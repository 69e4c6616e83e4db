"""Whose folders a run writes in. --out, its checkpoints folder and every folder above --out must be yours or
root's and not writable by group or others unless sticky (as /tmp), as ssh's StrictModes checks a home: else
another user could rename --out (or a folder above it) away and put a link in its place. A folder you trust
(--trust-dir PATH, or VAR=PATH in the environment, like git's safe.directory) is not checked, nor are the folders in
it and above it. --trust-dir takes one path as given, ":" included (several: the flag again); the variable
separates several by ":" as PATH does. Either way the run writes only through --out held open (outdir.py), never
again by its path.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from .. import safefs
from ..errors import UsageError
from ..jobs.protocol import TRUST_DIR

VAR = TRUST_DIR  # folders trusted, separated by os.pathsep (":"), as PATH separates its folders


def trusted(given: str | os.PathLike | Sequence[str | os.PathLike] = ()) -> list[str]:
    """The folders trusted: those --trust-dir names (one path, or several; each whole, ":" included) and those
    VAR names (separated by ":"), each as given (made absolute) and as the real path it leads to."""
    one = isinstance(given, (str, os.PathLike))
    names = [os.path.expanduser(name) for name in (*map(os.fspath, [given] if one else given),
                                                   *os.environ.get(VAR, "").split(os.pathsep)) if name.strip()]
    return [path for name in names for path in (os.path.abspath(name), os.path.realpath(name))]


def covers(path: str | Path, folders: list[str]) -> bool:
    """Whether a trusted folder is `path` (a real path), holds it, or lies inside it."""
    path = str(path)
    return any(path == t or path.startswith(t.rstrip("/") + "/") or t.startswith(path.rstrip("/") + "/")
               for t in folders)


def way_out(path: str | Path) -> str:
    """What a refusal adds: how to trust the folder it names (the variable would split a path holding ":")."""
    return f", or trust it: --trust-dir {path}" + (f" (or {VAR}={path})" if os.pathsep not in str(path) else "")


def above(out: Path) -> list[Path]:
    """The folders above --out, each as a real path: those its path names as given (the folder holding a link on
    the way too, where someone could swap that link) and those it resolves to."""
    given = [Path(os.path.realpath(p)) for p in Path(os.path.abspath(out)).parents]
    return list(dict.fromkeys([*given, *Path(os.path.realpath(out)).parents]))


def check_above(out: Path, folders: list[str]) -> None:
    """The folders above --out that are there already, as the module says (before --out is made: a refused --out
    is not even made); one line names the first that fails (the same verdict for --out /vol/run as for --out
    /vol, where /vol is another user's)."""
    for folder in above(out):
        if os.path.isdir(folder) and not covers(folder, folders):
            guard(os.lstat(folder), f"--out {out}: {folder}", folder, way_out(folder))


def check_out(fd: int, out: Path, folders: list[str]) -> None:
    """--out, held open as `fd` (the folder its path leads to now, or one line), and every folder above it."""
    real = os.path.realpath(out)
    held = os.fstat(fd)
    try:
        found = os.stat(real)
    except OSError:
        found = None
    if found is None or (found.st_dev, found.st_ino) != (held.st_dev, held.st_ino):
        raise UsageError(f"--out {out}: was moved while multicard opened it (by a user who can write into a folder "
                         f"above it?); nothing was written there")
    if not covers(real, folders):
        guard(held, f"--out {out}", out, way_out(real))
    check_above(out, folders)


def check_before_reading(out: str | Path, folders: list[str]) -> None:
    """What Output checks of --out and of its checkpoints folder (check_above, check_out, check_folder), where they
    are there already, before anything in --out is read (--resume): a checkpoint planted in a stranger's --out is
    never opened."""
    out = Path(out)
    check_above(out, folders)
    if not os.path.isdir(out):
        return
    with safefs.Folder.open(out, f"--out {out}") as held:
        check_out(held.fd, out, folders)
    if safefs.is_folder(out / "checkpoints"):
        with safefs.Folder.open(out / "checkpoints", f"--out {out}: checkpoints") as held:
            check_folder(held.fd, f"--out {out}: checkpoints", out / "checkpoints", folders)


def check_folder(fd: int, what: str, path: Path, folders: list[str]) -> None:
    """A folder multicard writes in below --out (its checkpoints), held open as `fd`: yours or root's, not
    writable by others, unless trusted."""
    if not covers(os.path.realpath(safefs.shown(path)), folders):
        guard(os.fstat(fd), what, Path(safefs.shown(path)), way_out(safefs.shown(path)))


def guard(info: os.stat_result, what: str, path: Path, then: str = "") -> None:
    """Refuse a folder in which another user could swap what multicard makes for a link elsewhere: one owned by
    another user (root aside), or writable by group or others without the sticky bit (ssh's rule for a home).
    `then`: what the line adds as the last way out."""
    if info.st_uid not in (os.geteuid(), 0):
        raise UsageError(f"{what}: belongs to another user (uid {info.st_uid}), who could swap what multicard makes "
                         f"there for a link elsewhere; use a folder of your own (or chown it to you){then}")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UsageError(f"{what}: other users can write into it ({stat.filemode(info.st_mode)}) and could swap "
                         f"what multicard makes there for a link elsewhere; run `chmod go-w {path}` or choose "
                         f"another folder{then}")

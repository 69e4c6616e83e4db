"""Whose folders a run writes in. --out, its checkpoints folder and every folder above --out must be yours or
root's and not writable by group or others unless sticky (as /tmp), as ssh's StrictModes checks a home: else
another user could rename --out (or a folder above it) away and put a link in its place. A folder you trust
(--trust-dir PATH, or MULTICARD_TRUST_DIR=PATH, like git's safe.directory) is not checked, nor are the folders in
it and above it. Either way the run writes only through --out held open (outdir.py), never again by its path.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import safefs
from ..errors import UsageError

VAR = "MULTICARD_TRUST_DIR"  # folders trusted, separated by os.pathsep (":"), as --trust-dir takes them


def trusted(given: str = "") -> list[str]:
    """The folders trusted: those --trust-dir names and those MULTICARD_TRUST_DIR names, each as given (made
    absolute) and as the real path it leads to."""
    names = [os.path.expanduser(name) for name in f"{given}{os.pathsep}{os.environ.get(VAR, '')}".split(os.pathsep)
             if name.strip()]
    return [path for name in names for path in (os.path.abspath(name), os.path.realpath(name))]


def covers(path: str | Path, folders: list[str]) -> bool:
    """Whether a trusted folder is `path` (a real path), holds it, or lies inside it."""
    path = str(path)
    return any(path == t or path.startswith(t.rstrip("/") + "/") or t.startswith(path.rstrip("/") + "/")
               for t in folders)


def way_out(path: str | Path) -> str:
    """What a refusal adds: how to trust the folder it names."""
    return f", or trust it: --trust-dir {path} (or {VAR}={path})"


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
            safefs.guard(os.lstat(folder), f"--out {out}: {folder}", folder, way_out(folder))


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
        safefs.guard(held, f"--out {out}", out, way_out(real))
    check_above(out, folders)


def check_folder(fd: int, what: str, path: Path, folders: list[str]) -> None:
    """A folder multicard writes in below --out (its checkpoints), held open as `fd`: yours or root's, not
    writable by others, unless trusted."""
    if not covers(os.path.realpath(safefs.shown(path)), folders):
        safefs.guard(os.fstat(fd), what, Path(safefs.shown(path)), way_out(safefs.shown(path)))

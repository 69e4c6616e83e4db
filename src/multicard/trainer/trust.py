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
    """The folders trusted: those --trust-dir names and those MULTICARD_TRUST_DIR names, as real paths."""
    names = f"{given}{os.pathsep}{os.environ.get(VAR, '')}".split(os.pathsep)
    return [os.path.realpath(os.path.expanduser(name)) for name in names if name.strip()]


def covers(path: str | Path, folders: list[str]) -> bool:
    """Whether a trusted folder is `path` (a real path), holds it, or lies inside it."""
    path = str(path)
    return any(path == t or path.startswith(t.rstrip("/") + "/") or t.startswith(path.rstrip("/") + "/")
               for t in folders)


def way_out(path: str | Path) -> str:
    """What a refusal adds: how to trust the folder it names."""
    return f", or trust it: --trust-dir {path} (or {VAR}={path})"


def check_above(out: Path, folders: list[str]) -> None:
    """Before --out is made: the folders above it that are there already, as check_out checks them (a refused
    --out is not even made)."""
    for above in Path(os.path.realpath(out)).parents:
        if os.path.isdir(above) and not covers(above, folders):
            safefs.guard(os.lstat(above), f"--out {out}: {above}", above, way_out(above))


def check_out(fd: int, out: Path, folders: list[str]) -> None:
    """--out, held open as `fd`, and every folder above it, as the module says; one line names the first that
    fails (the same verdict for --out /vol/run as for --out /vol, where /vol is another user's)."""
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
    for above in Path(real).parents:
        if not covers(above, folders):
            safefs.guard(os.lstat(above), f"--out {out}: {above}", above, way_out(above))  # a link: not its own


def check_folder(fd: int, what: str, path: Path, folders: list[str]) -> None:
    """A folder multicard writes in below --out (its checkpoints), held open as `fd`: yours or root's, not
    writable by others, unless trusted."""
    if not covers(os.path.realpath(safefs.shown(path)), folders):
        safefs.guard(os.fstat(fd), what, Path(safefs.shown(path)), way_out(safefs.shown(path)))

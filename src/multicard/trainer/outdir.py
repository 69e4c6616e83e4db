"""--out as one run holds it: a lock, a fresh folder per attempt, one rename that shows a run's files all at once,
and deleting only what multicard can prove it made there. --out is opened once and checked (trust.py); every later
read, write, rename and deletion goes through that open folder (`root`, /proc/self/fd/N on Linux), never again
through its path: renamed away and replaced by a link mid-run, it redirects nothing."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import time
from pathlib import Path

from .. import safefs
from ..checkpoints.trainer_saves import hold
from ..errors import UsageError, say
from ..safefs import MARK, drop_half_marked, marked
from . import trust

FILES = ("model.pt", "metrics.jsonl", "summary.json", "curves.png")  # what --out shows of the last good run
OPTIONAL = ("tensorboard",)  # shown too where that run wrote it (--tensorboard)
CURRENT = ".current"  # the one name switched when a run ends well: a link to that run's folder
LINK_PART = re.compile(rf"({'|'.join(map(re.escape, (*FILES, *OPTIONAL, CURRENT)))})\.(\d+|[0-9a-f]{{12}})\.part")
# filesystems of the kernel's, no place for a run's files (a tmpfs, /dev/shm's, is one: it is allowed)
PSEUDO = frozenset(("proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
                    "pstore", "bpf", "configfs", "fusectl", "mqueue", "hugetlbfs", "binfmt_misc", "efivarfs",
                    "selinuxfs", "rpc_pipefs", "nsfs", "devfs"))
MOUNTINFO = Path("/proc/self/mountinfo")  # Linux: each mount's device (major:minor), mount point and type


class Output:
    """--out as one run holds it. A lock: a second run into the same folder is refused at once (released by the
    system however this process ends). Each run writes into a fresh folder of its own, .run-<time>-<pid>; when
    it has ended well, one name (.current) is switched to that folder, and model.pt, metrics.jsonl,
    summary.json, curves.png (and tensorboard/) are links through it, made before the switch: they change
    together, and a run that fails or is stopped changes nothing. Leftovers of a killed run (its folder,
    half-made links, half-written checkpoints) go when the next run starts its first attempt, and only those
    that carry multicard's marker; a name there that multicard did not make refuses the run before anything in
    --out is touched. `trusted`: --trust-dir's folders (trust.py)."""

    def __init__(self, out: str, trusted: list[str] | tuple[str, ...] = ()):
        self.path = path = Path(out)
        self.cleaned = False
        if why := no_place(path):
            raise UsageError(f"--out {out}: {why}, no place for files; name a folder")
        if path.exists() and not path.is_dir():
            raise UsageError(f"--out {out}: is a file; name a folder (it is created if missing)")
        self.trusted = trust.trusted(trusted)
        trust.check_above(path, self.trusted)
        try:
            path.mkdir(safefs.FOLDER_MODE, parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--out {out}: cannot create that folder ({e.strerror})") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"--out {out}: this user cannot write into that folder")
        self.folder = safefs.Folder(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), path)
        self.fd, self.root = self.folder.fd, self.folder.via
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.folder.close()
            raise UsageError(f"--out {out}: another run is writing there; wait for it to end, or choose another "
                             f"--out") from None
        try:
            trust.check_out(self.fd, path, self.trusted)
            self.check()
        except BaseException:
            self.close()
            raise

    def check(self) -> None:
        """Refuse an --out where multicard would replace or write through what it did not make: a shown name
        that is not its link into .current, a .current that is not its link to a run, a checkpoints link."""
        for name in (*FILES, *OPTIONAL):
            place = self.root / name
            if (place.exists() or place.is_symlink()) and not ours(place, f"{CURRENT}/{name}"):
                raise UsageError(f"--out {self.path}: {name} there is not multicard's (not its link into {CURRENT}); "
                                 f"move it elsewhere or choose another --out (nothing was changed)")
        current = self.root / CURRENT
        if (current.exists() or current.is_symlink()) and not ours(current):
            raise UsageError(f"--out {self.path}: {CURRENT} there is not multicard's link to a run folder; move it "
                             f"elsewhere or choose another --out (nothing was changed)")
        checkpoints = self.root / "checkpoints"
        if checkpoints.is_symlink() or (checkpoints.exists() and not checkpoints.is_dir()):
            raise UsageError(f"--out {self.path}: checkpoints there is a link or a file; multicard writes its "
                             f"checkpoints only into a folder of its own: move it elsewhere (nothing was changed)")
        if checkpoints.exists():
            with safefs.Folder.open(checkpoints) as held:
                trust.check_folder(held.fd, f"--out {self.path}: checkpoints", checkpoints, self.trusted)

    def runs(self) -> list[Path]:
        """Run folders multicard made here (its marker inside; never through a link)."""
        return [p for p in self.root.glob(".run-*") if marked(p)]

    def clean(self) -> None:
        """Remove what killed runs left, and only that: run folders never switched to (marked), half-made links
        (named and aimed as multicard makes them), half-written checkpoints (marked). Anything else named like
        them is left, with a line."""
        current = os.readlink(self.root / CURRENT) if (self.root / CURRENT).is_symlink() else None
        for run in self.runs():
            if run.name != current:
                remove(run)
        for part in self.root.glob("*.part"):
            named = LINK_PART.fullmatch(part.name)
            if named and (ours(part) or ours(part, f"{CURRENT}/{named.group(1)}")):
                part.unlink()
            else:
                say(f"left alone: {safefs.shown(part)} (not a leftover multicard can prove it made)")
        held = hold(self.root, self.check_checkpoints, make=False)  # never through a link: a folder held
        for part in held.via.glob("*.part") if held is not None else ():
            if marked(part):
                remove(part)
            elif safefs.is_temporary(part.name, "run.json") and safefs.kind(part) == "file":  # half-written
                part.unlink()
            elif not drop_half_marked(part):
                say(f"left alone: {safefs.shown(part)} (not a leftover multicard can prove it made)")
        if held is not None:
            held.close()
        self.cleaned = True

    def check_checkpoints(self, fd: int, what: str, path: Path) -> None:
        """Whose --out/checkpoints, held open as `fd`, may be: yours or root's, not writable by others, unless
        trusted (trainer_saves.hold's check)."""
        trust.check_folder(fd, what, path, self.trusted)

    def new_run(self) -> safefs.Made:
        """A fresh folder for an attempt's files, made through --out held open and marked; the first one clears
        the killed runs' leftovers first. The processes find it again with safefs.Folder.again: only that very
        folder, never a link or another folder put under its name."""
        if not self.cleaned:
            self.clean()
        name = f".run-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{time.monotonic_ns() % 10**6}"
        held = safefs.Folder(os.dup(self.fd), self.path)
        try:
            with held.make(name, f"--out {self.path}: {name}") as run:
                run.write(MARK, lambda f: f.write(b"a run folder of multicard: removed once another run is shown\n"))
                return run.made
        except OSError as e:
            raise UsageError(f"--out {self.path}: cannot write there ({e.strerror}); free space or choose another "
                             f"--out") from None
        finally:
            held.close()

    def discard(self, run: safefs.Made) -> None:
        remove(self.root / run.path.name)

    def publish(self, made: safefs.Made) -> None:
        """Make `run` the one --out shows. Every check and every link first (a link into .current, for a first
        run dangling until the switch); then one rename switches .current to `run`, and only then what the
        older run had and this one lacks (a tensorboard link, now dangling) and the older runs go. A run folder
        that is no longer the one made (renamed, a link put in its place) is never shown."""
        run = made.path
        try:
            info = os.stat(run.name, dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            info = None
        if info is None or (info.st_dev, info.st_ino) != (made.dev, made.ino):
            raise UsageError(f"run folder {run}: was replaced while the run wrote into it (by a user who can write "
                             f"into --out?); --out {self.path} left as it was")
        missing = [name for name in FILES if not (self.root / run.name / name).is_file()]
        if missing:
            raise UsageError(f"run folder {run}: has no {missing[0]}; --out {self.path} left as it was")
        self.check()
        shown = [*FILES, *(name for name in OPTIONAL if (self.root / run.name / name).is_dir())]
        try:
            for name in shown:
                if not (self.root / name).is_symlink():
                    link(self.root / name, f"{CURRENT}/{name}")
            link(self.root / CURRENT, run.name)  # the switch
        except OSError as e:
            raise UsageError(f"--out {self.path}: cannot write there ({e.strerror}); it still shows the run before "
                             f"(free space, then run again)") from None
        for name in OPTIONAL:
            if name not in shown and (self.root / name).is_symlink():  # checked above: our link, now dangling
                (self.root / name).unlink()
        for old in self.runs():
            if old.name != run.name:
                remove(old)

    def close(self) -> None:
        self.folder.close()  # the lock goes with it

    def __enter__(self) -> Output:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def held_out(run: safefs.Folder, out: str) -> safefs.Folder:
    """--out as a rank finds it from its run folder, held open: the folder that run folder was made in, wherever
    it is now (`..` of the folder held, never --out's path: renamed away and replaced, the path leads elsewhere)."""
    return safefs.Folder(os.open(run.via / "..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), Path(out))


def ours(path: Path, target: str | None = None) -> bool:
    """Whether `path` is a link multicard makes: to `target`, or (no target) to a run folder beside it."""
    if not path.is_symlink():
        return False
    aim = os.readlink(path)
    return aim == target if target is not None else "/" not in aim and aim.startswith(".run-")


def link(path: Path, target: str) -> None:
    """Point `path` at `target` in one step: a new link beside it, renamed over it."""
    tmp = path.with_name(safefs.temporary_name(path.name))  # 48 random bits: never a name planted in advance
    os.symlink(target, tmp)  # made here and now (never over something there)
    os.replace(tmp, path)


def remove(path: Path) -> None:
    """Delete a file, a link (never what it points at) or a folder multicard made (never through a link)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def no_place(out: Path) -> str | None:
    """Why --out can hold no files, or None: a device on its way (/dev/null), or the nearest folder there on a
    filesystem of the kernel's (PSEUDO: /proc, /sys, /dev, ...; a tmpfs such as /dev/shm is a place for files).
    Without /proc/self/mountinfo (not Linux), by where it is: /proc, /sys and /dev but /dev/shm."""
    real = out.resolve()
    there = next(p for p in (real, *real.parents) if p.exists())
    info = os.stat(there)
    if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode):
        return "is a device" if there == real else f"{there} is a device"
    if not stat.S_ISDIR(info.st_mode):
        return None  # a file: said elsewhere
    found = filesystem(there, info.st_dev)
    if found is None:
        top = real.parts[1] if len(real.parts) > 1 and real.parts[1:3] != ("dev", "shm") else ""
        found = ({"proc": "proc", "sys": "sysfs", "dev": "devfs"}.get(top, ""), f"/{top}")
    kind, mount = found
    return f"is inside {mount} ({kind}, a filesystem of the kernel's)" if kind in PSEUDO else None


def filesystem(folder: Path, device: int) -> tuple[str, str] | None:
    """The type and mount point of the filesystem holding `folder` (its st_dev `device`), as /proc/self/mountinfo
    says: of the mounts of that device, the innermost holding `folder`; ("", "") where none is that device; None
    without mountinfo."""
    try:
        lines = MOUNTINFO.read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        mount, _, rest = line.partition(" - ")
        fields, kind = mount.split(), rest.split()[:1]
        if len(fields) < 5 or not kind or ":" not in fields[2]:
            continue
        major, minor = fields[2].split(":", 1)
        if major.isdigit() and minor.isdigit() and os.makedev(int(major), int(minor)) == device:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])  # " " is written \040
            found.append((kind[0], point))
    holding = [f for f in found if folder == Path(f[1]) or Path(f[1]) in folder.parents]
    return max(holding or found, key=lambda f: len(f[1]), default=("", ""))

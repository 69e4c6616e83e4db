"""Writing the trainer's checkpoints in --out/checkpoints: claiming the folder for a run (the earlier runs' checkpoints
moved aside, nothing deleted), writing each checkpoint whole, and pruning this run's oldest. The layout and the
ownership rules are in resume.py's docstring; reading is there too.

Every write goes through folders held open. `out` is --out as the process holds it (outdir.py: /proc/self/fd/N);
checkpoints/ is opened in it once, never through a link, its owner checked (hold), and held: for a claim, or for
the whole run (Checkpointer). Each step-N is made, written, renamed and pruned relative to that folder, so a
checkpoints/ swapped for a link to another run's after that is never written through. Lines name folders by their
own paths (safefs.shown).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from .. import safefs
from ..errors import UsageError, say
from ..safefs import MARK, drop_half_marked, shown
from .resume import FOLDER, OWNER, listed, newest, read_owner, run_of, same

Check = Callable[[int, str, Path], None]  # check(fd, what, path): whose a folder held open may be (trust.py)


def new_id() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"


def hold(out: str | Path, check: Check | None = None, make: bool = True) -> safefs.Folder | None:
    """--out/checkpoints held open: opened in --out held open, never through a link (a link, a file or anything
    else under that name is one line), made first where missing (`make`; else None then), and its owner checked
    by `check` before anything in it is read or written."""
    what = f"--out {shown(out)}: {FOLDER}"
    with safefs.Folder.open(Path(out), f"--out {shown(out)}") as parent:
        folder = parent.child(FOLDER, what, make)
    if folder is not None and check is not None:
        try:
            check(folder.fd, what, folder.shown)
        except BaseException:
            folder.close()
            raise
    return folder


def claim(out: str | Path, resumed: Path | None, check: Check | None = None) -> str:
    """Rank 0, before a run's processes start: the id of this run. Going on from what --resume auto would (the
    owner's newest) keeps the owner's; any other start is a new run, which claims the folder and moves the
    earlier runs' checkpoints into checkpoints/run-<id>/ (the one resumed from stays where it is read).

    The claim comes first, in one rename of run.json, and the moves after it: a kill at any instant leaves
    --resume auto either the earlier run (before the rename) or the new one (after it: it goes on from where
    the new run started, never from an earlier run's checkpoint); the next start moves what is left."""
    folder = hold(out, check, make=resumed is not None)
    if folder is None:  # nothing to claim yet: the first checkpoint claims it
        return new_id()
    with folder:
        try:
            return claimed(folder, resumed)
        except OSError as e:  # a read-only or immutable checkpoints folder, a full disk
            raise UsageError(f"--out {shown(out)}: cannot write into {FOLDER}/ ({e.strerror or e}); make it "
                             f"writable or choose another --out") from None


def claimed(checkpoints: safefs.Folder, resumed: Path | None) -> str:
    folder = checkpoints.via
    own, wrong = read_owner(folder)
    if wrong:
        say(f"{shown(folder / OWNER)} {wrong}: ignored (it names no run that owns the checkpoints there); this run "
            f"claims them anew")
    keep = [resumed.parent] if resumed is not None else []
    if own is not None and resumed is not None and same(resumed, newest(folder, outside=False)):
        run = own["run"]
        keep += [Path(own["from"]).parent] if isinstance(own.get("from"), str) else []
    else:
        run = new_id()
        places(folder, run, keep)  # every folder a move needs, checked before anything changes
        record = {"run": run, "from": os.path.abspath(shown(resumed)) if resumed is not None else None}
        checkpoints.write(OWNER, lambda f: f.write((json.dumps(record) + "\n").encode()))
    moved: dict[Path, list[str]] = {}
    for old, place in places(folder, run, keep).items():
        moved.setdefault(aside(old, run, place), []).append(old.name)
    for place, names in moved.items():
        say(f"{len(names)} checkpoint(s) of an earlier run ({', '.join(names)}) moved to {shown(place)}: nothing "
            f"deleted; --resume {shown(place)} goes on from that run")
    return run


def places(folder: Path, run: str, keep: list[Path]) -> dict[Path, Path]:
    """{checkpoint: the folder it goes into} for every whole checkpoint in a folder of checkpoints that is not
    `run`'s nor in `keep`; each folder is made (a real one: a link or a file under that name is refused in one
    line)."""
    return {old: folder_aside(old, run) for old in listed(folder)
            if run_of(old) != run and not any(same(old, k) for k in keep)}


def folder_aside(checkpoint: Path, run: str) -> Path:
    """checkpoints/run-<the id of the run that wrote `checkpoint`>/, made if missing (never through a link). One
    written before runs had ids (or whose marker is not an id) goes into run-unnamed-<this run's id>/."""
    place = checkpoint.parent / f"run-{run_of(checkpoint) or 'unnamed-' + run}"
    return safefs.make_folder(place, shown(place))


def aside(checkpoint: Path, run: str, place: Path | None = None) -> Path:
    """Move an earlier run's checkpoint into its folder aside (never over another); returns that folder."""
    place = place or folder_aside(checkpoint, run)
    target, n = place / checkpoint.name, 1
    while safefs.kind(target) is not None:
        n += 1
        target = place / f"{checkpoint.name}~{n}"
    os.replace(checkpoint, target)
    return place


class Front(Protocol):
    """What the trainer's checkpoints take of the job: a Multicard's public calls (never its insides)."""

    is_main: bool
    sharded: bool

    def barrier(self) -> None: ...
    def broadcast(self, obj: Any, src: int = 0) -> Any: ...
    def gather(self, obj: Any) -> list: ...
    def save(self, path: str | Path, state: dict[str, Any]) -> None: ...


class Checkpointer:
    """The trainer's checkpoints of one run, every rank: written through --out/checkpoints held open. Rank 0 opens
    it at the first save (hold: never through a link, its owner checked), learns the run that owns it (or claims
    it), and holds it until close(). Under fsdp every rank writes its shards: the others hold the folder too, found
    by --out's path only where it is the very folder rank 0 holds (its inode), and each save's folder likewise.
    Outside fsdp the other ranks hand rank 0 their random streams and write nothing."""

    def __init__(self, mc: Front, out: str | Path, check: Check):
        self.mc, self.out, self.check = mc, Path(out), check
        self.folder: safefs.Folder | None = None  # checkpoints/, held from the first save on
        self.run = ""  # the id of the run the checkpoints belong to (rank 0)

    def save(self, steps: int, state: dict, keep: int) -> None:
        """Every rank: its part of checkpoint step-<steps> (rank 0 the file, every rank its shards under fsdp);
        then rank 0 makes it whole and drops this run's oldest beyond `keep` (0: none dropped). Rank 0 makes
        step-N.part and writes into it through a descriptor held from then on: a folder renamed and replaced
        meanwhile is never written through, and is not renamed into place."""
        mc, name = self.mc, f"step-{steps:08d}"
        held = failed = None
        try:
            if mc.is_main:
                try:
                    self.open()
                    held = fresh(self.folder, self.folder.via / f"{name}.part", self.run)
                except UsageError as e:
                    if not mc.sharded:
                        raise
                    failed = str(e)  # under fsdp every rank says it
                state = {**state, "run": self.run}
            part = self.shared(held, name, failed)
            mc.barrier()  # under fsdp the other ranks write into the folder rank 0 made (its shards folder, checked)
            mc.save(part / "state.pt", state)
            mc.barrier()  # every rank's part is on disk
            if mc.is_main:
                whole_now(self.folder, held, name, self.run)
                for old in listed(self.folder.via, self.run)[:-keep] if keep else []:
                    drop(self.folder, old.name)
        finally:
            if held is not None:
                held.close()

    def open(self) -> None:
        """Rank 0, at the first save: checkpoints/ held, and the run that owns it (this one claims it if none
        does)."""
        if self.folder is None:
            self.folder = hold(self.out, self.check)
            own = read_owner(self.folder.via)[0]
            self.run = own["run"] if own is not None else claimed(self.folder, None)

    def shared(self, held: safefs.Folder | None, name: str, failed: str | None) -> Path:
        """The folder this rank names the save by: rank 0 the step-N.part it made and holds; under fsdp, every
        other rank that very folder, in checkpoints/ held (what differs, or rank 0's `failed`, is one line on
        every rank); outside fsdp, its name under --out (the other ranks hand over their streams by it, and write
        nothing)."""
        mc = self.mc
        if not mc.sharded:
            return held.via if held is not None else self.out / FOLDER / f"{name}.part"
        said = mc.broadcast(failed or ((self.folder.made.ino, held.made.ino) if held is not None else None))
        if isinstance(said, str):
            raise UsageError(said)
        if not mc.is_main:
            try:
                if self.folder is None:
                    self.folder = safefs.Folder.open(self.out / FOLDER, f"--out {shown(self.out)}: {FOLDER}")
                    if self.folder.made.ino != said[0]:
                        raise UsageError(safefs.replaced(f"--out {shown(self.out)}: {FOLDER}"))
                self.folder.take(f"{name}.part", shown(self.folder.via / f"{name}.part"), said[1]).close()
            except UsageError as e:
                failed = str(e)
        refused = [f for f in mc.gather(failed) if f]  # every rank writes, or none does
        if refused:
            raise UsageError(refused[0])
        return held.via if held is not None else self.folder.via / f"{name}.part"

    def close(self) -> None:
        if self.folder is not None:
            self.folder.close()
            self.folder = None


def whole_now(checkpoints: safefs.Folder, held: safefs.Folder, name: str, run: str) -> None:
    """Rank 0: step-N.part, still the folder written into, renamed to step-N."""
    part, final = f"{name}.part", checkpoints.via / name
    if not checkpoints.holds(part, held):
        raise UsageError(f"{shown(checkpoints.via / part)}: was replaced while the checkpoint was written into it (by "
                         f"a user who can write into {checkpoints.shown}?); the checkpoint is not in place: run again "
                         f"with --resume auto")
    if safefs.kind(final) == "folder" and run_of(final) == run:  # an earlier attempt of this run went past
        drop(checkpoints, name)
    elif safefs.kind(final) is not None:  # another run's (the one this run resumed from): kept, out of the way
        aside(final, run)
    os.replace(part, name, src_dir_fd=checkpoints.fd, dst_dir_fd=checkpoints.fd)


def fresh(checkpoints: safefs.Folder, part: Path, run: str) -> safefs.Folder:
    """Rank 0: the folder step-N.part, made new in `checkpoints`, marked as `run`'s, and held open. One this run
    left (an earlier attempt) is made anew; a link, a file, a FIFO or another's folder under that name is refused
    in one line, never written through or into."""
    found = safefs.kind(part)
    if found == "folder" and run_of(part) == run:
        shutil.rmtree(part)
    elif found is not None and not drop_half_marked(part):  # anything but one a kill cut short before its marker
        raise UsageError(f"{shown(part)}: a {found} multicard did not make is in the way of this checkpoint; move "
                         f"it elsewhere and run again (--resume auto goes on)")
    held = None
    try:
        held = checkpoints.make(part.name, shown(part))
        held.write(MARK, lambda f: f.write((run + "\n").encode()))  # first: a kill from here on leaves it ours
    except OSError as e:
        if held is not None:
            held.close()
        raise UsageError(f"cannot write {shown(part)} ({e.strerror}); choose another --out") from None
    return held


def drop(checkpoints: safefs.Folder, name: str) -> None:
    """Checkpoint `name` of the folder held: out of the list of whole checkpoints at once (one rename in that
    folder), then deleted: a kill half-way through the deletion leaves no checkpoint that looks whole and is not.
    Never through a link."""
    if safefs.kind_in(checkpoints.fd, name) != "folder":
        raise UsageError(f"{shown(checkpoints.via / name)}: not a folder multicard made; multicard deletes only "
                         f"folders of its own")
    gone = f"{name}.{secrets.token_hex(4)}.dropped.part"  # never one planted
    os.replace(name, gone, src_dir_fd=checkpoints.fd, dst_dir_fd=checkpoints.fd)
    shutil.rmtree(checkpoints.via / gone, ignore_errors=True)

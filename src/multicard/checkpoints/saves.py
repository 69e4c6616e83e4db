"""Writing the trainer's checkpoints in --out/checkpoints: claiming the folder for a run (the earlier runs' checkpoints
moved aside, nothing deleted), writing each checkpoint whole, and pruning this run's oldest. The layout and the
ownership rules are in resume.py's docstring; reading is there too. `out` is --out as the process holds it open
(outdir.py: /proc/self/fd/N), so every path here is reached through it; lines name it by its own path (shown).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import safefs
from ..errors import UsageError, say
from ..safefs import MARK, drop_half_marked, shown
from .resume import FOLDER, OWNER, newest, owner, read_owner, run_of, same, whole


def new_id() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"


def claim(out: str | Path, resumed: Path | None) -> str:
    """Rank 0, before a run's processes start: the id of this run. Going on from what --resume auto would (the
    owner's newest) keeps the owner's; any other start is a new run, which claims the folder and moves the
    earlier runs' checkpoints into checkpoints/run-<id>/ (the one resumed from stays where it is read).

    The claim comes first, in one rename of run.json, and the moves after it: a kill at any instant leaves
    --resume auto either the earlier run (before the rename) or the new one (after it: it goes on from where
    the new run started, never from an earlier run's checkpoint); the next start moves what is left."""
    try:
        return claimed(out, resumed)
    except OSError as e:  # a read-only or immutable checkpoints folder, a full disk
        raise UsageError(f"--out {shown(out)}: cannot write into {FOLDER}/ ({e.strerror or e}); make it writable or "
                         f"choose another --out") from None


def claimed(out: str | Path, resumed: Path | None) -> str:
    own, wrong = read_owner(out)
    folder = Path(out) / FOLDER
    if wrong:
        say(f"{shown(folder / OWNER)} {wrong}: ignored (it names no run that owns the checkpoints there); this run "
            f"claims them anew")
    keep = [resumed.parent] if resumed is not None else []
    if own is not None and resumed is not None and same(resumed, newest(out, outside=False)):
        run = own["run"]
        keep += [Path(own["from"]).parent] if isinstance(own.get("from"), str) else []
    else:
        run = new_id()
        if resumed is None and safefs.kind(folder) is None:  # nothing to claim yet: the first checkpoint claims it
            return run
        places(out, run, keep)  # every folder a move needs, checked before anything changes
        safefs.make_folder(folder, f"--out {shown(out)}: {FOLDER}")
        record = {"run": run, "from": os.path.abspath(shown(resumed)) if resumed is not None else None}
        safefs.write_file(folder / OWNER, (json.dumps(record) + "\n").encode())
    moved: dict[Path, list[str]] = {}
    for old, place in places(out, run, keep).items():
        moved.setdefault(aside(old, run, place), []).append(old.name)
    for place, names in moved.items():
        say(f"{len(names)} checkpoint(s) of an earlier run ({', '.join(names)}) moved to {shown(place)}: nothing "
            f"deleted; --resume {shown(place)} goes on from that run")
    return run


def places(out: str | Path, run: str, keep: list[Path]) -> dict[Path, Path]:
    """{checkpoint: the folder it goes into} for every whole checkpoint in --out that is not `run`'s nor in
    `keep`; each folder is made (a real one: a link or a file under that name is refused in one line)."""
    return {old: folder_aside(old, run) for old in whole(out)
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


def write(mc: Any, out: str | Path, steps: int, state: dict, keep: int,
          check: Callable[[int, str, Path], None]) -> None:
    """Every rank: its part of checkpoint step-<steps> (rank 0 the file, every rank its shards under fsdp); then
    rank 0 makes it whole and drops this run's oldest beyond `keep` (0: none dropped). Rank 0 makes step-N.part
    and writes into it through a descriptor held from then on: a folder renamed and replaced meanwhile (by a user
    who can write into checkpoints/) is never written through, and is not renamed into place. `check(fd, what,
    folder)`: whose the checkpoints folder held open may be (the trainer's trust.py), before anything is written."""
    folder = Path(out) / FOLDER
    final = folder / f"step-{steps:08d}"
    part = final.with_name(final.name + ".part")
    held = checkpoints = None
    if mc.is_main:
        safefs.make_folder(folder, f"--out {shown(out)}: {FOLDER}")  # first: claim() records the run there
        run = (owner(out) or {}).get("run") or claim(out, None)
        checkpoints = safefs.Folder.open(folder, f"--out {shown(out)}: {FOLDER}")
        check(checkpoints.fd, f"--out {shown(out)}: {FOLDER}", folder)
        held = fresh(checkpoints, part, run)
        state = {**state, "run": run}
    mc.barrier()  # under fsdp the other ranks write into the folder rank 0 made (its shards folder, checked)
    try:
        mc.save(held.via / "state.pt" if held else part / "state.pt", state)
        mc.barrier()  # every rank's part is on disk
        if mc.is_main:
            whole_now(checkpoints, held, part, final, run)
            for old in whole(out, run)[:-keep] if keep else []:
                drop(old)
    finally:
        for opened in (held, checkpoints):
            if opened is not None:
                opened.close()


def whole_now(checkpoints: safefs.Folder, held: safefs.Folder, part: Path, final: Path, run: str) -> None:
    """Rank 0: step-N.part, still the folder written into, renamed to step-N."""
    if not checkpoints.holds(part.name, held):
        raise UsageError(f"{shown(part)}: was replaced while the checkpoint was written into it (by a user who can "
                         f"write into {shown(part.parent)}?); the checkpoint is not in place: run again with --resume "
                         f"auto")
    if safefs.kind(final) == "folder" and run_of(final) == run:  # an earlier attempt of this run went past
        drop(final)
    elif safefs.kind(final) is not None:  # another run's (the one this run resumed from): kept, out of the way
        aside(final, run)
    os.replace(part.name, final.name, src_dir_fd=checkpoints.fd, dst_dir_fd=checkpoints.fd)


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


def drop(checkpoint: Path) -> None:
    """Out of the list of whole checkpoints at once (one rename), then deleted: a kill half-way through the
    deletion leaves no checkpoint that looks whole and is not. Never through a link."""
    if checkpoint.is_symlink() or checkpoint.parent.is_symlink():
        raise UsageError(f"{shown(checkpoint)}: reached through a link; multicard deletes only in folders of its "
                         f"own")
    gone = checkpoint.with_name(f"{checkpoint.name}.{secrets.token_hex(4)}.dropped.part")  # never one planted
    os.replace(checkpoint, gone)
    shutil.rmtree(gone, ignore_errors=True)

"""Reading the trainer's checkpoints in --out/checkpoints: which ones are whole and whose, the one --resume names,
its head checked (the recipe a resume takes from it: trainer/recipe.py). Nothing here writes (trainer_saves.py does).

Each checkpoint is a folder, step-<optimizer steps>, holding state.pt (rank 0: model, optimizer, scheduler,
scaler, the place in the data, the epochs so far, every rank's random streams, the run's id; under fsdp every
rank's shards in a folder beside it; older versions kept rank r's streams in state.rank<r>.pt). It is written as
step-N.part and renamed only once every rank has written its part: a kill at any instant leaves the checkpoints
before it whole, and only whole ones are ever resumed from; a damaged one is passed over by --resume auto.

Checkpoints belong to a run. checkpoints/run.json names the run that owns the folder (the last one started
there) and the checkpoint it started from; each checkpoint carries its run's id (a .multicard file, and "run" in
state.pt). A run that goes on from the owner's newest checkpoint (--resume auto, a restart) is the same run; any
other start is a new run, which first moves the earlier runs' checkpoints into checkpoints/run-<their id>/ (none
deleted; --resume takes that folder) and so never prunes, resumes or restarts from them.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path

import torch

from .. import safefs
from ..errors import UsageError
from . import shards, sums
from .files import OWN

FOLDER = "checkpoints"
OWNER = "run.json"
NAME = re.compile(r"step-(\d+)")
RUN_ID = re.compile(r"\d{8}T\d{6}-[0-9a-f]{6}")  # what new_id() makes; a marker holding anything else is not read


def whole(out: str | Path, run: str | None = None) -> list[Path]:
    """The complete checkpoints in --out (or in a folder of checkpoints), oldest first; with `run`, that run's."""
    return listed(Path(out) / FOLDER if safefs.is_folder(Path(out) / FOLDER) else Path(out), run)


def listed(folder: Path, run: str | None = None) -> list[Path]:
    """The complete checkpoints in a folder of checkpoints, oldest first; with `run`, that run's. Links are never
    followed: a checkpoint is a real folder holding a regular state.pt."""
    found = [(int(m.group(1)), p) for p in folder.glob("step-*")
             if (m := NAME.fullmatch(p.name)) and safefs.is_folder(p) and safefs.kind(p / "state.pt") == "file"]
    return [p for _, p in sorted(found) if run is None or run_of(p) == run]


def run_of(checkpoint: Path) -> str | None:
    """The id of the run that wrote a checkpoint folder: its marker's text where that is an id as multicard
    writes them (None: one written before runs had ids, or a marker that is not multicard's: a link, a FIFO, a
    huge file, text that is not an id; such a checkpoint is kept aside as unnamed, never a path made of it)."""
    try:
        text = safefs.read_bytes(checkpoint / safefs.MARK, safefs.SMALL).decode("ascii").strip()
    except (UsageError, UnicodeDecodeError):
        return None
    return text if RUN_ID.fullmatch(text) else None


def owner(out: str | Path) -> dict | None:
    """checkpoints/run.json: {"run": the id of the run these checkpoints belong to, "from": the checkpoint it
    started from or None}; None where no run has claimed the folder (a new --out, or an older version's) or
    where run.json does not say (read_owner() says why). A run.json that is not a regular file (a FIFO, a
    folder, a link) or too large to be multicard's is one line."""
    return read_owner(Path(out) / FOLDER)[0]


def read_owner(folder: Path) -> tuple[dict | None, str | None]:
    """owner() of a folder of checkpoints, and what is wrong with a run.json there that names no run (None: there
    is none, or it names one)."""
    path = folder / OWNER
    if safefs.kind(path) is None:
        return None, None
    raw = safefs.read_bytes(path, safefs.SMALL, safefs.shown(path))
    try:
        found = json.loads(raw)
    except ValueError:
        return None, "is empty" if not raw.strip() else "is not JSON"
    if isinstance(found, dict) and isinstance(found.get("run"), str) and RUN_ID.fullmatch(found["run"]):
        return found, None
    return None, "names no run as multicard writes it"


def newest(folder: Path, outside: bool = True, skipped: list[str] | None = None) -> Path | None:
    """What --resume auto goes on from in a folder of checkpoints (--out/checkpoints): the newest sound checkpoint
    of the run that owns it, or, where it wrote none (or only damaged ones), the checkpoint that run started from
    (None: it started from the beginning). In a folder no run owns (an older version's), its newest sound
    checkpoint. One that cannot be resumed from, whatever its bytes (flaw()), is passed over, and said in
    `skipped`; where every one is, that is one line.

    The checkpoint run.json says the run started from is looked for among the checkpoints found in --out
    (never a path read from a file and opened as it is): one elsewhere is one line that names it, to be given as
    --resume by the user (`outside`=False: None instead)."""
    own = read_owner(folder)[0]
    found = [c / "state.pt" for c in reversed(listed(folder) if own is None else listed(folder, own["run"]))]
    started = own.get("from") if own is not None else None
    if isinstance(started, str):
        start = next((c / "state.pt" for c in inside(folder) if same(c / "state.pt", Path(started))), None)
        if start is None and not found:
            if not outside:
                return None
            raise UsageError(f"--resume auto: the run in {safefs.shown(folder)} started from {started[:300]!r}, "
                             f"which is not a checkpoint in --out, and wrote none of its own: to go on from there, "
                             f"give it as --resume; to start over, leave --resume out")
        found += [start] if start is not None else []
    passed = []
    for checkpoint in found:
        why = flaw(checkpoint)
        if why is None:
            (skipped if skipped is not None else []).extend(passed)
            return checkpoint
        passed.append(f"{checkpoint.parent.name} {why}")
    if passed:
        raise UsageError(f"--resume auto: every checkpoint it could go on from in {safefs.shown(folder)} is damaged "
                         f"({passed[0]}); give an earlier run's checkpoint as --resume, or start over without it")
    return None


def flaw(path: Path) -> str | None:
    """Why --resume auto cannot go on from checkpoint `path` (a state.pt), in a few words, whatever its bytes hold
    (None: it can): not what torch.save writes (empty, zeros, text), bytes not those its save wrote (a file or a
    shard), a zip torch cannot read, or a head that is not a checkpoint of multicard train's."""
    if wrong := foreign(path):
        return f"is damaged ({wrong})"
    if wrong := damage(path):
        return f"is damaged ({wrong})"
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many kinds for a file cut short or foreign
        return f"is unreadable (its {path.name}: {failed(e)})"
    wrong = unplaced(raw) or unsound(raw)
    return f"is not as multicard train writes it ({wrong})" if wrong else None


def failed(e: Exception) -> str:
    """The first words of what torch.load raised."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:120]


def foreign(path: Path) -> str | None:
    """What a checkpoint file that is no zip archive holds instead (None: it begins as one; torch.save writes
    nothing else): empty, zeros (a torn or zero-filled write), or anything else."""
    try:
        first = safefs.first_bytes(path, 4096, safefs.shown(path))
    except UsageError as e:
        return str(e)
    if first.startswith(sums.ZIP):
        return None
    if not first:
        return f"its {path.name} is empty"
    if not first.strip(b"\0"):
        return f"its {path.name} begins with {len(first):,} zero bytes (a torn or zero-filled write)"
    return f"its {path.name} is not a zip archive as torch.save writes (it begins {first[:12]!r})"


def damage(path: Path) -> str | None:
    """What of checkpoint `path` (a state.pt) is not as its save wrote it: the file, or under fsdp a file of its
    shards folder (None: nothing; one that cannot be read at all is head()'s to say). Each checkpoint's files are
    read once per process while they stay as they are (a file replaced or rewritten is read again); no more of
    them than their own directory records, and no file mostly holes (sums.overdrawn)."""
    return _damage(path, *_identity(path), *(_identity(f) for f in sorted(path.parent.glob(f"{path.stem}.shards-*/*"))))


def _identity(path: Path) -> tuple[int, ...]:
    """What changes when a file is rewritten or replaced (never through a link)."""
    info = os.lstat(path)
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


@functools.lru_cache(maxsize=16)
def _damage(path: Path, *identity: int | tuple) -> str | None:
    found = sums.damage(path)
    if found:
        return f"its {path.name}: {found}"
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        held = raw[OWN]["shards"]
        where = shards.located(path, held)
    except Exception:  # no shards, or a file head() refuses
        return None
    found = sums.files_damage(where, held.get("sums"))
    return f"its shards: {found}" if found else None


def inside(folder: Path) -> list[Path]:
    """Every whole checkpoint in a folder of checkpoints and in its run-<id> folders (found by listing; no link
    followed)."""
    return [*listed(folder), *(c for run in sorted(folder.glob("run-*")) if safefs.is_folder(run) for c in listed(run))]


def same(a: Path | None, b: Path | None) -> bool:
    """Whether two paths name one checkpoint, either reached through --out held open (safefs.shown)."""
    return a is not None and b is not None and \
        os.path.abspath(safefs.shown(a)) == os.path.abspath(safefs.shown(b))

def resolve(spec: str, out: str | Path, outside: bool = True, skipped: list[str] | None = None) -> Path | None:
    """--resume: "" (none), auto (what newest() says of --out, or none), or a checkpoint's folder or state.pt
    file, or an --out, its checkpoints folder or a run-<id> folder in it (its newest, as auto). The damaged
    checkpoints auto passed over are said in `skipped`."""
    if not spec:
        return None
    if spec == "auto":
        return newest(Path(out) / FOLDER, outside, skipped) if safefs.is_folder(Path(out) / FOLDER) else None
    path = Path(spec)
    if path.is_dir():
        if (path / "state.pt").is_file():
            path = path / "state.pt"
        else:
            base = path.parent if path.name == FOLDER else path
            path = (newest(base / FOLDER) if (base / FOLDER / OWNER).is_file() else None) or \
                next((p / "state.pt" for p in whole(base)[-1:]), path)
    if not path.is_file():
        raise UsageError(f"--resume {spec}: no checkpoint there (a step-N folder of --out/{FOLDER}, its state.pt, "
                         f"or auto)")
    return path


def head(path: Path) -> dict:
    """A checkpoint of multicard train, read lazily (its tensors stay on disk) and its place checked; one that
    is not, whose bytes are not those its save wrote, or whose place was edited into nonsense, is one line."""
    if wrong := foreign(path):
        raise UsageError(f"--resume {path}: not a readable checkpoint ({wrong}); resume from another checkpoint")
    if wrong := damage(path):
        raise UsageError(f"--resume {path}: damaged: {wrong}, so its bytes are not those its save wrote; resume "
                         f"from another checkpoint")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise UsageError(f"--resume {path}: not a readable checkpoint ({type(e).__name__}: {failed(e)}); resume "
                         f"from another checkpoint") from None
    if wrong := unplaced(raw):
        raise UsageError(f"--resume {path}: not a checkpoint of multicard train ({wrong})")
    if wrong := unsound(raw):
        raise UsageError(f"--resume {path}: {wrong}: not as multicard train writes it (edited or damaged); resume "
                         f"from another checkpoint")
    return raw


def count(value, low: int = 0, high: float = math.inf) -> bool:
    return type(value) is int and low <= value <= high


def unplaced(raw: object) -> str | None:
    """Why a file torch reads back is no checkpoint of multicard train (None: it is one)."""
    if not isinstance(raw, dict) or not {"loader", "steps", "config"} <= raw.keys():
        return "it has no place in the data"
    return None


def unsound(raw: dict) -> str | None:
    """What in a checkpoint's head cannot be (None: all can): types, and the place in the data against the
    steps taken and the epochs run."""
    config, place, history, steps = raw["config"], raw["loader"], raw.get("history"), raw["steps"]
    if not isinstance(config, dict) or not count(config.get("batch_size"), 1) or not count(config.get("epochs"), 1):
        return "its config's batch_size or epochs is not a positive whole number"
    if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
        return "its history is not a list of epoch records"
    if not count(steps):
        return f"its steps ({steps!r}) is not a whole number"
    if not isinstance(place, dict) or not count(place.get("epoch"), 0, config["epochs"]) or \
            len(history) > place["epoch"] + 1:
        return f"its epoch ({place.get('epoch') if isinstance(place, dict) else place!r}) does not fit its " \
               f"{len(history)} epoch record(s) of {config['epochs']}"
    if not count(place.get("samples"), 0, steps * config["batch_size"]):
        return f"its samples ({place.get('samples')!r}) is more than its {steps} steps could have served"
    if not isinstance(raw.get("run", ""), str):
        return "its run id is not text"
    return None

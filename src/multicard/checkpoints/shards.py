"""Checkpoints of a sharded model (fsdp): its parameters and its optimizers' state as torch.distributed.checkpoint
(DCP) writes them, each process its own part, into a folder beside the checkpoint file. DCP reads them back on
any number of processes (it reshards), which a file written by rank 0 alone could not hold.

Each save writes a folder of its own (ckpt.shards-<n>); the checkpoint file names it, and is replaced only after
the folder is whole, so a kill at any instant leaves the previous checkpoint and its folder as they were. Older
folders go once the new file is in place. Rank 0 makes the folder and holds it open; every other rank opens it by
name only where it is that very folder (its inode), and DCP writes through the descriptors (safefs.Folder), so a
folder renamed and replaced by a link meanwhile redirects nothing.

Reading them back unpickles nothing outside an allow-list (shards_read.py).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import safefs
from ..errors import UsageError
from .files import FULL
from .shards_read import METADATA_BASE, METADATA_PER_CHUNK, metadata, plain_files, planner, reader, tensors
from .sums import DCP_FILE


def folder(path: Path, save: int) -> Path:
    return path.with_name(f"{path.stem}.shards-{save}")


def is_shards_name(path: Path, name: str) -> bool:
    """Whether `name` is one a save of checkpoint `path` gives its folder (a name, never a path)."""
    return re.fullmatch(re.escape(f"{path.stem}.shards-") + r"\d+", name) is not None


def new_folder(path: Path, save: int) -> safefs.Folder:
    """Rank 0, before a save: a new folder for its shards, made here and now and held open (mkdir never goes
    through a link, nor into a folder already there: an earlier save's, still named by the checkpoint, or a
    user's)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # as a plain checkpoint's folder is made
    except OSError as e:
        raise UsageError(f"cannot write {safefs.shown(path)} ({e.strerror}); choose another place for the "
                         f"checkpoint") from None
    with safefs.Folder.open(path.parent, f"cannot write {safefs.shown(path)}: its folder") as parent:
        while True:
            name = folder(path, save).name
            try:
                return parent.make(name, f"shards folder {parent.shown / name}")
            except FileExistsError:
                save += 1
            except OSError as e:
                raise UsageError(f"cannot write {parent.shown / name} ({e.strerror}); choose another place for "
                                 f"the checkpoint") from None


def take(path: Path, name: str, ino: int) -> safefs.Folder:
    """Every other rank: the folder rank 0 made for this save (`ino`), held open; anything else under its name
    is one line."""
    with safefs.Folder.open(path.parent, f"cannot write {safefs.shown(path)}: its folder") as parent:
        return parent.take(name, f"shards folder {parent.shown / name}", ino)


def still_held(path: Path, held: safefs.Folder) -> bool:
    """Rank 0, once DCP has written: whether the name the checkpoint gives is still the folder written into."""
    with safefs.Folder.open(path.parent) as parent:
        return parent.holds(held.shown.name, held)


def split(state: dict[str, Any]) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
    models = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    if optimizers and len(models) != 1:
        raise UsageError(f"under fsdp, a checkpoint holds its optimizers with exactly one model; this one names "
                         f"{len(models)} models")
    return models, optimizers


def sharded_state(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {k: get_model_state_dict(m) for k, m in models.items()}
    for k, optimizer in optimizers.items():
        out[k] = get_optimizer_state_dict(next(iter(models.values())), optimizer)
    return out


def save(where: safefs.Folder, state: dict[str, Any], unwrap) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rank: write the models and optimizers of `state` into this save's folder, held open (`where`).
    Returns the rest of `state` (for the checkpoint file) and what the file must say of the folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    models, optimizers = split(state)
    try:
        dcp.save(sharded_state({k: unwrap(m) for k, m in models.items()}, optimizers), checkpoint_id=where.via)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException: every rank gets every rank's trace
        raise UsageError(f"cannot write {where.shown} ({written(e)}); the checkpoint before it is as it was") \
            from None
    rest = {k: v for k, v in state.items() if k not in models and k not in optimizers}
    return rest, {"folder": where.shown.name, "models": list(models), "optimizers": list(optimizers)}


def written(e: BaseException) -> str:
    """Why DCP could not write, in a few words: a full disk as the one line a plain checkpoint gives."""
    cause = failure(e)
    if isinstance(cause, OSError) and cause.errno in FULL:
        return f"{cause.strerror}: free space on that filesystem, or choose another place"
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return first_failure(e)


def drop_older(path: Path, keep: str) -> None:
    """Rank 0, once the checkpoint file names `keep`: the folders of earlier saves go, and only those: a real
    folder under a name a save gives, holding nothing but what DCP writes (a user's ckpt.shards-backup, a link,
    or a folder with anything else in it stays)."""
    for old in path.parent.glob(f"{path.stem}.shards-*"):
        if old.name != keep and is_shards_name(path, old.name) and safefs.is_folder(old) and \
                all(DCP_FILE.fullmatch(e.name) and safefs.kind(e) == "file" for e in old.iterdir()):
            shutil.rmtree(old, ignore_errors=True)


def load(path: Path, info: dict[str, Any], state: dict[str, Any], unwrap,
         sound: Callable[[Path], None] = lambda where: None) -> None:
    """Every rank: the models and optimizers of `state` from the folder the checkpoint names, resharded onto
    this job's processes. sound(folder): checks its files' sums, once the folder is known to be one DCP wrote
    and before DCP reads anything."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    models, optimizers = split(state)
    missing = [k for k in (*models, *optimizers) if k not in info["models"] + info["optimizers"]]
    if missing:
        raise UsageError(f"checkpoint {path}: has no {missing[0]!r} (its shards hold "
                         f"{', '.join(map(repr, info['models'] + info['optimizers']))})")
    where = located(path, info)
    models = {k: unwrap(m) for k, m in models.items()}
    target = sharded_state(models, optimizers)
    most = METADATA_BASE + METADATA_PER_CHUNK * tensors(target) * plain_files(where)
    crc = info["sums"].get(".metadata") if isinstance(info.get("sums"), dict) else None  # None: saved before sums
    metadata(where, limit=most, crc=crc)  # refused here, on every rank, before DCP reads anything
    sound(where)
    try:
        dcp.load(target, storage_reader=reader(where, most, crc), planner=planner())
    except UsageError:
        raise
    except (Exception, CheckpointException) as e:  # a missing or damaged folder, or shards of another model
        raise UsageError(f"checkpoint {path}: its shards in {info['folder']} cannot be read into this model "
                         f"({first_failure(e)})") from None
    for k, module in models.items():
        set_model_state_dict(module, target[k])
    for k, optimizer in optimizers.items():
        set_optimizer_state_dict(next(iter(models.values())), optimizer, target[k])


def failure(e: BaseException) -> BaseException:
    """For a CheckpointException, the first rank's own error (not its traces); else `e`."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:
        return e.failures[min(e.failures)][0]
    return e


def located(path: Path, info: dict[str, Any]) -> Path:
    """The shards folder checkpoint `path` names: a name a save gives, beside it (never a path read elsewhere)."""
    if not isinstance(info.get("folder"), str) or not is_shards_name(path, info["folder"]):
        raise UsageError(f"checkpoint {path}: its shards folder is not one multicard names "
                         f"({str(info.get('folder'))[:100]!r}); not as multicard wrote it")
    return path.parent / info["folder"]


def first_failure(e: BaseException) -> str:
    """One line for what DCP raised."""
    e = failure(e)
    if isinstance(e, UsageError):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"

"""Checkpoints of a sharded model (fsdp): its parameters and its optimizers' state as torch.distributed.checkpoint
(DCP) writes them, each process its own part, into a folder beside the checkpoint file. DCP reads them back on
any number of processes (it reshards), which a file written by rank 0 alone could not hold.

Each save writes a folder of its own (ckpt.shards-<n>); the checkpoint file names it, and is replaced only after
the folder is whole, so a kill at any instant leaves the previous checkpoint and its folder as they were. Older
folders go once the new file is in place. Rank 0 makes the folder and holds it open; every other rank opens it by
name only where it is that very folder (its inode), and DCP writes through the descriptors (safefs.Folder), so a
folder renamed and replaced by a link meanwhile redirects nothing.

Reading them back unpickles nothing outside an allow-list: DCP reads its `.metadata` with plain pickle and the
non-tensor values (the optimizers' settings) with torch.load(weights_only=False), so a planted file would run
code on every rank. Here the metadata goes through an unpickler that knows only DCP's own metadata classes, torch
sizes, dtypes and layouts; the values through torch.load(weights_only=True).
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import safefs
from ..errors import UsageError
from .plain import FULL
from .sums import DCP_FILE, said

# largest .metadata read: DCP's index of every tensor chunk, a few hundred bytes each: a base, and this much per
# tensor of the state for each process that wrote a part (each writes one __<rank>_0.distcp)
METADATA_BASE, METADATA_PER_CHUNK = 1 << 20, 4096


def folder(path: Path, save: int) -> Path:
    return path.with_name(f"{path.stem}.shards-{save}")


def is_shards_name(path: Path, name: str) -> bool:
    """Whether `name` is one a save of checkpoint `path` gives its folder (a name, never a path)."""
    return re.fullmatch(re.escape(f"{path.stem}.shards-") + r"\d+", name) is not None


def fresh(path: Path, save: int) -> safefs.Folder:
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


def still(path: Path, held: safefs.Folder) -> bool:
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
    except BaseException as e:  # DCP's CheckpointException is a BaseException: every rank gets every rank's trace
        if not isinstance(e, (Exception, CheckpointException)):
            raise
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
    except BaseException as e:  # a missing or damaged folder, or shards of another model (DCP's
        if not isinstance(e, (Exception, CheckpointException)):  # CheckpointException is a BaseException)
            raise
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
        return next(iter(sorted(e.failures.items(), key=lambda item: item[0])))[1][0]
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


def plain_files(where: Path) -> int:
    """Every entry of a shards folder is a regular file (DCP writes nothing else): a FIFO would hang DCP's read,
    a link could point anywhere. Anything else is one line. Returns how many there are."""
    if not safefs.is_folder(where):
        raise UsageError(f"shards folder {where}: is {safefs.kind(where) or 'missing'}, not a folder multicard "
                         f"wrote")
    entries = list(where.iterdir())
    for entry in entries:
        found = safefs.kind(entry)
        if found != "file":
            raise UsageError(f"shards folder {where}: {entry.name} is a {found}, not a file DCP writes; move it "
                             f"elsewhere")
    return len(entries)


# the globals a .metadata that DCP wrote names (torch 2.4-2.13): its dataclasses, torch.Size, a dtype, a layout by
# name, the memory-format enum, and the path it was saved under
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}


class Restricted(pickle.Unpickler):
    """Unpickles only ALLOWED and torch's dtypes; any other global is refused before it is imported."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not dtype and name not in ALLOWED.get(module, ()):
            raise pickle.UnpicklingError(f"{module}.{name} is not among the types a shards folder may hold")
        return getattr(importlib.import_module(module), name)


def tensors(state: Any) -> int:
    """How many tensors a (nested) state dict holds."""
    if isinstance(state, dict):
        return sum(tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensors(v) for v in state)
    return int(isinstance(state, torch.Tensor))


def metadata(where: Path, name: str = ".metadata", limit: int = METADATA_BASE, crc: Any = None):
    """The shards folder's DCP metadata, read with the restricted unpickler; anything else is one line. `limit`:
    the most bytes a model's metadata can take (more is not DCP's, and is not read). `crc`: the CRC-32 its save
    recorded of .metadata: bytes that differ are damage, said so, before anything is unpickled."""
    from torch.distributed.checkpoint.metadata import Metadata

    if safefs.kind(where / name) is None:
        raise UsageError(f"shards folder {where}: no {name}")
    raw = safefs.read_bytes(where / name, limit, f"shards folder {where}: {name}")  # no FIFO, link, or 10 GB
    if type(crc) is int and name == ".metadata" and zlib.crc32(raw) != crc:
        raise UsageError(said(f"shards folder {where}", f"its {name} fails its CRC-32"))
    try:
        found = Restricted(io.BytesIO(raw)).load()
    except Exception as e:  # pickle raises many kinds for a damaged or foreign file
        raise UsageError(f"shards folder {where}: its .metadata is refused ({str(e)[:200] or type(e).__name__}); "
                         f"multicard loads only what torch.distributed.checkpoint itself writes") from None
    if not isinstance(found, Metadata):
        raise UsageError(f"shards folder {where}: its .metadata holds a {type(found).__name__}, not DCP's metadata")
    return found


def reader(where: Path, limit: int = METADATA_BASE, crc: Any = None):
    """DCP's file reader, reading its metadata through `metadata` (so what DCP uses is what was checked)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            found = metadata(where, Path(self._get_metadata_path(kwargs.get("rank"))).name, limit, crc)
            if getattr(found, "storage_meta", None) is None:
                found.storage_meta = StorageMeta()
            found.storage_meta.load_id = self.load_id
            return found

    return Reader(where)


def planner():
    """DCP's default load planner, reading non-tensor values with weights_only=True."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                checked = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise UsageError(f"a shards folder holds a value multicard does not load ({refusal(e)})") from None
            safe = io.BytesIO()  # what the default planner reads back (with weights_only=False): checked values only
            torch.save(checked, safe)
            safe.seek(0)
            super().load_bytes(read_item, safe)

    return Planner()


def refusal(e: Exception) -> str:
    """What torch's weights_only unpickler refused, without the advice torch gives beside it (to load the file
    with weights_only=False: never, for a file that failed the checks)."""
    said = re.search(r"WeightsUnpickler error: (.*?)(?:\.\s|$)", str(e), re.S)  # torch 2.4-2.12
    parts = [said.group(1)] if said else re.split(r"\n\s*\n", str(e))  # torch 2.13: the advice, then the refusal
    for part in parts:
        if part.strip() and not re.search(r"weights_only|documentation|Weights only load failed", part):
            return part.strip().splitlines()[0][:200]
    return "a type outside torch's allow-list"

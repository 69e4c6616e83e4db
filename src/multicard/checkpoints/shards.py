"""Checkpoints of a sharded model (fsdp): its parameters and its optimizers' state as torch.distributed.checkpoint
(DCP) writes them, each process its own part, into a folder beside the checkpoint file. DCP reads them back on
any number of processes (it reshards), which a file written by rank 0 alone could not hold.

Each save writes a folder of its own (ckpt.shards-<n>); the checkpoint file names it, and is replaced only after
the folder is whole, so a kill at any instant leaves the previous checkpoint and its folder as they were. Older
folders go once the new file is in place.

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
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import safefs
from ..errors import UsageError

# largest .metadata read: DCP's index of every tensor chunk, a few hundred bytes each: a base, and this much per
# tensor of the state for each process that wrote a part (each writes one __<rank>_0.distcp)
METADATA_BASE, METADATA_PER_CHUNK = 1 << 20, 4096
DCP_FILE = re.compile(r"\.metadata|__\d+_\d+\.distcp")  # what DCP's file writer puts in a folder


def folder(path: Path, save: int) -> Path:
    return path.with_name(f"{path.stem}.shards-{save}")


def is_shards_name(path: Path, name: str) -> bool:
    """Whether `name` is one a save of checkpoint `path` gives its folder (a name, never a path)."""
    return re.fullmatch(re.escape(f"{path.stem}.shards-") + r"\d+", name) is not None


def fresh(path: Path, save: int) -> Path:
    """Rank 0, before a save: a new folder for its shards, made here and now (mkdir never goes through a link,
    nor into a folder already there: an earlier save's, still named by the checkpoint, or a user's)."""
    while True:
        target = folder(path, save)
        try:
            target.mkdir()
            return target
        except FileExistsError:
            save += 1
        except OSError as e:
            raise UsageError(f"cannot write {target} ({e.strerror}); choose another place for the checkpoint") \
                from None


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


def save(path: Path, name: str, state: dict[str, Any], unwrap) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rank: write the models and optimizers of `state` into this save's folder `name` (made by rank 0 with
    fresh()). Returns the rest of `state` (for the checkpoint file) and what the file must say of the folder."""
    import torch.distributed.checkpoint as dcp

    models, optimizers = split(state)
    target = path.with_name(name)
    dcp.save(sharded_state({k: unwrap(m) for k, m in models.items()}, optimizers), checkpoint_id=target)
    rest = {k: v for k, v in state.items() if k not in models and k not in optimizers}
    return rest, {"folder": target.name, "models": list(models), "optimizers": list(optimizers)}


def drop_older(path: Path, keep: str) -> None:
    """Rank 0, once the checkpoint file names `keep`: the folders of earlier saves go, and only those: a real
    folder under a name a save gives, holding nothing but what DCP writes (a user's ckpt.shards-backup, a link,
    or a folder with anything else in it stays)."""
    for old in path.parent.glob(f"{path.stem}.shards-*"):
        if old.name != keep and is_shards_name(path, old.name) and safefs.is_folder(old) and \
                all(DCP_FILE.fullmatch(e.name) and safefs.kind(e) == "file" for e in old.iterdir()):
            shutil.rmtree(old, ignore_errors=True)


def load(path: Path, info: dict[str, Any], state: dict[str, Any], unwrap) -> None:
    """Every rank: the models and optimizers of `state` from the folder the checkpoint names, resharded onto
    this job's processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    models, optimizers = split(state)
    missing = [k for k in (*models, *optimizers) if k not in info["models"] + info["optimizers"]]
    if missing:
        raise UsageError(f"checkpoint {path}: has no {missing[0]!r} (its shards hold "
                         f"{', '.join(map(repr, info['models'] + info['optimizers']))})")
    if not isinstance(info.get("folder"), str) or not is_shards_name(path, info["folder"]):
        raise UsageError(f"checkpoint {path}: its shards folder is not one multicard names "
                         f"({str(info.get('folder'))[:100]!r}); not as multicard wrote it")
    models = {k: unwrap(m) for k, m in models.items()}
    target = sharded_state(models, optimizers)
    where = path.parent / info["folder"]  # a name checked above: beside the checkpoint, never elsewhere
    most = METADATA_BASE + METADATA_PER_CHUNK * tensors(target) * plain_files(where)
    metadata(where, limit=most)  # refused here, on every rank, before DCP reads anything
    try:
        dcp.load(target, storage_reader=reader(where, most), planner=planner())
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


def first_failure(e: BaseException) -> str:
    """One line for what DCP raised: for a CheckpointException, the first rank's own error, not its traces."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:
        rank, (cause, _) = next(iter(sorted(e.failures.items())))
        if isinstance(cause, UsageError):
            return str(cause)
        e = cause
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


def metadata(where: Path, name: str = ".metadata", limit: int = METADATA_BASE):
    """The shards folder's DCP metadata, read with the restricted unpickler; anything else is one line. `limit`:
    the most bytes a model's metadata can take (more is not DCP's, and is not read)."""
    from torch.distributed.checkpoint.metadata import Metadata

    if safefs.kind(where / name) is None:
        raise UsageError(f"shards folder {where}: no {name}")
    raw = safefs.read_bytes(where / name, limit, f"shards folder {where}: {name}")  # no FIFO, link, or 10 GB
    try:
        found = Restricted(io.BytesIO(raw)).load()
    except Exception as e:  # pickle raises many kinds for a damaged or foreign file
        raise UsageError(f"shards folder {where}: its .metadata is refused ({str(e)[:200] or type(e).__name__}); "
                         f"multicard loads only what torch.distributed.checkpoint itself writes") from None
    if not isinstance(found, Metadata):
        raise UsageError(f"shards folder {where}: its .metadata holds a {type(found).__name__}, not DCP's metadata")
    return found


def reader(where: Path, limit: int = METADATA_BASE):
    """DCP's file reader, reading its metadata through `metadata` (so what DCP uses is what was checked)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            found = metadata(where, Path(self._get_metadata_path(kwargs.get("rank"))).name, limit)
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
                raise UsageError(f"a shards folder holds a value multicard does not load ({str(e)[:200]})") from None
            safe = io.BytesIO()  # what the default planner reads back (with weights_only=False): checked values only
            torch.save(checked, safe)
            safe.seek(0)
            super().load_bytes(read_item, safe)

    return Planner()

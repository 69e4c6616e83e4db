"""Reading fsdp's shards back without running anything a planted file holds. torch.distributed.checkpoint (DCP)
reads its `.metadata` with plain pickle and the non-tensor values (the optimizers' settings) with
torch.load(weights_only=False), so a planted file would run code on every rank. Here the folder holds plain files
only, the metadata goes through an unpickler that knows only DCP's own metadata classes, torch sizes, dtypes and
layouts (and its CRC-32 is checked first), and the values through torch.load(weights_only=True).
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
import zlib
from pathlib import Path
from typing import Any

import torch

from .. import safefs
from ..errors import UsageError
from ..jobs.trees import values
from .sums import said

# largest .metadata read: DCP's index of every tensor chunk, a few hundred bytes each: a base, and this much per
# tensor of the state for each process that wrote a part (each writes one __<rank>_0.distcp)
METADATA_BASE, METADATA_PER_CHUNK = 1 << 20, 4096


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
    return sum(isinstance(v, torch.Tensor) for v in values(state))


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

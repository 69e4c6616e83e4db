"""Whether a checkpoint's files hold the bytes its save wrote: a flipped bit or a file cut short is one line
naming the file, never weights loaded silently.

A file torch.save writes (model.pt, state.pt, mc.save's file) is a zip archive whose directory records a CRC-32 of
every entry; torch computes them on save and never checks them on load. Here every entry is read and checked
against its record before torch.load reads the file: a sum that lives in the file's own directory, apart from the
bytes it covers, and that checkpoints written before this check carry too. fsdp's shard files (DCP's) record
none: each rank sums the files it wrote, and the checkpoint file rank 0 writes keeps those sums.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .. import safefs
from ..errors import UsageError

ZIP = b"PK\x03\x04"  # how a zip archive (torch.save's format since torch 1.6) begins
CHUNK = 1 << 22
HOLES = 64 << 20  # a file with more holes than this and than data is sparse: no save writes one (a filesystem
# that compresses stores a checkpoint's floats at nearly their size; its zero pages alone may become holes)
DCP_FILE = re.compile(r"\.metadata|__\d+_\d+\.distcp")  # what DCP's file writer puts in a folder


@contextlib.contextmanager
def recorded() -> Iterator[None]:
    """torch.save computes its CRC-32s here even where the process turned them off (torch 2.6+ can)."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    if get is None or get():
        yield
        return
    torch.serialization.set_crc32_options(True)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(False)


def damage(source: Path | BinaryIO) -> str | None:
    """What in a file torch.save wrote does not match its CRC-32s (None: all do; or it is not a zip archive,
    torch's format before 1.6, or was saved without sums: nothing to check it against)."""
    with open(source, "rb") if isinstance(source, Path) else contextlib.nullcontext(source) as f:
        f.seek(0)
        if f.read(4) != ZIP:
            return None
        try:
            archive = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError):  # no directory to check against: torch.load
            return None  # says it is not a checkpoint it can read
        try:
            with archive:
                entries = archive.infolist()
                if wrong := overdrawn(f, sum(e.file_size for e in entries)):
                    return wrong
                if all(e.CRC == 0 for e in entries if e.file_size):  # saved with torch's CRC-32s turned off
                    return None
                for entry in entries:
                    with archive.open(entry) as data:
                        while data.read(CHUNK):
                            pass
        except zipfile.BadZipFile as e:
            text = str(e)
            entry = re.search(r"'([^']*)'", text)
            if text.startswith("Bad CRC-32") and entry:
                return f"its {entry.group(1).split('/', 1)[-1]} fails its CRC-32"
            return f"its zip structure is damaged or cut short ({text[:120]})"
        except (OSError, EOFError, ValueError, zlib.error) as e:
            return f"its zip structure is damaged or cut short ({type(e).__name__})"
        finally:
            f.seek(0)
    return None


def overdrawn(f: BinaryIO, recorded: int) -> str | None:
    """Why reading the `recorded` bytes a file's own directory records for its entries would read more than the
    file holds (None: it would not), checked before a byte of them is read: entries that record more than the
    file's size (cut short, or compressed: torch.save stores every entry as it is), or a file mostly holes (a
    sparse file, which torch.save never writes: reading a stranger's 1 TB of them would take an hour)."""
    size = f.seek(0, os.SEEK_END)
    if recorded > size:
        return f"its entries record {recorded:,} bytes, more than the file's {size:,} (cut short, or not torch.save's)"
    return sparse(f)


def sparse(f: BinaryIO | int) -> str | None:
    """Why a file is no checkpoint torch or DCP wrote, where most of it is holes (None: it is not sparse, or the
    system does not say: a stream in memory)."""
    try:
        info = os.fstat(f if isinstance(f, int) else f.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None
    on_disk = info.st_blocks * 512
    if info.st_size - on_disk > max(HOLES, on_disk):
        return f"{info.st_size:,} bytes of which {on_disk:,} are on disk: a sparse file, which no save writes"
    return None


def check(source: Path | BinaryIO, what: str) -> None:
    """One line naming `what` where its bytes are not those its save wrote."""
    found = damage(source)
    if found:
        raise UsageError(said(what, found))


def said(what: str, found: str) -> str:
    return f"{what}: damaged: {found}, so its bytes are not those its save wrote; load an earlier checkpoint, or " \
        f"write this one again"


def of_file(fd: int) -> int:
    """The CRC-32 of what `fd` reads; the descriptor is closed."""
    crc = 0
    try:
        while chunk := os.read(fd, CHUNK):
            crc = zlib.crc32(chunk, crc)
    finally:
        os.close(fd)
    return crc


def of_files(folder: safefs.Folder, rank: int) -> dict[str, int]:
    """Rank `rank`, once DCP has saved into `folder`: the CRC-32 of each file it wrote there (its own
    __<rank>_<n>.distcp; rank 0 also the .metadata)."""
    mine = re.compile(rf"__{rank}_\d+\.distcp" + (r"|\.metadata" if rank == 0 else ""))
    return {name: of_file(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder.fd))
            for name in os.listdir(folder.fd) if mine.fullmatch(name)}


def files_damage(where: Path, recorded: Any, rank: int = 0, world: int = 1) -> str | None:
    """What of the shard files in `where` does not match the sums the checkpoint recorded (None: all that this
    rank checks do; rank r of `world` checks every world-th file, so that each is read once). A checkpoint
    written before sums were recorded has none: nothing to check."""
    if recorded is None:
        return None
    if not isinstance(recorded, dict) or not all(isinstance(k, str) and DCP_FILE.fullmatch(k) and type(v) is int
                                                 for k, v in recorded.items()):
        return "its record of the shard files' sums is not as multicard writes it"
    for name in sorted(recorded)[rank::world]:
        try:
            fd = os.open(where / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            return f"its shard file {name} cannot be read ({e.strerror})"
        if holes := sparse(fd):
            os.close(fd)
            return f"its shard file {name} is {holes}"
        if of_file(fd) != recorded[name]:
            return f"its shard file {name} fails its CRC-32"
    return None


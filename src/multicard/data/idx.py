"""MNIST and Fashion-MNIST from their four IDX files: found in --data-dir, or downloaded (opt-in, checksummed).

Everything read is checked: magic number, 28x28 images, at most MAX_ITEMS, exact file size, image and label counts
agree, labels in 0-9. The header is checked before the data is read, and no more data than it promises is read.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import math
import os
import shutil
import urllib.request
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from ..errors import UsageError
from ..jobs.protocol import CACHE
from .headroom import available_memory  # the machine's, a container's limit, ulimit -v: the least
from .images import ImageData

IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049
SPLITS = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}

# name -> (mirrors, md5 of each .gz as published, normalization mean and std)
SOURCES = {
    "mnist": (("https://ossci-datasets.s3.amazonaws.com/mnist/",
               "https://storage.googleapis.com/cvdf-datasets/mnist/"),
              {"train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
               "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
               "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
               "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c"}, 0.1307, 0.3081),
    "fashion-mnist": (("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
                      {"train-images-idx3-ubyte": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                       "train-labels-idx1-ubyte": "25c81989df183df01b3e8a0aad5dffbe",
                       "t10k-images-idx3-ubyte": "bef4ecab320f06d8554ea6380940ec79",
                       "t10k-labels-idx1-ubyte": "bb300cfdad3c16e7a12a480ee83cd310"}, 0.2860, 0.3530),
}


def cache_dir(name: str) -> Path:
    root = os.environ.get(CACHE) or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(root) / "multicard" / name


# Most images (and labels) one file may claim: ~67x MNIST's 60000, 3.1 GB of pixels (12.5 GB once normalized to
# float32). The header is checked against it before anything is read, so a few bytes cannot claim terabytes.
MAX_ITEMS = 4_000_000
HELD = {IMAGES_MAGIC: 5, LABELS_MAGIC: 9}  # bytes held per item byte once read: uint8, then float32 / int64 copies
CHUNK = 1 << 20  # read 1 MiB at a time, so a .gz never holds much more than the array it fills
LEFTOVER = 1 << 16  # bytes past the promised end counted before giving up: a .gz can expand to GBs more


def read_idx(path: Path, magic: int) -> np.ndarray:
    """Read one IDX file (gzipped or not): check its header alone first, then read exactly the bytes it promises,
    so no file costs more memory than a valid one of its claimed shape (a .gz bomb is refused, not expanded)."""
    try:
        with open(path, "rb") as plain:
            gzipped = plain.read(2) == b"\x1f\x8b"
            plain.seek(0)
            f = gzip.GzipFile(fileobj=plain) if gzipped else plain
            shape = read_header(f, path, magic)
            if not gzipped and (size := os.fstat(plain.fileno()).st_size) != idx_size(shape):
                raise wrong_size(path, shape, size)  # a plain file's size is known without reading it
            # the memory is only promised here (pages are taken as the stream fills them, and a stream shorter
            # than its header is refused when it ends), but the data a true header brings must fit
            fits(path, shape, math.prod(shape) * HELD[magic])
            try:
                array = np.empty(shape, np.uint8)
            except MemoryError:
                raise UsageError(f"{path}: its header {shape} needs {idx_size(shape)} bytes of memory, "
                                 f"more than this machine gives") from None
            flat, got = memoryview(array.reshape(-1)), 0
            while got < len(flat) and (n := f.readinto(flat[got: got + CHUNK])):
                got += n
            if got < len(flat):
                raise wrong_size(path, shape, idx_size(shape) - len(flat) + got)
            extra = len(f.read(LEFTOVER))  # reading to the end also checks a .gz's CRC
            if extra:
                raise wrong_size(path, shape, idx_size(shape) + extra, at_least=extra == LEFTOVER)
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise UsageError(f"{path}: cannot read: {e}") from None
    return array


def read_header(f: BinaryIO, path: Path, magic: int) -> tuple[int, ...]:
    """The shape an IDX header claims, refused unless it is 28x28 images (or labels), at most MAX_ITEMS of them."""
    kind, dims = ("images", 3) if magic == IMAGES_MAGIC else ("labels", 1)
    header = f.read(4 + 4 * dims)
    if len(header) < 4 + 4 * dims:
        raise UsageError(f"{path}: truncated: {len(header)} bytes, shorter than the IDX header")
    found = int.from_bytes(header[:4], "big")
    if found != magic:
        raise UsageError(f"{path}: bad magic number {found}, expected {magic} ({kind} IDX file)")
    shape = tuple(int.from_bytes(header[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    if dims == 3 and shape[1:] != (28, 28):
        raise UsageError(f"{path}: images are {shape[1]}x{shape[2]}, expected 28x28")
    if shape[0] > MAX_ITEMS:
        raise UsageError(f"{path}: header claims {shape[0]} {kind}, more than the {MAX_ITEMS} this reader takes "
                         f"(MNIST has 60000)")
    return shape


def fits(path: Path, shape: tuple[int, ...], need: int) -> None:
    """Refuse, before anything is allocated, a file whose data would not fit in the memory available now: it
    would be read for minutes and then end in the system's out-of-memory killer, without a word."""
    free = available_memory()
    if free is not None and need > free:
        raise UsageError(f"{path}: its header {shape} needs {need / 2**30:.2f} GiB of memory once read, more than "
                         f"the {free / 2**30:.2f} GiB available")


def idx_size(shape: tuple[int, ...]) -> int:
    return 4 + 4 * len(shape) + math.prod(shape)


def wrong_size(path: Path, shape: tuple[int, ...], size: int, at_least: bool = False) -> UsageError:
    return UsageError(f"{path}: size {'at least ' if at_least else ''}{size} bytes, but its header {shape} "
                      f"needs exactly {idx_size(shape)}")


def find(folder: Path, stem: str) -> Path | None:
    return next((folder / name for name in (stem, stem + ".gz") if (folder / name).is_file()), None)


def load_split(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    image_path, label_path = (find(folder, stem) for stem in SPLITS[split])
    images = read_idx(image_path, IMAGES_MAGIC)
    labels = read_idx(label_path, LABELS_MAGIC)
    if len(images) != len(labels):
        raise UsageError(f"{label_path}: {len(labels)} labels for {len(images)} images in {image_path}")
    if len(labels) and labels.max() > 9:
        raise UsageError(f"{label_path}: label {labels.max()} out of range 0-9")
    # read_idx gives a fresh writable array, so torch can share it rather than copy
    return torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


def missing(folder: Path) -> list[str]:
    return [stem for pair in SPLITS.values() for stem in pair if find(folder, stem) is None]


def load(name: str, data_dir: str | None, download: bool, augment: bool = False) -> tuple[ImageData, ImageData]:
    mirrors, md5s, mean, std = SOURCES[name]
    folder = Path(data_dir) if data_dir else cache_dir(name)
    if data_dir and not folder.is_dir():
        raise UsageError(f"--data-dir {data_dir}: no such folder")
    if missing(folder) and download:
        folder = cache_dir(name)
        fetch(folder, mirrors, md5s)
    if lacking := missing(folder):
        raise UsageError(f"{name}: {', '.join(s + '[.gz]' for s in lacking)} not found in {folder}; "
                         f"put the four IDX files there (--data-dir), or add --download")
    (xtr, ytr), (xte, yte) = load_split(folder, "train"), load_split(folder, "test")
    return ImageData(xtr, ytr, mean, std, augment), ImageData(xte, yte, mean, std)


def fetch(folder: Path, mirrors: tuple[str, ...], md5s: dict[str, str]) -> None:
    """Download each missing .gz into `folder`, keeping it only if its md5 matches the published one."""
    folder.mkdir(parents=True, exist_ok=True)
    for stem in missing(folder):
        errors = []
        for base in mirrors:
            url, part = base + stem + ".gz", folder / (stem + ".gz.part")
            try:
                with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as f:
                    shutil.copyfileobj(response, f)
            except (OSError, http.client.HTTPException) as e:  # a cut connection is an HTTPException
                part.unlink(missing_ok=True)
                errors.append(f"{url}: {e}")
                continue
            except BaseException:  # Ctrl-C: leave no half file behind
                part.unlink(missing_ok=True)
                raise
            digest = hashlib.md5(part.read_bytes()).hexdigest()
            if digest == md5s[stem]:
                os.replace(part, folder / (stem + ".gz"))
                break
            part.unlink()
            errors.append(f"{url}: md5 {digest}, expected {md5s[stem]}")
        else:
            raise UsageError(f"download of {stem}.gz failed: {'; '.join(errors)}")

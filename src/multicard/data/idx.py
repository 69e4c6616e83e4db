"""MNIST and Fashion-MNIST from their four IDX files: found in --data-dir, or downloaded (opt-in, checksummed).

Everything read is checked: magic number, exact file size, image and label counts agree, labels in 0-9.
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

import numpy as np
import torch

from ..errors import UsageError
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
    root = os.environ.get("MULTICARD_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(root) / "multicard" / name


def read_idx(path: Path, magic: int) -> np.ndarray:
    """Read one IDX file (gzipped or not) and check its magic number and exact size."""
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        raw = gzip.open(path).read() if gzipped else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise UsageError(f"{path}: cannot read: {e}") from None
    dims = 3 if magic == IMAGES_MAGIC else 1
    head = 4 + 4 * dims
    if len(raw) < head:
        raise UsageError(f"{path}: truncated: {len(raw)} bytes, shorter than the IDX header")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise UsageError(f"{path}: bad magic number {found}, expected {magic} "
                         f"({'images' if magic == IMAGES_MAGIC else 'labels'} IDX file)")
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    want = head + math.prod(shape)
    if len(raw) != want:
        raise UsageError(f"{path}: size {len(raw)} bytes, but its header {shape} needs exactly {want}")
    return np.frombuffer(raw, dtype=np.uint8, offset=head).reshape(shape)


def find(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def load_split(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    image_stem, label_stem = SPLITS[split]
    image_path, label_path = find(folder, image_stem), find(folder, label_stem)
    images = read_idx(image_path, IMAGES_MAGIC)
    labels = read_idx(label_path, LABELS_MAGIC)
    if images.shape[1:] != (28, 28):
        raise UsageError(f"{image_path}: images are {images.shape[1]}x{images.shape[2]}, expected 28x28")
    if len(images) != len(labels):
        raise UsageError(f"{label_path}: {len(labels)} labels for {len(images)} images in {image_path}")
    if len(labels) and labels.max() > 9:
        raise UsageError(f"{label_path}: label {labels.max()} out of range 0-9")
    return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


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

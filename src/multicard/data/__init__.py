"""Datasets by name (mnist-5k, IDX, synthetic), the global data order, and the loaders and pipelines that deal
it out over processes. May import errors, rules, jobs and strategies; never models, checkpoints or yourloop/."""

from __future__ import annotations

from .. import rules
from ..errors import UsageError
from .images import ImageData

NAMES = ("mnist-5k", "mnist", "fashion-mnist", "synthetic")


def load(name: str, data_dir: str | None = None, download: bool = False, augment: bool = False,
         synthetic_samples: int = 8192, seed: int = 0,
         shape: tuple[int, ...] = (1, 28, 28)) -> tuple[ImageData, ImageData]:
    """(train, test) for a dataset name; `augment` applies to the training side only; `shape` is the
    synthetic sample shape (the others are 1x28x28)."""
    if name == "mnist-5k":
        from . import mnist5k

        return mnist5k.load(augment)
    if name in ("mnist", "fashion-mnist"):
        from . import idx

        return idx.load(name, data_dir, download, augment)
    if name == "synthetic":
        from . import synthetic

        rules.at_least(synthetic_samples, f"--synthetic-samples {synthetic_samples}", 1)
        return synthetic.load(synthetic_samples, shape, seed=seed)
    raise UsageError(f"--data {name}: unknown; choose one of {', '.join(NAMES)}")


__all__ = ["NAMES", "ImageData", "load"]

"""A run's checkpoints in --out/checkpoints: writing one as a whole, keeping the newest few, and finding the one
--resume names.

Each checkpoint is a folder, step-<optimizer steps>, holding state.pt (rank 0: model, optimizer, scheduler,
scaler, the place in the data, the epochs so far, rank 0's random streams) and state.rank<r>.pt (rank r's random
streams). It is written as step-N.part and renamed only once every rank has written its part: a kill at any
instant leaves the checkpoints before it whole, and only whole ones are ever resumed from.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from .config import TrainConfig
from .errors import UsageError
from .front import Multicard

FOLDER = "checkpoints"
NAME = re.compile(r"step-(\d+)")


def whole(out: str | Path) -> list[Path]:
    """The complete checkpoints in --out, oldest first."""
    found = [(int(m.group(1)), p) for p in (Path(out) / FOLDER).glob("step-*")
             if (m := NAME.fullmatch(p.name)) and (p / "state.pt").is_file()]
    return [p for _, p in sorted(found)]


def write(mc: Multicard, out: str | Path, steps: int, state: dict, keep: int) -> None:
    """Every rank: its part of checkpoint step-<steps>; then rank 0 makes it whole and drops the oldest beyond
    `keep` (0: none dropped)."""
    final = Path(out) / FOLDER / f"step-{steps:08d}"
    part = final.with_name(final.name + ".part")
    mc.save(part / "state.pt", state)
    mc.barrier()  # every rank's part is on disk
    if mc.is_main:
        if final.exists():  # written by an earlier attempt that went past this step: replaced whole
            drop(final)
        os.replace(part, final)
        for old in whole(out)[:-keep] if keep else []:
            drop(old)


def drop(checkpoint: Path) -> None:
    """Out of the list of whole checkpoints at once (one rename), then deleted: a kill half-way through the
    deletion leaves no checkpoint that looks whole and is not."""
    gone = checkpoint.with_name(f"{checkpoint.name}.dropped.part")
    os.replace(checkpoint, gone)
    shutil.rmtree(gone, ignore_errors=True)


def resolve(spec: str, out: str | Path) -> Path | None:
    """--resume: "" (none), auto (the newest whole checkpoint in --out, or none), or a checkpoint's folder or
    state.pt file, or a folder of checkpoints (its newest)."""
    if not spec:
        return None
    if spec == "auto":
        found = whole(out)
        return found[-1] / "state.pt" if found else None
    path = Path(spec)
    if path.is_dir():
        found = whole(path.parent if path.name == FOLDER else path)
        path = path / "state.pt" if (path / "state.pt").is_file() else found[-1] / "state.pt" if found else path
    if not path.is_file():
        raise UsageError(f"--resume {spec}: no checkpoint there (a step-N folder of --out/{FOLDER}, its state.pt, "
                         f"or auto)")
    return path


def head(path: Path) -> dict:
    """A checkpoint of multicard train, read lazily (its tensors stay on disk); one that is not is one line."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise UsageError(f"--resume {path}: not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(raw, dict) or not {"loader", "steps", "config"} <= raw.keys():
        raise UsageError(f"--resume {path}: not a checkpoint of multicard train (it has no place in the data)")
    return raw


def inherit(path: Path, config: TrainConfig) -> TrainConfig:
    """`config` with the batch and the rate of the run that wrote checkpoint `path` where they are auto: a run
    resumed on another number of processes goes on with the global batch it had (256 rounded to its processes)."""
    if config.batch_size is not None and config.lr is not None:
        return config
    saved = head(path)["config"]
    return replace(config, batch_size=saved["batch_size"] if config.batch_size is None else config.batch_size,
                   lr=saved["lr"] if config.lr is None else config.lr)


def describe(path: Path, global_batch: int) -> str:
    """Check that a checkpoint can continue this run (before any process starts); say where it stopped."""
    raw = head(path)
    saved = raw["config"]["batch_size"]
    if saved != global_batch:
        raise UsageError(f"--resume {path}: that run's global batch was {saved}, this one's is {global_batch}: "
                         f"resume with --batch-size {saved} (the data order continues by global batches)")
    place = raw["loader"]
    return f"epoch {place['epoch'] + 1}, {place['samples']} samples in, after {raw['steps']} optimizer steps"

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
from dataclasses import fields, replace
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


# A resumed run is the run it continues: it takes that run's recipe unless a flag says otherwise. These cannot
# change half-way (the data order, the weights' history and the schedule's state depend on them): given otherwise,
# they are refused. The global batch is checked by describe(), once it is settled for the job.
KEPT = ("model", "data", "synthetic_samples", "seed", "augment", "optimizer", "lr", "momentum", "nesterov",
        "weight_decay", "scheduler", "lr_step", "lr_gamma", "warmup_epochs")
# these may change on a resume; a change is said in the "resuming from" line (epochs: see inherit)
CHANGEABLE = ("batch_size", "epochs", "accumulate", "precision", "clip_grad_norm", "sync_bn", "eval_batch_size",
              "save_every", "save_every_steps", "keep_checkpoints")
STRETCHED = ("onecycle", "cosine")  # schedules laid over the run's whole length


def inherit(path: Path, config: TrainConfig, given: set[str] | None = None) -> TrainConfig:
    """`config` with the recipe of the run that wrote checkpoint `path` wherever `given` (the fields the user
    set; default: those that differ from TrainConfig's defaults) does not set it. A given field that the run
    cannot change is refused in one line naming its flag, and so is --epochs where the run's schedule spans its
    length (onecycle, cosine: more epochs would train at a rate of 0) or where the run is past it already."""
    if given is None:
        default = TrainConfig()
        given = {f.name for f in fields(TrainConfig) if getattr(config, f.name) != getattr(default, f.name)}
    given = {name for name in given if getattr(config, name) is not None}  # "auto" given: the run's own
    raw = head(path)
    saved = raw["config"]
    for name in KEPT:
        if name in given and name in saved and getattr(config, name) != saved[name]:
            raise UsageError(f"{flag(name)} {getattr(config, name)}: the run in {path.parent} has {flag(name)} "
                             f"{saved[name]}, which a resume keeps; drop the flag, or start a new run without "
                             f"--resume")
    config = replace(config, **{k: saved[k] for k in (*KEPT, *CHANGEABLE) if k in saved and k not in given})
    if "epochs" in given and saved.get("epochs", config.epochs) != config.epochs:
        done = raw["loader"]["epoch"] + (raw["loader"]["samples"] > 0)
        if config.epochs < done:
            raise UsageError(f"--epochs {config.epochs}: the run in {path.parent} has trained {done} epochs "
                             f"already; resume with --epochs {done} or more")
        if config.scheduler in STRETCHED:
            raise UsageError(f"--epochs {config.epochs}: the run's {config.scheduler} schedule is laid over its "
                             f"{saved['epochs']} epochs (its rate falls to 0 at their end), so a resume keeps them; "
                             f"for {config.epochs} epochs start a new run without --resume")
    return config


def describe(path: Path, config: TrainConfig) -> str:
    """Check that a checkpoint can continue this run (before any process starts); say where it stopped, what
    this run changes of its recipe, and, for a run that had finished, that nothing is left to train."""
    raw = head(path)
    saved = raw["config"]
    if saved["batch_size"] != config.batch_size:
        raise UsageError(f"--resume {path}: that run's global batch was {saved['batch_size']}, this one's is "
                         f"{config.batch_size}: resume with --batch-size {saved['batch_size']} (the data order "
                         f"continues by global batches)")
    place, steps = raw["loader"], raw["steps"]
    changed = [f"{flag(k)} {getattr(config, k)} (it had {saved[k]})" for k in CHANGEABLE
               if k in saved and getattr(config, k) != saved[k]]
    also = f"; changed: {', '.join(changed)}" if changed else ""
    if place["samples"] == 0 and place["epoch"] >= config.epochs:
        return (f"the run had finished its {place['epoch']} epochs ({steps} optimizer steps): nothing left to "
                f"train; its files are written again{also}")
    return f"epoch {place['epoch'] + 1}, {place['samples']} samples in, after {steps} optimizer steps{also}"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")

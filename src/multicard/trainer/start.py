"""How a run of multicard train begins, decided in one place before any process starts: from the beginning or from
which checkpoint, with which recipe (the resumed run's wherever no flag says otherwise), and what rank 0 says of
it. The decision is one value, Start: train() makes it and hands it on; a restart makes it again with --resume
auto; the CLI asks the same function which model and data the run needs. Which run the checkpoints then belong
to follows from the checkpoint (checkpoints/trainer_saves.py's claim: going on from the owner's newest is the same run,
anything else a new one). checkpoints/resume.py only reads checkpoints; outdir.py only holds and switches --out's
folders.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from .. import safefs
from ..checkpoints import files
from ..checkpoints.files import OWN
from ..checkpoints.resume import FOLDER, head, newest, resolve
from ..checkpoints.trainer_saves import hold
from ..errors import UsageError
from . import trust
from .config import TrainConfig
from .recipe import describe, inherit


@dataclass(frozen=True)
class Start:
    config: TrainConfig  # the recipe: the resumed run's where not given, settled for the job's processes
    checkpoint: Path | None  # the state.pt the run goes on from; None: from the beginning
    line: str  # what rank 0 says before the processes start ("" where there is nothing to say)


def decide(config: TrainConfig, given: set[str] | None = None, world: int | None = None,
           model: nn.Module | None = None) -> Start:
    """The run's start for `config` (its resume and out), where `given` names the fields the user set (the rest
    of the recipe comes from a resumed checkpoint). With `world` (the job's processes) the auto batch and rate are
    settled and the checkpoint is checked against them (a global batch it cannot go on with is one line), and
    against the strategy and `model`; without, the recipe alone (what the CLI needs to build the model and
    data)."""
    skipped: list[str] = []  # newer checkpoints --resume auto passed over, damaged
    if config.resume:  # whose --out it is, before anything in it is read
        trust.check_before_reading(config.out, trust.trusted(config.trust_dir))
    checkpoint = resolve(config.resume, config.out, skipped=skipped)
    if checkpoint is not None:
        config = inherit(checkpoint, config, given)
    if world is None:
        return Start(config, checkpoint, "")
    if checkpoint is not None:
        fitting(checkpoint, config, model)
    return begun(config.settled(world), checkpoint, config.resume == "auto", skipped)


def restart(start: Start, out: str | Path | None = None) -> Start:
    """After a failed attempt: the same run, as decided, from its newest checkpoint, or where it wrote none, from
    where it started (known here, not read back from run.json). `out`: --out as the launcher holds it open (its
    checkpoints are looked for there; the one found is named by its own path, for the ranks)."""
    skipped: list[str] = []
    with hold(out or start.config.out, make=False) or contextlib.nullcontext() as held:  # never through a link
        found = newest(held.via, outside=False, skipped=skipped) if held is not None else None
        found = Path(safefs.shown(found)) if found is not None else None
    return begun(start.config, found or start.checkpoint, True, skipped)


def begun(config: TrainConfig, checkpoint: Path | None, auto: bool, skipped: Sequence[str] = ()) -> Start:
    """The Start of a settled config from `checkpoint`, checked against it (a global batch the checkpoint cannot
    go on with is one line), and what rank 0 says of it (and of the newer ones passed over, damaged)."""
    if checkpoint is not None:
        line = f"resuming from {checkpoint} ({describe(checkpoint, config)})"
        line += f"; not from the newer {', nor '.join(skipped)}" if skipped else ""
    elif auto:
        line = f"no checkpoint in {Path(config.out) / FOLDER}: starting from the beginning"
    else:
        line = ""
    return Start(config, checkpoint, line)


def fitting(checkpoint: Path, config: TrainConfig, model: nn.Module | None) -> None:
    """What the processes would refuse on loading `checkpoint`, refused before the run claims anything in --out
    (a refused resume changes nothing there): shards under a strategy other than fsdp, a whole optimizer state
    under fsdp, a model whose names or shapes differ."""
    raw = head(checkpoint)
    held = raw[OWN].get("shards") if isinstance(raw.get(OWN), dict) else None
    if held is not None and config.strategy != "fsdp":
        raise UsageError(f"--resume {checkpoint}: written under fsdp, its model and optimizer are in shards: "
                         f"resume it with --strategy fsdp")
    if held is None and config.strategy == "fsdp":
        raise UsageError(f"--resume {checkpoint}: written without fsdp, its optimizer's state is whole, not in "
                         f"shards: resume it with the strategy that wrote it")
    if model is not None and held is None and (wrong := files.misfit(model, raw.get("model"))):
        raise UsageError(f"--resume {checkpoint}: its model {wrong}")

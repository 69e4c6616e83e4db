"""How a run of multicard train begins, decided in one place before any process starts: from the beginning or from
which checkpoint, with which recipe (the resumed run's wherever no flag says otherwise), and what rank 0 says of
it. The decision is one value, Start: train() makes it and hands it on; a restart makes it again with --resume
auto; the CLI asks the same function which model and data the run needs. Which run the checkpoints then belong to
follows from the checkpoint (saves.claim: going on from the owner's newest is the same run, anything else a new
one). resume.py only reads checkpoints; outdir.py only holds and switches --out's folders.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import TrainConfig
from .resume import FOLDER, describe, inherit, resolve


@dataclass(frozen=True)
class Start:
    config: TrainConfig  # the recipe: the resumed run's where not given, settled for the job's processes
    checkpoint: Path | None  # the state.pt the run goes on from; None: from the beginning
    line: str  # what rank 0 says before the processes start ("" where there is nothing to say)


def decide(config: TrainConfig, given: set[str] | None = None, world: int | None = None) -> Start:
    """The run's start for `config` (its resume and out), where `given` names the fields the user set (the rest
    of the recipe comes from a resumed checkpoint). With `world` (the job's processes) the auto batch and rate are
    settled and the checkpoint is checked against them (a global batch it cannot go on with is one line); without,
    the recipe alone (what the CLI needs to build the model and data)."""
    checkpoint = resolve(config.resume, config.out)
    if checkpoint is not None:
        config = inherit(checkpoint, config, given)
    if world is None:
        return Start(config, checkpoint, "")
    return begun(config.settled(world), checkpoint, config.resume == "auto")


def restart(start: Start) -> Start:
    """After a failed attempt: the same run, as decided, from its newest checkpoint, or where it wrote none, from
    where it started (known here, not read back from run.json)."""
    return begun(start.config, resolve("auto", start.config.out, outside=False) or start.checkpoint, True)


def begun(config: TrainConfig, checkpoint: Path | None, auto: bool) -> Start:
    """The Start of a settled config from `checkpoint`, checked against it (a global batch the checkpoint cannot
    go on with is one line), and what rank 0 says of it."""
    if checkpoint is not None:
        line = f"resuming from {checkpoint} ({describe(checkpoint, config)})"
    elif auto:
        line = f"no checkpoint in {Path(config.out) / FOLDER}: starting from the beginning"
    else:
        line = ""
    return Start(config, checkpoint, line)

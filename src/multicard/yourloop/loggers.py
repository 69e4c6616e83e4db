"""Where mc.log(metrics, step) writes: TensorBoard event files, or any object with log(metrics, step).

No torch or tensorboard at module level: each loads only when it is asked for.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ..errors import UsageError


def need_tensorboard(what: str = "TensorBoard logging") -> None:
    """One line naming the extra where the tensorboard package is missing (checked without importing it)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError(f"{what} needs the tensorboard package: pip install 'multicard[tensorboard]'")


class TensorBoardLogger:
    """Event files under `root_dir`, written with the tensorboard package's writer (through torch's
    SummaryWriter): `tensorboard --logdir root_dir`. The writer is made on the first log, so the object can be
    handed to spawned processes (and only the rank that logs creates files)."""

    def __init__(self, root_dir: str | Path = "runs/logs", flush_secs: int = 10):
        need_tensorboard()
        self.root_dir, self.flush_secs, self._writer = Path(root_dir), flush_secs, None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # flushed every few seconds: a run is worth watching while it goes
            self._writer = SummaryWriter(str(self.root_dir), flush_secs=self.flush_secs)
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __getstate__(self) -> dict:  # an open writer holds a thread and a file: a copy starts without one
        return {**self.__dict__, "_writer": None}


def make_loggers(loggers: Any, log_dir: str | Path) -> list:
    """Multicard(loggers=...): None, "tensorboard", an object with log(metrics, step), or a list of these."""
    if loggers is None:
        return []
    made = []
    for logger in loggers if isinstance(loggers, (list, tuple)) else [loggers]:
        if logger == "tensorboard":
            logger = TensorBoardLogger(log_dir)
        elif isinstance(logger, str) or not callable(getattr(logger, "log", None)):
            raise UsageError(f"loggers={logger!r}: give 'tensorboard' or an object with log(metrics, step)")
        made.append(logger)
    return made


def scalars(metrics: dict) -> dict[str, float]:
    """{name: number}: tensors of one element read once; anything else is one line naming it."""
    out = {}
    for name, value in metrics.items():
        try:
            out[str(name)] = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise UsageError(f"log: {name}={value!r} is not a number") from None
    return out

"""The values a setting may take and the ranges it must keep, each checked here once, for the command line,
TrainConfig and the library alike. A bad value is one line: `said` names the setting as the caller took it, the
flag (--strategy x) or the keyword (strategy='x'), and the rest of the line is the same either way.
Beneath every layer with errors.py: it imports nothing else of multicard, and no torch (`multicard --help` reads it).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from .errors import UsageError

STRATEGIES = ("auto", "single", "ddp", "dp", "dp-balanced", "fsdp")  # strategies.STRATEGIES: a class each, in order
PRECISIONS = ("fp32", "bf16", "fp16")  # yourloop/precision.py's autocast dtypes, in this order
REPLICA_CHECKS = ("stop", "warn", "off")  # yourloop/replicas.py's modes
# optimizer steps between replica checks: 0.25% of LeNet-5's training time on 2 gloo processes
REPLICA_CHECK_EVERY = 100  # (benchmarks/replica_check.py)
MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 1e6  # seconds: below 1 s a healthy step times out; 1e6 s is 11 days


def one_of(value: Any, said: str, allowed: tuple[str, ...]) -> Any:
    if value not in allowed:
        raise UsageError(f"{said}: choose one of {', '.join(allowed)}")
    return value


def at_least(value: Any, said: str, least: int) -> Any:
    if value < least:
        raise UsageError(f"{said}: must be at least {least}")
    return value


strategy = partial(one_of, allowed=STRATEGIES)
precision = partial(one_of, allowed=PRECISIONS)
replica_check = partial(one_of, allowed=REPLICA_CHECKS)
accumulate = partial(at_least, least=1)  # micro-batches per optimizer step


def replica_check_every(steps: Any, said: str) -> int:
    """The optimizer steps between replica checks: a whole number, 1 or more."""
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise UsageError(f"{said}: not a whole number")
    return at_least(steps, said, 1)


def timeout(seconds: Any, said: str) -> float:
    """A timeout a job can keep: below MIN_TIMEOUT a healthy step is taken for a hang; past MAX_TIMEOUT the
    system's clocks overflow."""
    if not MIN_TIMEOUT <= seconds <= MAX_TIMEOUT:  # also refuses nan
        raise UsageError(f"{said}: must be from {MIN_TIMEOUT:g} to {MAX_TIMEOUT:g} seconds")
    return seconds


def stop_grace(seconds: Any, said: str) -> float:
    """The seconds a rank gets between a stop signal and SIGKILL: 0 or more."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < math.inf:
        raise UsageError(f"{said}: give the seconds a rank gets between the stop signal and SIGKILL (0 or more)")
    return float(seconds)

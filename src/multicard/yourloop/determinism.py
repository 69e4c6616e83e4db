"""Deterministic mode (Multicard(deterministic=True), --deterministic): the same run twice gives the same bits on a
card too. On the CPU a run repeats without it; on a card, cuDNN's autotuning, atomics in some kernels and cuBLAS's
workspace make the last digits, and so the weights, differ from run to run (docs/distributed.md, "On a card").

No torch at module level: the CLI reads ENV and the launcher's environment from here before torch is needed.
"""

from __future__ import annotations

import os
import re

from ..errors import UsageError
from ..jobs import protocol

ENV = protocol.DETERMINISTIC  # how `multicard run --deterministic` tells the script's Multicard
CUBLAS = "CUBLAS_WORKSPACE_CONFIG"  # cuBLAS reads it when it starts: before the first cuBLAS call of a process
WORKSPACE = ":4096:8"  # the setting torch's docs name (8 workspaces of 4 MiB per stream)
REFUSED = re.compile(r"(\S+) does not have a deterministic implementation")


def environment() -> dict[str, str]:
    """What a launcher puts in its ranks' environment for deterministic mode (a cuBLAS setting of the user's
    own is kept)."""
    return {ENV: "1", CUBLAS: os.environ.get(CUBLAS, WORKSPACE)}


def chosen(asked: bool, strategy: object) -> bool:
    """Whether this Multicard is deterministic: asked here, or by the launcher (ENV=1). The answer travels with
    the strategy to the processes Multicard.launch starts (processes.launched). If so, torch is set for it in this
    process at once: before its first cuBLAS call, and before it starts any process (which inherits the cuBLAS
    setting)."""
    value = os.environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise UsageError(f"{ENV}={value}: set it to 1 (deterministic) or 0, or unset it")
    on = asked or value == "1"
    strategy.deterministic = on
    if on:
        turn_on()
    return on


def turn_on() -> None:
    """torch's deterministic algorithms, cuDNN without autotuning, and cuBLAS's fixed workspace."""
    import torch

    if CUBLAS not in os.environ and torch.cuda.is_initialized():
        raise UsageError(f"deterministic mode: this process used CUDA already, so cuBLAS started without {CUBLAS}; "
                         f"create the Multicard before any CUDA work, or set {CUBLAS}={WORKSPACE} before starting")
    os.environ.setdefault(CUBLAS, WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False  # autotuning picks by timing: another kernel, other digits, per run
    torch.backends.cudnn.deterministic = True


def check(error: BaseException) -> None:
    """Raise multicard's one line where `error` is torch refusing an op that has no deterministic version; return
    otherwise (the caller re-raises the error as it was)."""
    said = refused(error)
    if said is not None:
        raise said from None


def refused(error: BaseException) -> UsageError | None:
    """The one line for torch refusing an op with no deterministic version, wherever it ran (the model, the loss,
    a DataLoader worker, whose error torch raises again in the loop); None for any other error. An error that
    ends a rank is read with it (the job's explain, yourloop/job_state.py)."""
    found = REFUSED.search(str(error)) if isinstance(error, RuntimeError) else None
    if found is None:
        return None
    where = " (in a DataLoader worker)" if "DataLoader worker" in str(error) else ""
    return UsageError(f"{found[1]}{where} has no deterministic version, and deterministic algorithms are on "
                      f"(--deterministic, deterministic=True): run without them, or avoid the op (in your own "
                      f"loop, torch.use_deterministic_algorithms(True, warn_only=True) after Multicard(...) "
                      f"warns instead)")

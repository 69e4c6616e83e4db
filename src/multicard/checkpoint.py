"""Checkpoints as plain state_dicts: always unwrapped (no "module." prefix), written atomically, read safely."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from .errors import UsageError

PREFIXES = ("module.", "_orig_mod.")  # what (Distributed)DataParallel and torch.compile put before every key


def plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict on the CPU, without the prefixes of wrappers around it."""
    return {k: v.detach().cpu() for k, v in unprefixed(model.state_dict()).items()}


def unprefixed(state: dict) -> dict:
    """Drop a wrapper's prefix while EVERY key has it: a wrapper holds nothing of its own, whereas a model
    with a child that happens to be called `module` keeps its other keys, and so its names."""
    while state and (prefix := next((p for p in PREFIXES if all(k.startswith(p) for k in state)), None)):
        state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def save(model: nn.Module, path: str | Path) -> Path:
    """Write to a temporary file beside `path`, then rename: a crash never leaves half a checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(plain_state(model), f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def load(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a checkpoint into `model` (prefixed keys from other tools are accepted); bad files: one line."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a foreign or damaged file
        raise UsageError(f"checkpoint {path}: not a readable PyTorch state_dict ({type(e).__name__})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UsageError(f"checkpoint {path}: holds no state_dict of tensors")
    state = unprefixed(state)
    own = model.state_dict()
    missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    wrong = [k for k in own if k in state and own[k].shape != state[k].shape]  # in model order: one message
    if missing or extra or wrong:
        first = (missing and f"missing {missing[0]}") or (extra and f"unexpected {extra[0]}") or \
            f"{wrong[0]} has shape {tuple(state[wrong[0]].shape)}, the model {tuple(own[wrong[0]].shape)}"
        raise UsageError(f"checkpoint {path}: does not fit the model "
                         f"({len(missing)} missing, {len(extra)} unexpected, {len(wrong)} mis-shaped; {first})")
    model.load_state_dict(state)
    return model

"""Checkpoints as plain state_dicts: always unwrapped (no "module." prefix), written atomically, read safely."""

from __future__ import annotations

import errno
import io
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import safefs
from ..errors import UsageError
from . import sums

FULL = (errno.ENOSPC, errno.EDQUOT)  # a filesystem out of space, inodes or quota: a line, not a traceback
# what torch's zip writer says when the file system refuses a write half-way (EFBIG under ulimit -f, ...)
WRITE_FAILED = re.compile(r"unexpected pos|file write failed|PytorchStreamWriter failed", re.I)
OWN = "multicard"  # the entry of a checkpoint holding what Multicard itself restores (its save count, scaler, streams)
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


def own(module: nn.Module) -> nn.Module:
    """The user's own model inside torch.compile's wrappers (an OptimizedModule puts `_orig_mod.` before every
    key); `module` where it is not compiled."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # (nothing was compiled where torch never loaded it)
    while eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        module = module._orig_mod
    return module


def save(model: nn.Module, path: str | Path) -> Path:
    """The model's plain state_dict, written atomically."""
    return write_atomic(plain_state(model), path)


def write_atomic(obj: Any, path: str | Path) -> Path:
    """torch.save into a temporary file beside `path`, then rename, both through the folder held open: a crash
    never leaves half a file, and a folder swapped meanwhile is not written through. The file gets this user's
    usual mode (umask), as any file they write; its zip records a CRC-32 of every entry (checked on load)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with safefs.Folder.open(path.parent) as folder, sums.recorded():
            folder.write(path.name, lambda f: torch.save(obj, f))
    except BaseException as e:
        named = safefs.shown(path)
        if isinstance(e, OSError) and e.errno in FULL:
            raise UsageError(f"cannot write {named} ({e.strerror}): free space on that filesystem, or choose "
                             f"another --out") from None
        if isinstance(e, OSError) and e.errno is not None:  # read-only, no permission, a file-size limit
            raise UsageError(f"cannot write {named} ({e.strerror}); choose another --out") from None
        if isinstance(e, RuntimeError) and WRITE_FAILED.search(str(e)):  # torch's writer, failing part-way
            raise UsageError(f"cannot write {named}: the write stopped part-way (a file-size limit, or the disk "
                             f"full?); choose another --out") from None
        raise
    return path


def read(path: str | Path) -> Any:
    """torch.load with weights_only=True onto the CPU, once every byte is checked against the CRC-32s its save
    recorded; a missing, damaged or foreign file is one line."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint {safefs.shown(path)}: no such file")
    return _loaded(path, path)


def _loaded(source: Path | io.BytesIO, path: Path) -> Any:
    sums.check(source, f"checkpoint {safefs.shown(path)}")
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a foreign or damaged file
        raise UsageError(f"checkpoint {safefs.shown(path)}: not a readable PyTorch checkpoint "
                         f"({type(e).__name__})") from None


RANK_FILE_MOST = 64 << 20  # an older checkpoint's rank file: a rank's random streams, a few KB per device


def read_small(path: Path, most: int = RANK_FILE_MOST) -> Any:
    """A small checkpoint file (a rank's part) read as read() does, but only a regular file, never through a
    link, and only up to `most` bytes."""
    return _loaded(io.BytesIO(safefs.read_bytes(path, most, f"checkpoint {path}")), path)


def is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())


def save_state(path: str | Path, state: dict[str, Any]) -> Path:
    """{name: object} to one file: modules as plain state_dicts (no wrapper prefix), anything with a
    state_dict() (optimizers, schedulers, scalers) as that, other values (epoch numbers, ...) as they are."""
    return write_atomic({k: stateful_state(v) for k, v in state.items()}, path)


def stateful_state(obj: Any) -> Any:
    if isinstance(obj, nn.Module):
        return plain_state(obj)
    return obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj


def load_state(path: str | Path, state: dict[str, Any], load_module: Callable | None = None,
               raw: Any = None) -> dict[str, Any]:
    """Load a save_state file into the objects of `state` (modules, optimizers, ...), replace its plain
    values, and return what the file holds besides the objects restored. A model's plain state_dict (a
    model.pt) loads into the one module of `state`. `load_module(module, state_dict)`: how a checked
    state_dict goes into a module (default: its load_state_dict). `raw`: the file's contents, where the
    caller has read them already."""
    raw = read(path) if raw is None else raw
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    if is_state_dict(raw) and len(modules) == 1 and modules[0] not in raw:
        raw = {modules[0]: raw}
    if not isinstance(raw, dict):
        raise UsageError(f"checkpoint {path}: holds no dict of saved objects")
    if lacking := [k for k in state if k not in raw]:
        held = ", ".join(map(repr, raw)) or "nothing"
        raise UsageError(f"checkpoint {path}: has no {lacking[0]!r} (it holds {held})")
    restored = set()
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            load_into(obj, raw[key], f"checkpoint {path}, {key!r}", load_module)
        elif callable(getattr(obj, "load_state_dict", None)):
            try:
                obj.load_state_dict(raw[key])
            except (ValueError, KeyError, RuntimeError, TypeError) as e:
                raise UsageError(f"checkpoint {path}: {key!r} does not fit ({e})") from None
        else:
            state[key] = raw[key]
            continue
        restored.add(key)
    return {k: v for k, v in raw.items() if k not in restored}


def load(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a checkpoint into `model` (prefixed keys from other tools are accepted); bad files: one line."""
    return load_into(model, read(path), f"checkpoint {path}")  # no state_dict of tensors: misfit's line


def load_into(model: nn.Module, state: Any, what: str, load_module: Callable | None = None) -> nn.Module:
    """A state_dict into `model`, after checking every name and shape: a mismatch is one line, and leaves the
    model as it was."""
    if wrong := misfit(model, state):
        raise UsageError(f"{what}: {wrong}")
    target = model if load_module else own(model)  # a compiled model: its keys as yours
    (load_module or type(target).load_state_dict)(target, unprefixed(state))
    return model


def misfit(model: nn.Module, state: Any) -> str | None:
    """How `state` does not fit `model` (names and shapes), in a few words; None where it fits."""
    if not is_state_dict(state):
        return "holds no state_dict of tensors"
    state, mine = unprefixed(state), own(model).state_dict()
    missing, extra = sorted(mine.keys() - state.keys()), sorted(state.keys() - mine.keys())
    wrong = [k for k in mine if k in state and mine[k].shape != state[k].shape]  # in model order: one message
    if not (missing or extra or wrong):
        return None
    first = (missing and f"missing {missing[0]}") or (extra and f"unexpected {extra[0]}") or \
        f"{wrong[0]} has shape {tuple(state[wrong[0]].shape)}, the model {tuple(mine[wrong[0]].shape)}"
    return f"does not fit the model ({len(missing)} missing, {len(extra)} unexpected, {len(wrong)} mis-shaped; " \
        f"{first})"


def rank_file(path: str | Path, rank: int) -> Path:
    """Where rank `rank` (> 0) kept its random streams beside a checkpoint before one file held every rank's
    (state.pt -> state.rank1.pt): read for such checkpoints, never written."""
    path = Path(path)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def rng_state() -> dict[str, Any]:
    """This process's random streams (torch CPU and CUDA, numpy, random), in types weights_only can load."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos,
                                                       has_gauss, gauss), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["random"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)

"""Checkpoints of a sharded model (fsdp): its parameters and its optimizers' state as torch.distributed.checkpoint
(DCP) writes them, each process its own part, into a folder beside the checkpoint file. DCP reads them back on
any number of processes (it reshards), which a file written by rank 0 alone could not hold.

Each save writes a folder of its own (ckpt.shards-<n>); the checkpoint file names it, and is replaced only after
the folder is whole, so a kill at any instant leaves the previous checkpoint and its folder as they were. Older
folders go once the new file is in place.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import UsageError


def folder(path: Path, save: int) -> Path:
    return path.with_name(f"{path.stem}.shards-{save}")


def split(state: dict[str, Any]) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
    models = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    if optimizers and len(models) != 1:
        raise UsageError(f"under fsdp, a checkpoint holds its optimizers with exactly one model; this one names "
                         f"{len(models)} models")
    return models, optimizers


def sharded_state(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {k: get_model_state_dict(m) for k, m in models.items()}
    for k, optimizer in optimizers.items():
        out[k] = get_optimizer_state_dict(next(iter(models.values())), optimizer)
    return out


def save(path: Path, save: int, state: dict[str, Any], unwrap) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rank: write the models and optimizers of `state` into this save's folder. Returns the rest of
    `state` (for the checkpoint file) and what the file must say of the folder."""
    import torch.distributed.checkpoint as dcp

    models, optimizers = split(state)
    target = folder(path, save)
    dcp.save(sharded_state({k: unwrap(m) for k, m in models.items()}, optimizers), checkpoint_id=target)
    rest = {k: v for k, v in state.items() if k not in models and k not in optimizers}
    return rest, {"folder": target.name, "models": list(models), "optimizers": list(optimizers)}


def drop_older(path: Path, keep: str) -> None:
    """Rank 0, once the checkpoint file names `keep`: the folders of earlier saves go."""
    for old in path.parent.glob(f"{path.stem}.shards-*"):
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def load(path: Path, info: dict[str, Any], state: dict[str, Any], unwrap) -> None:
    """Every rank: the models and optimizers of `state` from the folder the checkpoint names, resharded onto
    this job's processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    models, optimizers = split(state)
    missing = [k for k in (*models, *optimizers) if k not in info["models"] + info["optimizers"]]
    if missing:
        raise UsageError(f"checkpoint {path}: has no {missing[0]!r} (its shards hold "
                         f"{', '.join(map(repr, info['models'] + info['optimizers']))})")
    models = {k: unwrap(m) for k, m in models.items()}
    target = sharded_state(models, optimizers)
    try:
        dcp.load(target, checkpoint_id=path.parent / info["folder"])
    except Exception as e:  # a missing or damaged folder, or shards of another model
        raise UsageError(f"checkpoint {path}: its shards in {info['folder']} cannot be read into this model "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    for k, module in models.items():
        set_model_state_dict(module, target[k])
    for k, optimizer in optimizers.items():
        set_optimizer_state_dict(next(iter(models.values())), optimizer, target[k])

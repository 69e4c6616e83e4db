"""Checkpoints of a user's loop: Multicard.save / load / state_dict. A checkpoint holds the user's objects
(models unwrapped, optimizers, schedulers, set-up loaders, plain values) plus what the Multicard itself
restores: its save count, the fp16 gradient scaler and every process's random streams.

The functions take the Multicard (`mc`) as their first argument; front.py's methods are one line each.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import checkpoint, shards
from .errors import UsageError

if TYPE_CHECKING:
    from .front import Multicard

OWN = "multicard"  # the entry of a checkpoint holding what Multicard itself restores


def state_dict(mc: Multicard, model: nn.Module) -> dict[str, torch.Tensor]:
    module = mc.unwrap(model)
    return mc._strategy.model_state(module) if mc.sharded else checkpoint.plain_state(module)


def _checked(what: str, state: Any) -> None:
    """Before anything rank-specific: a wrong argument is the same one line on every rank."""
    if not isinstance(state, dict):
        raise UsageError(f"mc.{what}(path, state): state is a {type(state).__name__}, not a dict of names to "
                         f"objects; e.g. mc.{what}(path, {{'model': model, 'optimizer': optimizer}})")


def save(mc: Multicard, path: str | Path, state: dict[str, Any]) -> None:
    _checked("save", state)
    path = Path(path)
    if checkpoint.is_state_dict(state):  # mc.save(path, model.state_dict()): plain, as torch.save writes it
        if mc.is_main:
            checkpoint.save_state(path, state)
        return
    mc._saves += 1
    own = {"save": mc._saves, "world": mc.world_size, "rng": checkpoint.rng_state()}
    if mc.sharded:
        state, own["shards"] = shards.save(path, mc._saves, state, mc.unwrap)
    if mc.is_main:
        if mc.scaler is not None:
            own.update(scaler=mc.scaler.state_dict(), skipped=mc.skipped_steps)
        checkpoint.save_state(path, {**state, OWN: own})
        if mc.sharded:
            shards.drop_older(path, own["shards"]["folder"])
    else:
        checkpoint.write_atomic({**own, "rank": mc.rank}, checkpoint.rank_file(path, mc.rank))


def load(mc: Multicard, path: str | Path, state: dict[str, Any] | None = None) -> dict[str, Any]:
    if state is not None:
        _checked("load", state)
    path = Path(path)
    head = checkpoint.read(path)  # read once: the objects below are restored from it
    info = head.get(OWN, {}).get("shards") if isinstance(head, dict) and isinstance(head.get(OWN), dict) else None
    if state is None:
        raw = head
    elif info is not None and not mc.sharded:
        raise UsageError(f"checkpoint {path}: written under fsdp, its model is in shards: load it with "
                         f"strategy fsdp (its model.pt holds the whole model for any strategy)")
    elif info is None and mc.sharded and isinstance(head, dict) and OWN in head and \
            any(isinstance(v, torch.optim.Optimizer) for v in state.values()):
        raise UsageError(f"checkpoint {path}: written without fsdp, its optimizers' state is whole, not in shards: "
                         f"resume it with the strategy that wrote it (its model alone loads under fsdp too)")
    elif info is not None:
        models, optimizers = shards.split(state)
        shards.load(path, info, state, mc.unwrap)
        rest = {k: v for k, v in state.items() if k not in models and k not in optimizers}
        raw = checkpoint.load_state(path, rest, raw=head)
        state.update(rest)  # the plain values read
    else:
        raw = checkpoint.load_state(path, state, lambda module, weights: _load_module(mc, module, weights), head)
    own = raw.pop(OWN, None) if isinstance(raw, dict) else None
    if own is not None:
        _restore(mc, path, own)
    return raw


def _load_module(mc: Multicard, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A whole state_dict into a set-up model: under fsdp into its shards."""
    if mc.sharded:
        mc._strategy.load_model_state(mc.unwrap(module), state)
    else:
        module.load_state_dict(state)


def _restore(mc: Multicard, path: Path, own: dict[str, Any]) -> None:
    """The scaler, the save count, and this rank's random streams where they were saved."""
    mc._saves = own["save"]
    if mc.scaler is not None and "scaler" in own:
        mc.scaler.load_state_dict(own["scaler"])
        mc._skipped.fill_(own["skipped"])
    if own["world"] != mc.world_size:
        if mc.is_main:
            print(f"multicard: {path} was written by {own['world']} processes, this job has "
                  f"{mc.world_size}: the data order and each sample's augmentation go on; dropout's random "
                  f"streams start afresh", file=sys.stderr, flush=True)
        return
    if mc.rank == 0:
        checkpoint.set_rng_state(own["rng"])
        return
    mine = checkpoint.rank_file(path, mc.rank)
    part = checkpoint.read(mine) if mine.is_file() else None
    if part is None or part.get("save") != own["save"]:
        print(f"multicard: rank {mc.rank}: {mine} is missing or from another save: this rank's random "
              f"streams start afresh", file=sys.stderr, flush=True)
        return
    checkpoint.set_rng_state(part["rng"])

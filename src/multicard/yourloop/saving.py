"""Checkpoints of a user's loop: Multicard.save / load / state_dict. A checkpoint is one file (plus, under fsdp,
its shards folder): the user's objects (models unwrapped, optimizers, schedulers, set-up loaders, plain values)
plus what the Multicard itself restores: its save count, the fp16 gradient scaler and every process's random
streams (randoms.py brings the other ranks' to rank 0).

Checkpoints is a mixin of the Multicard (yourloop/multicard.py); the functions beside it take the Multicard (`mc`)
as their first argument. What a checkpoint file is (its format, checksums, fsdp's shards, the random streams'
handover) lives in checkpoints/, which takes what it needs as arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import safefs
from ..checkpoints import files as checkpoint
from ..checkpoints import randoms, shards, sums
from ..checkpoints.files import OWN
from ..errors import UsageError, note


def _checked(what: str, state: Any) -> None:
    """Before anything rank-specific: a wrong argument is the same one line on every rank."""
    if not isinstance(state, dict):
        raise UsageError(f"mc.{what}(path, state): state is a {type(state).__name__}, not a dict of names to "
                         f"objects; e.g. mc.{what}(path, {{'model': model, 'optimizer': optimizer}})")


def _sharded(mc: Any, path: Path, state: dict[str, Any], streams: dict) -> tuple[dict, dict, dict[int, Any]]:
    """Every rank (a collective): rank 0 makes the save's shards folder (new, never one planted) and every rank
    writes its shards into that very folder, held open. Returns the rest of `state`, what the checkpoint says of
    the folder (with the sums of its files), and on rank 0 the other ranks' random streams."""
    held, failed = None, None
    try:
        held = shards.new_folder(path, mc._saves) if mc.is_main else None
    except UsageError as e:
        failed = str(e)
    said = mc.broadcast(failed or (held and (held.shown.name, held.made.ino)))
    if isinstance(said, str):
        raise UsageError(said)
    try:
        held = held or shards.take(path, *said)
    except UsageError as e:
        failed = str(e)
    refused = [f for f in mc.gather(failed) if f]  # every rank writes, or none does
    if refused:
        raise UsageError(refused[0])
    with held:
        rest, info = shards.save(held, state, mc.unwrap)
        kept = mc.gather((streams, sums.of_files(held, mc.rank)))
        if mc.is_main and not shards.still_held(path, held):
            raise UsageError(safefs.replaced(f"shards folder {held.shown}"))
    info["sums"] = {name: crc for _, found in kept for name, crc in found.items()}
    return rest, info, {r: got for r, (got, _) in enumerate(kept) if r}


def _sound(mc: Any, path: Path, where: Path, recorded: Any) -> None:
    """Every rank checks its share of the shard files against the sums the save recorded; any damage is one
    line on every rank."""
    damaged = [found for found in mc.gather(sums.files_damage(where, recorded, mc.rank, mc.world_size)) if found]
    if damaged:
        raise UsageError(sums.said(f"checkpoint {path}", damaged[0]))


def _load_module(mc: Any, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A whole state_dict into a set-up model: under fsdp into its shards."""
    if mc.sharded:
        mc._strategy.load_model_state(mc.unwrap(module), state)
    else:
        module.load_state_dict(state)


def _restore(mc: Any, path: Path, own: dict[str, Any]) -> None:
    """The scaler, the save count, and this rank's random streams where they were saved."""
    mc._saves = own["save"]
    if mc.scaler is not None and "scaler" in own:
        mc.scaler.load_state_dict(own["scaler"])
        mc._skipped.fill_(own["skipped"])
    if own["world"] != mc.world_size:
        if mc.is_main:
            note(f"{path} was written by {own['world']} processes, this job has "
                 f"{mc.world_size}: the data order and each sample's augmentation go on; dropout's random "
                 f"streams start afresh")
        return
    writer = own.get("rank", 0)  # whose streams "rng" holds
    if mc.rank == writer:
        checkpoint.set_rng_state(own["rng"])
    elif isinstance(own.get("ranks"), dict):
        if mc.rank in own["ranks"]:
            checkpoint.set_rng_state(own["ranks"][mc.rank])
        else:
            note(f"rank {mc.rank}: {path} holds no random streams of this rank (rank {writer} saved "
                 f"without them): they start afresh")
    else:  # written before one file held every rank's streams: each rank's beside it
        _restore_beside(mc, path, own)


def _restore_beside(mc: Any, path: Path, own: dict[str, Any]) -> None:
    mine = checkpoint.rank_file(path, mc.rank)
    part = checkpoint.read_small(mine) if safefs.kind(mine) == "file" else None  # never through a link
    if part is None or part.get("save") != own["save"]:
        note(f"rank {mc.rank}: {mine} is missing or from another save: this rank's random "
             f"streams start afresh")
        return
    checkpoint.set_rng_state(part["rng"])


class Checkpoints:
    """Methods of Multicard: its checkpoints (uses its _start() and what the functions above read)."""

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole, plain state_dict on the CPU (no wrapper prefixes): what model.pt holds. Under fsdp
        the shards are gathered onto rank 0 (every rank must call it; the others get {})."""
        self._start()
        module = self.unwrap(model)
        return self._strategy.model_state(module) if self.sharded else checkpoint.plain_state(module)

    def save(self, path: str | Path, state: dict[str, Any]) -> None:
        """Write {name: model, optimizer, scheduler, set-up loader, or any value} to `path`, as a checkpoint to
        resume from exactly: models unwrapped (no `module.`), a loader as its place in the data, plus what
        this object holds (the fp16 gradient scaler) and every process's random streams (torch, CUDA, numpy,
        random). Rank 0 writes `path`, one file, atomically; the other ranks hand it their random streams (a
        few KB) and go on once rank 0 reaches that save. Call it on every rank after an optimizer step; a save
        under `if mc.is_main:` works too (its first save to a name waits 3 s for the others, then says so; their
        streams start afresh on load), and so does a save on another rank alone, or to a file per rank: a rank
        whose save rank 0 does not share within 3 s writes the file itself, with its own streams (randoms.py).
        Under fsdp every rank writes its shards of the model and optimizers (torch.distributed.checkpoint) into a
        folder beside `path`, so there every rank must call it."""
        self._start()
        _checked("save", state)
        path = Path(path)
        if checkpoint.is_state_dict(state):  # mc.save(path, model.state_dict()): plain, as torch.save writes it
            if self._handed(path, None)[0]:  # rank 0, or a rank whose save rank 0 does not share
                checkpoint.save_state(path, state)
            return
        self._saves += 1
        own = {"save": self._saves, "world": self.world_size, "rng": checkpoint.rng_state()}
        if self.sharded:
            state, own["shards"], others = _sharded(self, path, state, own["rng"])
            writes = self.is_main
        else:
            writes, others = self._handed(path, own["rng"])
        if writes:
            own["ranks"] = others  # rank: its random streams, for every other rank that handed them over
            if self.rank:  # a rank that saved without rank 0: "rng" is its own
                own["rank"] = self.rank
            if self.scaler is not None:
                own.update(scaler=self.scaler.state_dict(), skipped=self.skipped_steps)
            checkpoint.save_state(path, {**state, OWN: own})
            if self.sharded:
                shards.drop_older(path, own["shards"]["folder"])

    def _handed(self, path: Path, streams: dict | None) -> tuple[bool, dict[int, Any]]:
        """randoms.handed for this save: whether this process writes `path`, and the streams handed to it."""
        job = self._job_state
        return randoms.handed(self._strategy, job.handover, job.steps, safefs.shown(path), streams)

    def load(self, path: str | Path, state: dict[str, Any] | None = None) -> dict[str, Any]:
        """Load what save wrote into the objects of `state` (models, optimizers, schedulers, loaders), in every
        process, and restore the random streams and the gradient scaler; plain values in `state` are
        replaced. Returns the file's entries that were not restored into an object (e.g. {"epoch": 3});
        without `state`, everything. Read with weights_only=True. On another number of processes the data
        order goes on where it stopped (same global batch; fsdp's shards are resharded), and dropout's random
        streams start afresh (the built-in datasets' augmentation is keyed by sample and goes on)."""
        self._start()
        if state is not None:
            _checked("load", state)
        path = Path(path)
        head = checkpoint.read(path)  # read once: the objects below are restored from it
        info = head.get(OWN, {}).get("shards") if isinstance(head, dict) and isinstance(head.get(OWN), dict) else None
        if state is None:
            raw = head
        elif info is not None and not self.sharded:
            raise UsageError(f"checkpoint {path}: written under fsdp, its model is in shards: load it with "
                             f"strategy fsdp (its model.pt holds the whole model for any strategy)")
        elif info is None and self.sharded and isinstance(head, dict) and OWN in head and \
                any(isinstance(v, torch.optim.Optimizer) for v in state.values()):
            raise UsageError(f"checkpoint {path}: written without fsdp, its optimizers' state is whole, not in shards: "
                             f"resume it with the strategy that wrote it (its model alone loads under fsdp too)")
        elif info is not None:
            models, optimizers = shards.split(state)
            shards.load(path, info, state, self.unwrap, lambda where: _sound(self, path, where, info.get("sums")))
            rest = {k: v for k, v in state.items() if k not in models and k not in optimizers}
            raw = checkpoint.load_state(path, rest, raw=head)
            state.update(rest)  # the plain values read
        else:
            raw = checkpoint.load_state(path, state, lambda module, weights: _load_module(self, module, weights), head)
        own = raw.pop(OWN, None) if isinstance(raw, dict) else None
        if own is not None:
            _restore(self, path, own)
        self._replicas.loaded(path, state)
        return raw

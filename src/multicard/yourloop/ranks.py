"""What the Multicard hands out between ranks: this process's part of what all compute alike, and the
collectives (reductions, gathers, broadcasts of any structure, rank 0 first), printing and logging on rank 0.

Multicard inherits these methods; each is one line over data/parts.py, collectives.py or the strategy.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..data import parts
from ..jobs.progress import watched
from . import collectives
from .loggers import scalars


class Ranks:
    """Methods of Multicard (uses its _start(), _strategy, rank, world_size, is_main and loggers)."""

    # -- this process's part (data/parts.py) ------------------------------------------------------------------
    def local(self, batch: Any, dim: int = 0) -> Any:
        """This process's part of a global batch every process built alike, dealt as the set-up loader deals one
        (rows rank, rank + N, ...: the samples the loader would have given this process; e.g. mc.local(batchify(
        data, 20), dim=1) keeps its columns): a tensor, a list of per-sample values, or dicts / lists / tuples of
        them, each field with as many rows, cut along `dim`; parts differ by at most one sample, the gradient
        weighted by the part's rows (uneven.py). mc.gather_in_order(outputs) puts the parts back in order."""
        self._start()
        job = self._job_state
        job.inputs.cut(batch)  # the same global batch in every process? (its first call and every K-th)
        return job.share.local(batch, self.rank, self.world_size, dim, job.habits)

    def randn_local(self, *global_shape: int, dim: int = 0, **options: Any) -> torch.Tensor:
        """torch.randn(*global_shape, **options) drawn whole in every process (the noise one process draws,
        e.g. a GAN's or a VAE's for the global batch), this process keeping its part along `dim`: the rows of the
        samples mc.local and the set-up loader give it."""
        self._start()
        return parts.drawn_local("randn", self.rank, self.world_size, *global_shape, dim=dim,
                                 seen=self._job_state.inputs.drew, **options)

    def rand_local(self, *global_shape: int, dim: int = 0, **options: Any) -> torch.Tensor:
        """torch.rand drawn as randn_local draws (uniform noise, a mask or a timestep one process draws for the
        global batch), this process keeping its part along `dim`."""
        self._start()
        return parts.drawn_local("rand", self.rank, self.world_size, *global_shape, dim=dim,
                                 seen=self._job_state.inputs.drew, **options)

    def seed_per_process(self, seed: int) -> int:
        """Seed torch, `random` and numpy with seed + rank: streams that differ between processes; returns it."""
        return parts.seed_per_process(seed, self.rank)

    # -- between processes (collectives.py) -------------------------------------------------------------------
    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """`value` (a tensor, a number, or dicts / lists / tuples of them) combined over all processes: sum,
        mean, max or min. New tensors, on the device each value was on, in `value`'s structure. Every process
        must pass the same structure, shapes and dtypes; MULTICARD_CHECK_SHAPES=1 (a debugging switch: one extra
        collective a call) checks that and names a mismatch, which otherwise may come back silently reshaped."""
        self._start()
        with watched():  # a wait that ran out is told to the launcher, even where it is caught
            return collectives.all_reduce(self._strategy, value, op)

    def gather(self, obj: Any) -> list:
        """Every process's `obj` (anything picklable, nested structures of tensors included), in rank order, on
        every process."""
        self._start()
        with watched():
            return self._strategy.gather(obj)

    def gather_in_order(self, outputs: Any, total: int | None = None) -> Any:
        """Per-sample outputs from every process, in order on every process: of an evaluation loader (train=False;
        a whole pass, or one batch, each process the same number), of mc.local or a loader read whole (one
        batch). The rows are dealt round-robin; `total` (len of the dataset) drops a DistributedSampler's
        padding. See collectives.gather_in_order."""
        self._start()
        with watched():
            return collectives.gather_in_order(self._strategy, outputs, total)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Process `src`'s `obj` (a tensor, or anything picklable) on every process."""
        self._start()
        with watched():
            return collectives.broadcast(self._strategy, obj, src)

    def rank_zero_first(self, local: bool = False) -> contextlib.AbstractContextManager:
        """`with mc.rank_zero_first():` rank 0 runs the body (download, preprocess, build a cache) while the
        others wait; then they run it. local=True: the first process of each machine goes first."""
        self._start()
        return collectives.rank_zero_first(self._strategy, local)

    def split(self, inputs: Any) -> Any:
        """This process's contiguous part of a list, tuple or tensor of inputs (or a dict of them), for inference
        over a list (parts differ by at most one item): concatenating mc.gather(outputs) puts them back in order.
        Not the cut of a training batch (mc.local: dealt as the loader deals, its gradient weighted)."""
        self._start()
        return collectives.split(self._strategy, inputs)

    def barrier(self) -> None:
        self._start()
        with watched():
            self._strategy.barrier()

    def print(self, *args: Any, sep: str | None = " ", end: str | None = "\n", file: Any = None,
              flush: bool = True) -> None:
        """print() on rank 0 only, with print's own keywords (flushed unless flush=False)."""
        if self.is_main:
            print(*args, sep=sep, end=end, file=file, flush=flush)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Write {name: number} (numbers or one-element tensors) at `step` to this object's loggers, on rank 0;
        elsewhere, or without loggers, nothing (no collective: call it where you like). Names with a slash
        group in TensorBoard ("train/loss")."""
        if not self.loggers or not self.is_main:
            return
        values = scalars(metrics)
        for logger in self.loggers:
            logger.log(values, int(step))

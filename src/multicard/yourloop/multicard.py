"""Multicard: the front object that takes a user's own training loop to N processes or cards.

Four changes, each one line: start the processes (mc.launch, multicard run, torchrun), join the process group
(here, on first use), wrap the model (mc.setup), shard the data (mc.setup_dataloader). The trainer uses nothing else.

The class is a facade; every public member of `mc` is here or in a mixin beside this file:
- here: the job (strategy, world_size, rank, is_main, device, cards, device_note, sharded, launcher, local_batch,
  launch, close), setup, setup_optimizers, local_optimizer, setup_criterion, setup_dataloader, skipped_steps, unwrap;
- ranks.py (Ranks): local, randn_local, rand_local, split, seed_per_process, all_reduce, gather, gather_in_order,
  broadcast, barrier, rank_zero_first, print, log;
- steps.py (Steps): backward, clip_gradients, no_backward_sync, mark_forward, autocast;
- saving.py (Checkpoints): save, load, state_dict; replicas.py (Replicas): check_replicas;
- stopping.py (Stopping): stop_requested, stop_signal; memory.py (Memory): peak_memory_mb, card_used_mb.
What the job knows in this process is one JobState (job_state.py), made as this object joins its job.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import rules
from ..checkpoints.files import own
from ..data.loaders import Sharded, shard
from ..errors import UsageError
from ..jobs import launcher, progress
from ..jobs.dist import job_from_env
from ..jobs.job_end import STOP_GRACE_S
from ..strategies import Strategy, syncbn
from . import closure, determinism, memory
from .job_state import JobState
from .loggers import make_loggers
from .memory import Memory
from .precision import DTYPES
from .prepared import Prepared
from .ranks import Ranks
from .replicas import ReplicaCheck, Replicas
from .saving import Checkpoints
from .steps import Steps
from .stopping import Stopping, Stops
from .strategy_choice import launched, make_strategy


class Multicard(Ranks, Checkpoints, Replicas, Steps, Stopping, Memory):
    """mc = Multicard(strategy="auto", devices="auto", precision="fp32").

    strategy: auto, single, ddp, dp, dp-balanced or fsdp (auto: ddp on 2+ cards or in a launched job, else
    single).
    devices: auto, cpu, cpu:N, a card count N, card ids 0,1 or cuda:1; a card named twice (0,0) rehearses 2 cards
    on one (one process each, over gloo).
    precision: fp32, bf16 (the model's forward under autocast; its outputs handed back in fp32), or fp16 (the
    same, plus a gradient scaler: mc.backward scales the loss, optimizer.step() unscales and skips steps whose
    gradients overflowed, counted in mc.skipped_steps; mc.scaler goes into checkpoints).
    Under `multicard run`, "auto" takes the launcher's --strategy / --devices. (The data order is the plain
    DataLoader's own: its generator's, or torch's global RNG's; see setup_dataloader.)
    sync_batchnorm: ddp: BatchNorm layers compute their statistics over all processes (setup converts them).
    find_unused_parameters: ddp: a parameter may get no gradient in a backward (else one line names this option).
    fsdp_blocks, reshard_after_forward: fsdp: the class names of the blocks to shard one by one (default: the
    model's repeated blocks), and whether a block's gathered parameters are freed after its forward.
    timeout: seconds the rendezvous or a collective may wait for another process; then the job stops, naming
    the process that stopped making progress.
    loggers: where mc.log(metrics, step) writes: "tensorboard" (event files under `log_dir`; needs
    `pip install 'multicard[tensorboard]'`), any object with log(metrics, step) (and close(), called by
    mc.close()), or a list of these. Only rank 0 writes. `mc.loggers` is the list, to add to later.
    replica_check, replica_check_every: on 2+ processes, "stop" (default), "warn" or "off": whether the processes
    compare a fingerprint of their set-up models and optimizers every K steps (default 100; told by the reduced
    forwards, alike on every rank), after setup and after mc.load, and stop (or warn once) where the replicas
    parted (replicas.py). The same mode governs the seams: an optimizer step over parameters no set-up model
    holds (outside_params.py), and batches the processes drew apart (mc.local, randn_local), compared at each step
    (inputs_alike.py). None: multicard run's --replica-check / --replica-check-every, else the defaults.
    deterministic: the same bits run after run on a card too (yourloop/determinism.py; process-wide, set at once):
    torch's deterministic algorithms, cuDNN without autotuning, cuBLAS's fixed workspace; an op with no
    deterministic version is one line naming it. `multicard run --deterministic` sets it for the script.
    """

    def __init__(self, strategy: str | Strategy = "auto", devices: str = "auto", precision: str = "fp32", *,
                 find_unused_parameters: bool = False, sync_batchnorm: bool = False,
                 fsdp_blocks: str = "", reshard_after_forward: bool = True, timeout: float = 120.0,
                 loggers: Any = None, log_dir: str | Path = "runs/logs", replica_check: str | None = None,
                 replica_check_every: int | None = None, deterministic: bool = False):
        self.job = job_from_env()
        strategy = make_strategy(strategy, devices, precision, self.job, find_unused_parameters=find_unused_parameters,
                                 fsdp_blocks=fsdp_blocks, reshard_after_forward=reshard_after_forward, timeout=timeout)
        self.deterministic = determinism.chosen(deterministic, strategy)
        self._strategy, self.precision, self.sync_batchnorm = strategy, precision, sync_batchnorm
        self._phase = "new"  # new -> started (this process joined its job) -> closed
        self._job_state: JobState | None = None  # what the job knows in this process, while it is joined
        self.scaler: torch.amp.GradScaler | None = None  # fp16 only
        self._skipped: torch.Tensor | None = None
        self._saves = 0  # counts save() calls: a rank's own part of a checkpoint must come from the same one
        self.loggers: list = make_loggers(loggers, log_dir)
        self._replicas = ReplicaCheck(strategy, replica_check, replica_check_every)
        self._stops = Stops()  # SIGTERM / SIGUSR1 recorded once mc.stop_requested is first read (stopping.py)

    # -- the job ---------------------------------------------------------------------------------------------
    @property
    def strategy(self) -> str:
        return self._strategy.name

    @property
    def world_size(self) -> int:
        """Processes in the job (dp and dp-balanced drive all their cards from one)."""
        return self._strategy.world

    @property
    def rank(self) -> int:
        self._start()
        return self._strategy.rank

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints and writes."""
        self._start()
        return self._strategy.is_main

    @property
    def device(self) -> torch.device:
        """Where this process's model, inputs and targets live."""
        self._start()
        return self._strategy.device

    @property
    def cards(self) -> list[int]:
        """The CUDA cards this process drives ([] on the CPU)."""
        self._start()
        return self._strategy.cards

    @property
    def device_note(self) -> str:
        """What the choice of devices has to say, e.g. "no CUDA card found: training on the CPU" (or "")."""
        return self._strategy.devices.note

    @property
    def sharded(self) -> bool:
        """fsdp: each process holds a part of the model (state_dict and save gather or write the parts)."""
        return getattr(self._strategy, "sharded", False)

    @property
    def launcher(self) -> str:
        """Who started this process: none, multicard, torchrun or slurm."""
        return self.job.launcher

    def local_batch(self, global_batch: int, what: str = "batch size", accumulate: int = 1) -> int:
        """Samples per process per (micro-)batch for a global batch of `accumulate` micro-batches; one that does
        not split is one clear error naming `what`."""
        return self._strategy.local_batch(global_batch, what, accumulate=accumulate)

    def launch(self, fn: Callable, *args: Any, stop_grace: float = STOP_GRACE_S) -> Any:
        """fn(mc, *args) in every process the strategy needs: spawned here (the first failure stops all, with that
        rank's traceback), or right here in a job this process already belongs to. Returns what
        fn returned on rank 0. Every process tears down its process group when fn returns. A module passed in
        `args` arrives in each spawned process as a copy of its own. A signal that stops the job (SIGTERM,
        SIGINT, SIGHUP here) reaches every rank, which gets `stop_grace` seconds to act on it before SIGKILL;
        SIGUSR1 and SIGUSR2 are passed on to every rank."""
        stop_grace = rules.stop_grace(stop_grace, f"stop_grace={stop_grace!r}")
        if self.job.launched or self._strategy.processes == 1:
            self._start()
            try:
                with progress.plainly():  # torch's error, read in one line where multicard knows it
                    return fn(self, *args)
            finally:
                self.close()
        if self._phase != "new":
            raise UsageError("launch(fn) must come before anything else on this Multicard")
        named = (("fn", fn), *((f"argument {i}", a) for i, a in enumerate(args, 1)), ("loggers", self.loggers))
        return launcher.spawn(launched, self._strategy.processes, (type(self), self._strategy, self.precision,
                                                                      self.sync_batchnorm, fn, args, self.loggers,
                                                                      self._replicas.settings), named=named,
                              stop_grace=stop_grace)

    def _start(self) -> None:
        """Join the job on first use. A script that asks for more processes than it runs in starts them now:
        it runs again as each rank (as `multicard run` does), and this process ends with their exit code."""
        if self._phase == "started":
            return
        if self._phase == "closed":
            raise UsageError("this Multicard was closed (launch() closes it when fn returns); make a new one")
        if not self.job.launched and self._strategy.processes > 1:
            launcher.relaunch(self._strategy)
        self._strategy.start(self.job)
        self._phase = "started"
        self._job_state = JobState(self._strategy, self._replicas)
        self._replicas.job = self._job_state
        self._job_state.open()  # 2+ processes or fsdp: optimizer steps are watched
        memory.reset(self._strategy.cards)
        if self.precision == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type)
            self._skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        atexit.register(self.close)

    def close(self) -> None:
        """Leave the job: the process group goes down, the loggers are closed (flushed). Safe to call twice."""
        for logger in self.loggers if self._phase == "started" and self._strategy.is_main else ():  # where they wrote
            if callable(getattr(logger, "close", None)):
                logger.close()
        if self._phase == "started":
            self._replicas.close()
            self._job_state.close()
            self._strategy.stop()
        self._stops.restore()  # SIGTERM and SIGUSR1 as they were before the first mc.stop_requested
        self._phase = "closed"

    def __enter__(self) -> Multicard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- model, criterion, data --------------------------------------------------------------------------------
    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """The model on this process's device, wrapped by the strategy; returns it (and the optimizers, given
        back as they are: any torch optimizer, its param_groups, schedulers and state_dict work as on one card).
        The model returned reads as yours: its attributes, `.module`, and a state_dict without prefixes."""
        self._start()
        if isinstance(model, Prepared):
            raise UsageError("this model was set up already: call setup once per model")
        if optimizers and self.sharded:
            raise UsageError("under fsdp, setup replaces the parameters by their shards: build the optimizer "
                             "after model = mc.setup(model), over model.parameters()")
        if self.sync_batchnorm:  # the same parameter objects: optimizers built before keep working
            model = self._strategy.sync_batchnorm(model)
        name, model = type(own(model)).__name__, model.to(self.device)  # (the class's name before fsdp makes its own)
        syncbn.say_unsynced(model, self.world_size, self.is_main, self._job_state.warned)  # one line, once a job
        self._replicas.sharding(model)
        forward = self._strategy.wrap_model(model)
        prepared = Prepared(forward, model, self.device.type, DTYPES[self.precision], self._job_state,
                            strategy=self._strategy, reduced=self.world_size > 1, main=self.is_main)
        self._job_state.params.hold(list(prepared.parameters()))
        self._replicas.set_up(model, name)
        self.setup_optimizers(*optimizers)
        return (prepared, *optimizers) if optimizers else prepared

    def setup_optimizers(self, *optimizers: torch.optim.Optimizer) -> Any:
        """For optimizers built after setup(model): given back as they are, but fp16's step() goes through the
        gradient scaler, and on 2+ processes step(closure) gets the whole batch's loss (LBFGS steps as on one)."""
        self._start()
        for optimizer in optimizers:
            self._job_state.params.set_up(optimizer)  # its parameters outside the set-up models: averaged at each step
            closure.set_up_step(optimizer, self._strategy, self.scaler, self._skipped, self._job_state)
            self._replicas.watch(optimizer)
        self._replicas.check("after mc.setup")  # weights or settings that differ from the start
        return optimizers[0] if len(optimizers) == 1 else optimizers

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Say that `optimizer` is this process's own (a probe trained on rank 0 alone, a plain model replayed
        beside the job to compare): its steps are neither averaged nor judged, nor counted among the job's; the
        replica check goes on for everything else. Returns it."""
        self._start()
        self._job_state.params.keep_own(optimizer)
        return optimizer

    @property
    def skipped_steps(self) -> int:
        """fp16: optimizer steps the scaler skipped because a gradient overflowed (0 in other precisions)."""
        return int(self._skipped) if self._skipped is not None else 0

    def setup_criterion(self, criterion: Callable) -> Callable:
        """dp-balanced: the criterion runs on every card, on the outputs left there. Others: as it is."""
        self._start()
        return self._strategy.wrap_loss(criterion)

    def setup_dataloader(self, loader: DataLoader, train: bool = True, *, global_batch: bool = True,
                         device_data: bool | str | None = False, accumulate: int = 1,
                         seed_per_sample: bool | int = False) -> Sharded:
        """This process's share of `loader`, its batches on the device, reshuffled on each pass.
        The loader's settings are kept (workers, collate_fn, drop_last, ...); only the sampler is replaced. Its
        batch_size is the GLOBAL batch: N processes take, step by step, the samples one process takes (the plain
        loader's permutation, from the same numbers of its generator, or of rank 0's global RNG, dealt out), so
        it must split over the processes; a short last batch is weighted by rows (uneven.py). global_batch=False
        keeps batch_size per process. An IterableDataset, a batch sampler or a sampler's own draws are read whole by
        every process, each keeping its part of each batch (row t to process t % N). train=False: exact shards
        for evaluation, each sample in one process, as many batches in every process. A loader's own
        DistributedSampler is kept (set_epoch called on each pass).
        device_data=True holds a TensorDataset on the device and cuts batches there; "auto" does that on a card
        when the tensors take at most a quarter of its free memory (else says so, and copies each batch).
        seed_per_sample=True (or a seed; True: torch.initial_seed()) seeds torch, random and numpy from (seed,
        epoch, index) around each __getitem__ (data/keyed.py): N processes, and workers, draw one process's.
        accumulate=K: batch_size stays the samples per optimizer step, served as K micro-batches; after each,
        `loader.step_ends` says whether it ends its step and `loader.share` is its part of the step's samples
        (scale its loss by that: the short last step of an epoch is weighted by samples, not by count)."""
        self._start()
        rules.accumulate(accumulate, f"accumulate={accumulate!r}")
        job = self._job_state
        if train:
            job.inputs.dealt = True
        agree = None if self.world_size == 1 else self._agree
        return shard(loader, train=train, rank=self.rank, world=self.world_size, device=self.device,
                     local_batch=self._loader_batch, agree=agree, global_batch=global_batch,
                     device_data=device_data, accumulate=accumulate, seed_per_sample=seed_per_sample,
                     weights=job.share, habits=job.habits)

    def _agree(self, value: torch.Tensor, how: str) -> torch.Tensor:
        """data/order.py's Agree: rank 0's `value`, or the element-wise max, on every process."""
        value = value.to(self.device)
        agreed = self._strategy.broadcast_tensor(value, 0) if how == "broadcast" else \
            self._strategy.all_reduce(value, "max")
        return agreed.cpu()

    def _loader_batch(self, batch: int, accumulate: int = 1) -> int:
        hint = ", or setup_dataloader(loader, global_batch=False) to keep it per process"
        return self._strategy.local_batch(batch, "the DataLoader's batch_size", hint, accumulate)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model inside what setup returned (or torch.compile made of it)."""
        model = own(model)
        return model.module if isinstance(model, Prepared) else self._strategy.unwrap(model)


def launch(fn: Callable, *args: Any, strategy: str = "auto", devices: str = "auto", precision: str = "fp32",
           stop_grace: float = STOP_GRACE_S, **options: Any) -> Any:
    """fn(mc, *args) in every process of the job: Multicard(strategy, devices, precision, **options).launch(...);
    `stop_grace`: the seconds each rank gets to act on a stop signal (a save) before SIGKILL."""
    return Multicard(strategy, devices, precision, **options).launch(fn, *args, stop_grace=stop_grace)


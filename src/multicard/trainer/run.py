"""train(): the library's entry point and the body of `multicard train`. A client of the front object like any
user's script: Multicard picks the strategy and launches the processes, and each one sets up the model, the
criterion and the loaders with it, runs the loop, and has rank 0 write metrics.jsonl, summary.json, curves.png,
model.pt (and with --tensorboard, event files).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .. import safefs
from ..checkpoints import files as checkpoint
from ..checkpoints.trainer_saves import claim
from ..data.loaders import on_card
from ..errors import UsageError, say
from ..jobs import launcher_watch, progress, spawned
from ..jobs.failures import RankFailed, Stopped, said
from ..yourloop.loggers import TensorBoardLogger
from ..yourloop.memory import MB
from ..yourloop.multicard import Multicard
from .config import TrainConfig, idle
from .loop import SavedAndStopped, accuracy, fit
from .observe import straggler
from .outdir import FILES, OPTIONAL, Output, held_out
from .recipe import make_optimizer, make_scheduler
from .report import Report
from .start import Start, decide, restart


def train(model: nn.Module, train_data: Dataset, test_data: Dataset | None = None,
          config: TrainConfig | None = None, criterion: Callable | None = None,
          metric: Callable = accuracy, optimizer: Any = None, scheduler: Callable | None = None,
          step_scheduler_every: str = "epoch", **overrides) -> dict:
    """Train `model` with the strategy and devices of `config` (keyword overrides allowed, e.g. epochs=2).

    `train_data` / `test_data` yield (inputs, targets); `criterion(outputs, targets)` returns the batch mean
    (CrossEntropyLoss by default). `optimizer`: your own, built over `model.parameters()` (rebuilt with its class
    and settings in each process), or a function params -> optimizer; default: config.optimizer. `scheduler`:
    a function optimizer -> scheduler, stepped every "epoch" or every optimizer "step"
    (step_scheduler_every); default: config.scheduler. Where the strategy needs several processes they are
    spawned here, so call this under `if __name__ == "__main__":` and keep model, data, criterion and these
    functions picklable (module-level functions, functools.partial). A name (optimizer="sgd",
    scheduler="cosine") sets the config's field instead. Returns the summary.
    """
    spawned.end_if_started_again()  # a script without the guard, run again as a rank starts: the launcher says so
    for name, value in (("optimizer", optimizer), ("scheduler", scheduler)):
        if isinstance(value, str):
            overrides[name] = value
    optimizer, scheduler = (None if isinstance(v, str) else v for v in (optimizer, scheduler))
    # what the caller set: a resume takes the rest of its recipe from the checkpoint (as the CLI's flags given)
    given = set(overrides) | (config or TrainConfig()).changed()
    config = replace(config or TrainConfig(), **overrides)
    if isinstance(config.out, os.PathLike):
        config = replace(config, out=os.fspath(config.out))
    config.validate()
    if step_scheduler_every not in ("epoch", "step"):
        raise UsageError(f"step_scheduler_every={step_scheduler_every!r}: choose 'epoch' or 'step'")
    for name, data in (("training", train_data), ("test", test_data)):
        if data is not None and len(data) == 0:
            raise UsageError(f"the {name} set is empty: nothing to {'train on' if name == 'training' else 'test'}")
    mc = Multicard(config.strategy, config.devices, config.precision,
                   find_unused_parameters=config.find_unused_parameters, sync_batchnorm=config.sync_bn,
                   fsdp_blocks=config.fsdp_blocks, reshard_after_forward=config.reshard_after_forward,
                   timeout=config.timeout, replica_check=config.replica_check,
                   replica_check_every=config.replica_check_every, deterministic=config.deterministic)
    batch_given = config.batch_size is not None
    chosen = batch_given or config.accumulate > 1  # the batch given, not the auto one
    # from the beginning or from which checkpoint, with which recipe: decided once, here (start.py)
    start = decide(config, given, mc.world_size, model)
    config = start.config
    # a bad global batch fails here, before any process starts
    mc.local_batch(config.batch_size, "--batch-size", config.accumulate)
    if chosen and config.batch_size > len(train_data):  # one short step a epoch, under a batch that never ran
        said = f"--batch-size {config.batch_size}" if batch_given else \
            f"--accumulate {config.accumulate} (a global batch of {config.batch_size})"
        raise UsageError(f"{said}: the global batch is larger than the training set ({len(train_data)} samples); "
                         f"choose at most {len(train_data)}")
    recipe = (optimizer, scheduler, step_scheduler_every)
    args = (model, train_data, test_data, criterion or nn.CrossEntropyLoss(), metric)
    # rank 0 holds --out (a lock) for the whole run, restarts included; the other ranks of a launched job write
    # only their parts of checkpoints
    with Output(config.out, config.trust_dir) if mc.job.rank == 0 else contextlib.nullcontext() as output:
        summary = attempts(mc, output, args, start, recipe)
        if mc.world_size > 1 and not mc.job.launched:  # spawned processes trained copies: the caller's model ends
            checkpoint.load(model, output.root / "model.pt")  # up trained too, as with one process
    return summary


def attempts(mc: Multicard, output: Output | None, args: tuple, start: Start, recipe: tuple) -> dict:
    """Run the job as `start` says; where a process dies and restarts are left, stop all and start again from the
    newest checkpoint. Rank 0 shows the run's files in --out only once it has ended well."""
    # under torchrun --max-restarts, torchrun restarts the processes and counts (0 elsewhere)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) if mc.launcher == "torchrun" else 0
    config = start.config
    while True:
        if output is not None and start.line and (start.checkpoint is not None or not config.quiet):
            say(start.line)
        run = output.new_run() if output is not None else None
        try:
            if output is not None:  # checkpoints belong to a run: this one's, or those of the run it goes on with
                claim(output.root, start.checkpoint, output.check_checkpoints)
            summary = mc.launch(worker, *args, config, recipe, run, start.checkpoint, restarts)
            if isinstance(summary, Halted):  # every rank saved and stopped: the job ends as the signal ends it
                progress.hook_failures()  # (a script that leaves it uncaught: one line, then the signal)
                raise Stopped(summary.signum)
        except RankFailed as e:
            output.discard(run)
            # a process stopped on purpose (Ctrl-C or SIGTERM to it alone) is not restarted: someone meant it
            if restarts >= config.max_restarts or e.meant:
                if not restarts:
                    raise
                spent = f"after {restarts} restart{'s' * (restarts != 1)}"
                trace = f"{e.trace.rstrip()} ({spent})" if said(e.rank, e.trace) else \
                    f"{e.trace.rstrip()}\nmulticard: rank {e.rank} failed ({spent})"
                raise RankFailed(e.rank, trace) from None
            restarts, start = restarts + 1, restart(start, output.root)
            say(f"rank {e.rank} failed; restart {restarts} of {config.max_restarts}, from the newest checkpoint")
            output.clean()  # what the failed attempt left half-written
            continue
        except BaseException:
            if output is not None:
                output.discard(run)
            raise
        if output is not None:
            launcher_watch.end_if_orphaned(mc.job.rank)  # a rank whose launcher is gone never publishes
            output.publish(run)
            if not config.quiet:  # quiet runs (multicard check's, the bench's) write into folders of their own
                shown = [*FILES, *(name for name in OPTIONAL if (output.root / name).exists())]
                say(f"wrote {', '.join(str(output.path / name) for name in shown)}")
        return summary


@dataclass(frozen=True)
class Halted:
    """What worker returns on every rank that saved and stopped on a signal (mc.stop_requested): rank 0's comes back
    to the caller, who raises Stopped(signum) (a spawned rank's own Stopped would reach it as that rank's failure)."""
    signum: int


def worker(mc: Multicard, model: nn.Module, train_data: Dataset, test_data: Dataset | None, criterion: Callable,
           metric: Callable, config: TrainConfig, recipe: tuple = (None, None, "epoch"), run: safefs.Made | None = None,
           resume: Path | None = None, restarts: int = 0) -> dict:
    """The body of every training process: the recipe (the seeds' Adam and StepLR by default) on the user's
    model and data. Rank 0 writes the run's files into `run`, its folder, and its checkpoints into the --out that
    folder lies in (never found again by its path); `resume` names a checkpoint to go on from."""
    begin = time.perf_counter()
    folder = safefs.Folder.reopened(run, f"run folder {run.path}") if run is not None and mc.is_main else None
    out = held_out(folder, config.out) if folder is not None else None
    run = folder.via if folder is not None else None  # written through the folder made, never again by its name
    given_optimizer, given_scheduler, every = recipe
    torch.manual_seed(config.seed + mc.rank)  # per rank: dropout differs
    cuda = mc.device.type == "cuda"
    name = type(checkpoint.own(model)).__name__  # before setup (fsdp makes the class its own), inside compile
    batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    # the auto choices, settled for this process (and so recorded in summary.json's config)
    config = config.settled(mc.world_size)
    config = replace(config, channels_last=nhwc(model, config, mc),
                     device_data=held_on_device(train_data, test_data, config, mc))
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = mc.setup(model)
    optimizer = mc.setup_optimizers(make_optimizer(list(model.parameters()), config, given_optimizer))
    loss_fn = mc.setup_criterion(criterion)
    stats = mc.setup_criterion(lambda out, y: torch.stack([criterion(out, y).double(), metric(out, y).double()]))
    shuffled = torch.Generator().manual_seed(config.seed)  # the data order: the same in every process
    train_loader = mc.setup_dataloader(DataLoader(train_data, config.batch_size, shuffle=True, generator=shuffled,
                                                  num_workers=config.workers, pin_memory=cuda),
                                       device_data=config.device_data, accumulate=config.accumulate)
    test_loader = None if test_data is None else mc.setup_dataloader(
        DataLoader(test_data, config.eval_batch_size, num_workers=config.workers, pin_memory=cuda), train=False,
        device_data=config.device_data)
    steps_per_epoch = -(-len(train_loader) // config.accumulate)
    scheduler = make_scheduler(optimizer, config, steps_per_epoch, given_scheduler)
    title = (f"{name} on {len(train_data):,} samples: {mc.strategy}, {mc.world_size} process(es), "
             f"global batch {config.batch_size}")
    report = Report(run if mc.is_main else None, config, title)
    if config.tensorboard and mc.is_main and run is not None:  # fit logs through mc.log, as a user's loop would
        mc.loggers.append(TensorBoardLogger(run / "tensorboard"))
    if mc.is_main:
        for line in idle(config, mc.world_size, steps_per_epoch, name, batchnorm, mc.strategy):
            say(line)
        note = f" ({mc.device_note})" if mc.device_note else ""
        micro = f" in {config.accumulate} micro-batches" if config.accumulate > 1 else ""
        say(f"training {name} on {len(train_data)} samples: strategy {mc.strategy}, "
            f"{mc.world_size} process(es) on {mc.device.type}, global batch {config.batch_size}{micro} "
            f"({train_loader.local_batch_size} per process{' per micro-batch' if micro else ''}){note}")
    per_step = given_scheduler is None or every == "step"
    held: dict[str, int] = {}
    try:
        history = fit(mc, model, optimizer, scheduler, loss_fn, stats, train_loader, test_loader, config, per_step,
                      report.epoch, resume, held, out.via if out is not None else None)
    except SavedAndStopped as e:  # handed back as a value: a spawned rank's exception would read as its failure
        return Halted(e.signum)
    summary = summarize(mc, model, history, config, train_loader.local_batch_size, time.perf_counter() - begin)
    # what this process held at the first step: under fsdp its shards, elsewhere the whole model
    summary.update(model=name, restarts=restarts, resumed_from=str(resume) if resume else None,
                   shard_mb=mc.gather({k: round(v / MB, 2) for k, v in held.items()}))
    final = mc.state_dict(model)  # under fsdp, gathered from every process's shards onto rank 0
    if mc.is_main:
        report.finish(summary, final, history)
    mc.barrier()  # leave together: a rank that tears down while another still writes can abort gloo
    return summary


def held_on_device(train_data: Dataset, test_data: Dataset | None, config: TrainConfig, mc: Multicard) -> bool:
    """--device-data as given; auto: on a card, when both sets are tensors that take at most a quarter of its
    free memory (else one line says so, and batches are copied from host memory)."""
    if config.device_data is not None:
        return config.device_data
    sets = [d for d in (train_data, test_data) if d is not None]
    if mc.device.type != "cuda" or not all(isinstance(d, TensorDataset) for d in sets):
        return False
    fits, why = on_card([t for d in sets for t in d.tensors], mc.device)
    if why and mc.is_main:
        say(why)
    return fits


def nhwc(model: nn.Module, config: TrainConfig, mc: Multicard) -> bool:
    """Whether to store the model's conv weights channels-last: as --channels-last says; auto: for the built-in
    conv models (which say so) on the CPU, where it makes LeNet-5's steps ~25% faster (benchmarks/RESULTS.md).
    Not under fsdp, whose shards are cut from contiguous parameters."""
    if mc.sharded:
        return False
    if config.channels_last is not None:
        return config.channels_last
    return getattr(model, "channels_last", False) and mc.device.type == "cpu"


def summarize(mc: Multicard, model: nn.Module, history: list[dict], config: TrainConfig, local_batch: int,
              wall_s: float) -> dict:
    """What summary.json holds. The throughput leaves out the first epoch (start-up: lazy CUDA, cuDNN's
    autotuning, allocator growth), reported on its own, unless it is the only one."""
    names = [f"cuda:{c} {torch.cuda.get_device_name(c)}" for c in mc.cards] or ["cpu"]
    last, timed = history[-1], history[1:] or history
    # each rank's own time over the run (epochs before a resume on another number of processes left out)
    ranks = [r["rank_seconds"] for r in history if len(r.get("rank_seconds", ())) == mc.world_size]
    rank_seconds = [sum(column) for column in zip(*ranks, strict=True)] or [0.0] * mc.world_size
    slowest, lag = straggler(rank_seconds)
    return {
        "strategy": mc.strategy, "world_size": mc.world_size, "launcher": mc.launcher,
        "devices": flat(mc.gather(names)), "epochs": config.epochs, "global_batch_size": config.batch_size,
        "per_process_batch_size": local_batch * config.accumulate, "accumulate": config.accumulate,
        **{k: last[k] for k in ("train_loss", "test_loss", "test_accuracy", "test_samples") if k in last},
        "train_samples_per_s": sum(r["samples_per_s"] * r["seconds"] for r in timed)
        / max(sum(r["seconds"] for r in timed), 1e-9),
        "throughput_epochs": "all but the first" if len(history) > 1 else "the only one",
        "first_epoch_samples_per_s": history[0]["samples_per_s"],
        "optimizer_steps": sum(r["optimizer_steps"] for r in history),
        "clipped_steps": sum(r["clipped_steps"] for r in history), "skipped_steps": last["skipped_steps"],
        "rank_seconds": rank_seconds, "slowest_rank": slowest, "lag": lag,
        "wall_s": wall_s, "peak_memory_mb": flat(mc.gather(mc.peak_memory_mb())),
        "card_used_mb": flat(mc.gather(mc.card_used_mb())),  # NVML; [] where it cannot be read
        "cpu_threads": flat(mc.gather([torch.get_num_threads()])),  # per process: they move a result's last digits
        "model": type(mc.unwrap(model)).__name__, "torch": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "config": asdict(config),
    }


def flat(parts: list[list]) -> list:
    return [v for part in parts for v in part]

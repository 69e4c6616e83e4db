"""fit() and evaluate(): the trainer's loop, written once on the front object (Multicard) and nothing else: what it
does, a user's own loop can do with the same calls. It never asks which strategy it runs under.

(This module is loop.py, not train.py, so that `multicard.train` stays the public function.)
"""

from __future__ import annotations

import contextlib
import math
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from ..checkpoints import trainer_saves
from ..data.images import ImageData
from ..errors import UsageError, say
from ..jobs.failures import Stopped
from ..yourloop.memory import shard_bytes
from ..yourloop.multicard import Multicard
from . import trust
from .config import TrainConfig
from .observe import Progress, straggler


class SavedAndStopped(Stopped):
    """fit was told to stop (SIGTERM or SIGUSR1, agreed by every rank through mc.stop_requested): it saved the
    checkpoint `--resume auto` goes on from, and stopped. A Stopped: the job ends as the signal ends it."""


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).double().mean()


def count(targets) -> int:
    return len(targets) if not isinstance(targets, dict) else len(next(iter(targets.values())))


@torch.no_grad()
def evaluate(mc: Multicard, model: nn.Module, stats: Callable, loader) -> dict[str, float]:
    """Exact test loss and metric: per-batch means weighted by batch size, summed over every process (the
    loader's shards hold each test sample once)."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=mc.device)
    for inputs, targets in loader:
        n, outputs = count(targets), model(inputs)  # an empty batch too: under fsdp its forward has partners
        if n:  # a mean over no rows is NaN
            sums[:2] += stats(outputs, targets).double() * n
            sums[2] += n
    loss, correct, n = mc.all_reduce(sums).tolist()
    return {"test_loss": loss / max(n, 1), "test_accuracy": correct / max(n, 1), "test_samples": int(n)}


def fit(mc: Multicard, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, criterion: Callable,
        stats: Callable, train_loader, test_loader, config: TrainConfig, per_step: bool = True,
        on_epoch: Callable[[list[dict]], None] | None = None, resume: Path | None = None,
        held: dict | None = None, out: str | Path | None = None) -> list[dict]:
    """Train the set-up `model` for config.epochs; return one record per epoch. `criterion` and `stats` (the
    loss and the metric, stacked) are set up with mc; the loaders too (the training one with config.accumulate
    micro-batches per step). The scheduler steps after every optimizer step (`per_step`) or every epoch.
    on_epoch(history) after each epoch. `held`, if given, receives the bytes this process holds of the
    parameters, their gradients and the optimizer's state, measured at the first optimizer step (fsdp: shards).

    Checkpoints go to config.out/checkpoints (`out`: --out as rank 0 holds it open) every config.save_every epochs
    and config.save_every_steps optimizer steps; `resume` (a checkpoint's state.pt) continues from one exactly
    where it was taken. With config.save_on_signal, every rank reads mc.stop_requested after each optimizer step
    (and at each epoch's end but the last): once any rank got SIGTERM or SIGUSR1, all write a checkpoint there as a
    periodic save does, rank 0 says where and how to go on, and every rank raises SavedAndStopped.

    What it logs goes through mc.log (rank 0's loggers, e.g. TensorBoard): the mean training loss and the rate
    every few optimizer steps, and each epoch's record at the optimizer step it ended on. Each record holds
    every rank's own time (`rank_seconds`), the slowest rank and its lag over the median."""
    # same weights; `model` stays saveable
    forward = torch.compile(model, mode=config.compile_mode) if config.compile else model
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": train_loader}
    history, first_loss, steps, carried = [], None, 0, None
    if resume is not None:
        saved = mc.load(resume, dict(objects))
        history, first_loss, steps, carried = saved["history"], saved["first_loss"], saved["steps"], saved["partial"]
    bar = tqdm(total=config.epochs * len(train_loader), unit="step", dynamic_ncols=True,
               disable=config.quiet or not mc.is_main or not sys.stderr.isatty())
    steps_per_epoch = -(-len(train_loader) // config.accumulate)
    # every 10 optimizer steps, closer in a short epoch (at least ~5 points each); the loss is read (a host sync)
    # only then, and only where something is written
    log_every, logging = max(1, min(10, steps_per_epoch // 5)), mc.is_main and bool(mc.loggers)
    progress = None  # a log file or CI sees no bar: a plain line now and then instead
    if mc.is_main and bar.disable and not config.quiet and config.progress_every > 0:
        progress = Progress(config.progress_every, config.epochs, steps_per_epoch, say)
    if logging:  # a resumed run's event files start afresh in its own folder: the epochs before it go in first
        done = 0
        for record in history:
            done += record["optimizer_steps"]
            mc.log(epoch_scalars(record), done)

    saved = [-1]  # the step of the newest checkpoint: one step is written once
    # a stop signal (SIGTERM, SIGUSR1) saves the step in hand; only the main thread can take signals
    watching = config.save_on_signal and threading.current_thread() is threading.main_thread()
    if config.save_on_signal and not watching and mc.is_main:
        say("--save-on-signal: off in this run: it trains outside the main thread, where Python sets no signal "
            "handlers (SIGTERM and SIGUSR1 stop it without a checkpoint)")
    nothing = contextlib.nullcontext()
    trusted = trust.trusted(config.trust_dir)

    # checkpoints/ held from the first save to the end of the loop (an error leaves it to the folder's own close)
    checkpointer = trainer_saves.Checkpointer(mc, out or config.out,
                                      lambda fd, what, folder: trust.check_folder(fd, what, folder, trusted))

    def save(partial: dict | None) -> None:
        progress = {"history": history, "first_loss": first_loss, "steps": steps, "partial": partial,
                    "config": asdict(config)}
        checkpointer.save(steps, {**objects, **progress}, config.keep_checkpoints)
        saved[0] = steps

    def stop(partial: dict | None) -> None:  # every rank, at the read that agreed on the stop
        if saved[0] != steps:
            save(partial)
        if mc.is_main:
            say(stop_line(mc.stop_signal, steps, config))
        raise SavedAndStopped(signal.Signals[mc.stop_signal])

    for epoch in range(train_loader.epoch, config.epochs):
        model.train()
        # this epoch's sums so far in this process; a resumed epoch starts from the whole job's (on rank 0)
        loss_sum, clipped = (torch.zeros((), dtype=torch.float64, device=mc.device) for _ in range(2))
        samples, lrs, before = 0, [], 0.0
        if carried is not None:
            if mc.rank == 0:
                loss_sum += carried["sums"][0]
                samples, clipped = int(carried["sums"][1]), clipped + carried["sums"][2]
            lrs, before, carried = carried["lrs"], carried["seconds"], None

        logged = (float(loss_sum), samples) if logging else None  # the sums at the last logged step
        key_augmentation(train_loader, config.seed, epoch)
        start, waited = time.perf_counter(), 0.0  # waited: in backward and checkpoints, where ranks meet
        for inputs, targets in train_loader:
            ends = train_loader.step_ends
            # no all-reduce until the step's last micro-batch (a step of one needs no context: ~6 µs a step saved)
            with nothing if ends else mc.no_backward_sync(model):
                loss = criterion(forward(inputs), targets)
                began = time.perf_counter()
                share = train_loader.share  # weighted by samples: the step's mean, not K means (1: no extra op)
                mc.backward(loss * share if share != 1 else loss)
                waited += time.perf_counter() - began  # ddp waits for the slowest rank here: not our own time
            if first_loss is None:
                first_loss = loss.item()  # the loss before any step: where "blown up" is measured from
            n = count(targets)
            loss_sum.add_(loss.detach(), alpha=n)  # one op: float32 loss into the float64 sum
            samples += n
            if ends:
                if config.clip_grad_norm:
                    clipped += mc.clip_gradients(model, optimizer, config.clip_grad_norm) > config.clip_grad_norm
                lrs.append(optimizer.param_groups[0]["lr"])
                optimizer.step()
                if held is not None and not held:  # gradients and optimizer state all exist now
                    held.update(shard_bytes(model, optimizer))
                optimizer.zero_grad(set_to_none=True)
                if per_step:
                    scheduler.step()
                steps += 1
                if logging and steps % log_every == 0:  # rank 0's mean loss over the steps since the last point
                    total = float(loss_sum)
                    mc.log({"train/loss": (total - logged[0]) / max(samples - logged[1], 1), "train/lr": lrs[-1]},
                           steps)
                    logged = (total, samples)
                if config.save_every_steps and steps % config.save_every_steps == 0:
                    began = time.perf_counter()
                    seconds = before + began - start
                    save({"sums": totals(mc, loss_sum, samples, clipped), "lrs": lrs, "seconds": seconds})
                    waited += time.perf_counter() - began
                if watching and mc.stop_requested:  # every rank, every step: agreed at the same one
                    seconds = before + time.perf_counter() - start
                    stop({"sums": totals(mc, loss_sum, samples, clipped), "lrs": lrs, "seconds": seconds})
            bar.update()
            if progress is not None:
                progress.tick(epoch + 1, len(lrs), n * mc.world_size)
        # this rank's own time (data, forward, optimizer): the loop's, less where it may have waited for the others
        own = torch.zeros(mc.world_size, dtype=torch.float64)
        own[mc.rank] = time.perf_counter() - start - waited
        rank_seconds = mc.all_reduce(own).tolist()
        slowest, lag = straggler(rank_seconds)
        loss_sum, samples, clipped_steps = totals(mc, loss_sum, samples, clipped)
        seconds = before + time.perf_counter() - start  # after the reduction's .tolist(): the device work is done
        if not per_step:
            scheduler.step()
        record = {"epoch": epoch + 1, "train_loss": loss_sum / samples, "lr": sum(lrs) / max(len(lrs), 1),
                  "samples_per_s": samples / seconds, "seconds": seconds, "optimizer_steps": len(lrs),
                  "clipped_steps": int(clipped_steps), "skipped_steps": mc.skipped_steps,
                  "rank_seconds": rank_seconds, "slowest_rank": slowest, "lag": lag}
        if test_loader is not None:
            record.update(evaluate(mc, forward, stats, test_loader))
        diverged(record, first_loss, config)
        mc.log(epoch_scalars(record), steps)
        bar.set_postfix(loss=f"{record['train_loss']:.4f}", acc=f"{record.get('test_accuracy', 0):.4f}")
        history.append(record)
        if on_epoch is not None:
            on_epoch(history)
        if config.save_every and (epoch + 1) % config.save_every == 0 and saved[0] != steps:
            save(None)  # (a checkpoint after the epoch's last step resumes to this same point)
        if watching and epoch + 1 < config.epochs and mc.stop_requested:  # got during the evaluation
            stop(None)  # (after the last epoch the run finishes instead: its files are the whole result)
    checkpointer.close()
    bar.close()
    return history


def stop_line(signal_name: str, steps: int, config: TrainConfig) -> str:
    """What rank 0 says as a stopped run ends: where its checkpoint is, and the command that goes on from it (the
    same `multicard train` flags with --resume auto; from Python, the same train() call with resume="auto")."""
    folder = Path(config.out) / trainer_saves.FOLDER / f"step-{steps:08d}"
    argv = sys.argv
    program = Path(argv[0]) if argv else Path()
    if argv[1:2] == ["train"] and (program.name == "multicard" or program.parts[-2:] == ("multicard", "__main__.py")):
        kept, words = [], iter(argv[2:])
        for word in words:
            if word == "--resume":
                next(words, None)  # and its value
            elif not word.startswith("--resume="):
                kept.append(word)
        again = shlex.join(["multicard", "train", *kept, "--resume", "auto"])
    else:
        again = f"the same multicard.train(...) call with out={config.out!r}, resume=\"auto\""
    return f"stopped by {signal_name} after step {steps}: checkpoint {folder} written; go on with: {again}"


def key_augmentation(loader, seed: int, epoch: int) -> None:
    """Before a pass: an ImageData training set draws each sample's augmentation from (seed, epoch, sample index)
    alone, so the weights do not depend on the processes, the micro-batches or a resume (its loader's workers
    copy it when the pass starts, with this key)."""
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, ImageData):
        dataset.set_epoch(epoch, seed)


def epoch_scalars(record: dict) -> dict[str, float]:
    """An epoch's record as mc.log takes it: epoch/<key> for each number, rank_seconds/<rank> for each rank."""
    scalars = {f"epoch/{k}": v for k, v in record.items() if k != "epoch" and isinstance(v, (int, float))}
    return {**scalars, **{f"rank_seconds/{r}": s for r, s in enumerate(record.get("rank_seconds", ()))}}


def totals(mc: Multicard, loss_sum: torch.Tensor, samples: int, clipped: torch.Tensor) -> list[float]:
    """An epoch's sums so far over every process: loss x samples, samples, clipped steps."""
    return mc.all_reduce(torch.stack([loss_sum, loss_sum.new_tensor(samples), clipped])).tolist()


def diverged(record: dict, first_loss: float, config: TrainConfig) -> None:
    """One line naming --lr when the training loss is not a number, or has blown up to more than 10 times its
    value before the first step (--lr 100 on LeNet-5: a loss of 1e15 and 10% accuracy, which is no result)."""
    loss = record["train_loss"]
    if math.isfinite(loss) and (loss <= 10 * first_loss or loss <= first_loss + 1):
        return
    why = f"is {loss}" if not math.isfinite(loss) else f"rose from {first_loss:.3g} to {loss:.3g}"
    raise UsageError(f"epoch {record['epoch']}: the training loss {why}: training diverged; try a smaller --lr "
                     f"(this run: {config.lr:g})")

"""TrainConfig: every knob of a run in one dataclass. The CLI builds its flags from these fields.

This module must not import torch: `multicard --help` reads it and must answer at once.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace

from .. import rules
from ..errors import UsageError
from ..jobs.protocol import TRUST_DIR
from ..rules import PRECISIONS, REPLICA_CHECK_EVERY, REPLICA_CHECKS, STRATEGIES
from ..yourloop.loggers import need_tensorboard


def opt(default, help: str, **meta):
    """A dataclass field that carries its --help text."""
    return field(default=default, metadata={"help": help, **meta})


# the auto recipe (docs/recipes.md): the global batch, the passes, and the peak rate of each optimizer at that batch
BATCH, EPOCHS = 256, 16
LR = {"adam": 8e-3, "adamw": 8e-3, "sgd": 0.1}
OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULERS = ("step", "cosine", "onecycle", "none")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
# train --help shows the flags in these groups (title: what they set, the fields), in this order
FLAG_GROUPS = {
    "data: what it learns from": ("data", "data_dir", "download", "synthetic_samples", "augment", "workers",
                                  "device_data", "eval_batch_size"),
    "model: what trains, and how it computes": ("model", "precision", "channels_last", "compile", "compile_mode",
                                                "deterministic"),
    "optimization: the recipe (auto: docs/recipes.md)": (
        "epochs", "batch_size", "lr", "optimizer", "momentum", "nesterov", "weight_decay", "scheduler", "lr_step",
        "lr_gamma", "warmup_epochs", "accumulate", "clip_grad_norm", "seed"),
    "strategy: how the processes and cards share the work": (
        "strategy", "devices", "fsdp_blocks", "reshard_after_forward", "find_unused_parameters", "sync_bn", "timeout",
        "replica_check", "replica_check_every"),
    "checkpoints: saving, resuming, restarting": ("save_every", "save_every_steps", "keep_checkpoints",
                                                  "save_on_signal", "resume", "max_restarts"),
    "output: what it shows and writes": ("quiet", "out", "trust_dir", "tensorboard", "progress_every"),
}


@dataclass
class TrainConfig:
    # what to train
    model: str = opt("lenet5", "lenet5, resnet8, another registered name, or your own: file.py:Class or "
                     "package.module:Class")
    data: str = opt("mnist-5k", "mnist-5k (embedded), mnist, fashion-mnist or synthetic")
    # mnist / fashion-mnist IDX files are looked for directly in this folder
    data_dir: str | None = opt(None, "folder holding the four IDX files of mnist / fashion-mnist")
    # fetching data is opt-in: a run never touches the network unless asked
    download: bool = opt(False, "download mnist / fashion-mnist into the cache if missing (checksummed)")
    # synthetic data: big enough for a timed epoch, small enough to build in a blink
    synthetic_samples: int = opt(8192, "training samples of --data synthetic (its test set is always 1,024)")

    # where to train
    # auto: ddp on 2+ cards, single on 1 card or on the CPU
    strategy: str = opt("auto", "auto, single, ddp, dp, dp-balanced or fsdp", choices=STRATEGIES)
    # auto: every visible card, else the CPU; cpu:N runs N processes (ddp on gloo)
    devices: str = opt("auto", "auto, cpu, cpu:N, a card count N, card ids 0,1 or cuda:1; a card named twice (0,0) "
                       "rehearses 2 cards on one, over gloo")
    # fsdp shards the model's repeated blocks (a ModuleList's or Sequential's children of one class) by default
    fsdp_blocks: str = opt("", "fsdp: class names of the blocks to shard one by one, e.g. TransformerBlock "
                           "(default: the model's repeated blocks)")
    # True: least memory (a block's parameters gathered again for backward); False: one all-gather less per block
    reshard_after_forward: bool = opt(True, "fsdp: free each block's gathered parameters after its forward")
    # a model without unused parameters would pay for the extra graph walk for nothing
    find_unused_parameters: bool = opt(False, "ddp: allow parameters that get no gradient")

    # the recipe (docs/recipes.md): Adam with a one-cycle rate, batch 256, light augmentation; None is "auto",
    # settled for the job by TrainConfig.settled. The seeds' recipe is --batch-size 64 --lr 1e-3 --scheduler step
    # --epochs 30 (2.7x the time on 2 CPU cores, and no better)
    epochs: int = opt(EPOCHS, "passes over the training data")
    # GLOBAL batch: samples per optimizer step, whatever the strategy (ddp splits it per process)
    batch_size: int | None = opt(None, f"global batch size: samples per optimizer step, split over processes "
                                 f"(auto: {BATCH}, rounded down to a multiple of the processes)")
    # evaluation keeps no activations for backward, so it can take big batches
    eval_batch_size: int = opt(1000, "global batch size for evaluation")
    lr: float | None = opt(None, f"learning rate: the peak, after any warm-up (auto: {LR['adam']:g} for adam and "
                           f"adamw, {LR['sgd']:g} for sgd at batch {BATCH}, scaled by the square root of the batch's "
                           f"ratio to {BATCH})")
    # the seeds' Adam; SGD with momentum for the classic recipes; AdamW decouples the weight decay
    optimizer: str = opt("adam", "adam, adamw or sgd", choices=OPTIMIZERS)
    # SGD's usual momentum; Adam and AdamW keep their own betas
    momentum: float = opt(0.9, "sgd: momentum (0 for plain SGD)")
    nesterov: bool = opt(False, "sgd: Nesterov momentum")
    # 0: no decay; AdamW's decay is decoupled from the gradient, the others add it to the gradient
    weight_decay: float = opt(0.0, "weight decay (L2 for adam and sgd, decoupled for adamw)")
    # step: the seeds' StepLR, once per epoch; cosine and onecycle change the rate every optimizer step
    scheduler: str = opt("onecycle", "onecycle, cosine, none (per optimizer step) or step (StepLR per epoch)",
                         choices=SCHEDULERS)
    # the seeds step the rate down with StepLR; here counted in epochs
    lr_step: int = opt(20, "step: multiply the rate by --lr-gamma every this many epochs")
    lr_gamma: float = opt(0.1, "step: the factor")
    # a linear ramp from ~0 to --lr over the first epochs (fractions allowed), before the schedule
    warmup_epochs: float = opt(0.0, "epochs of linear warm-up to --lr (fractions allowed; onecycle: its rise)")
    # K micro-batches per optimizer step: the same update as the whole --batch-size, in 1/K of the memory
    accumulate: int = opt(1, "micro-batches per optimizer step (--batch-size stays the samples per step)")
    # 0: off; else the norm over all parameters of the whole model, however the gradients are spread
    clip_grad_norm: float = opt(0.0, "clip the gradients' total norm to this (0: off)")
    # small random rotations, scalings and shifts: +1.5 points on 4,000 training images
    augment: bool = opt(True, "randomly rotate / scale / shift training images")
    # one seed makes a run repeatable; each rank adds its rank for what should differ (dropout)
    seed: int = opt(0, "random seed")
    # data is held in memory and indexed a batch at a time: loader processes rarely pay off
    workers: int = opt(0, "DataLoader worker processes per training process")

    # the fast path for small models: data lives on the card, batches are cut and augmented there, no DataLoader
    device_data: bool | None = opt(None, "hold the whole dataset on the device and cut (and augment) batches there "
                                   "(auto: on a card when it fits in a quarter of the card's free memory)")
    # conv kernels run ~20-25% faster in NHWC on the CPU (not yet measured on cards); a user's model may .view() its
    # activations, so auto leaves it alone
    channels_last: bool | None = opt(None, "conv weights and activations in channels-last (NHWC) layout "
                                     "(auto: on for the built-in conv models on the CPU; off for your own, and on "
                                     "cards)")
    # exact fp32 stays the default; bf16 autocast is faster on cards at a small cost in precision; fp16 needs a
    # gradient scaler (steps with inf/nan gradients are skipped, and counted in the summary)
    precision: str = opt("fp32", "fp32, bf16 (autocast) or fp16 (autocast + gradient scaler)", choices=PRECISIONS)
    # BatchNorm statistics per process differ from one process's; synchronized, they are the whole batch's
    sync_bn: bool = opt(False, "ddp, fsdp: BatchNorm layers compute their statistics over all processes")
    # compiling costs tens of seconds up front; worth it only for long runs on cards
    compile: bool = opt(False, "torch.compile the model")
    # reduce-overhead records the step's kernels as CUDA graphs and replays them: for small models on cards, where
    # launching kernels one by one costs more than running them
    compile_mode: str = opt("default", "with --compile: default, reduce-overhead (CUDA graphs) or max-autotune",
                            choices=COMPILE_MODES)
    # on the CPU a run repeats bit for bit anyway; on a card cuDNN's autotuning and atomic adds make the last digits
    # differ run to run: this pins them (docs/distributed.md, "On a card"), at some cost in speed
    deterministic: bool = opt(False, "the same result run after run on a card too: torch's deterministic "
                              "algorithms, cuDNN without autotuning, cuBLAS's fixed workspace")

    # never lose a run: checkpoints to resume from, restarts, and no silent hang
    save_every: int = opt(0, "write a checkpoint into --out/checkpoints every this many epochs (0: never)")
    save_every_steps: int = opt(0, "write a checkpoint every this many optimizer steps (0: never)")
    keep_checkpoints: int = opt(2, "checkpoints kept (the newest; 0 keeps all)")
    # a preempted job keeps its work: every rank agrees on the stop at one step (mc.stop_requested, read every step;
    # the ranks meet about once a second), saves there and exits 128+signal; --resume auto goes on bit for bit. Not
    # SIGINT (Ctrl-C)
    save_on_signal: bool = opt(True, "on SIGTERM or SIGUSR1 (SLURM's --signal=USR1@90), finish the step in hand, "
                               "write a checkpoint into --out/checkpoints and exit; --resume auto goes on from it")
    # auto: the newest checkpoint in --out/checkpoints, or a fresh start if there is none
    # a resumed run is the run it continues: its recipe comes from the checkpoint (resume.inherit)
    resume: str = opt("", "continue exactly from a checkpoint: auto (the newest in --out; none: start afresh) or "
                      "its PATH; the run's recipe comes with it (a flag given changes what a run can change "
                      "half-way, e.g. --epochs of a step schedule, --save-every; others are refused)")
    # spawned runs only; under torchrun use its own --max-restarts with --resume auto
    max_restarts: int = opt(0, "when a process dies: stop all, start again from the last checkpoint, this "
                            "many times")
    # a LeNet-5 step takes milliseconds: 120 s without progress is a frozen or missing process, never slowness
    timeout: float = opt(120.0, "seconds a collective or the rendezvous may wait for a process before the job "
                         "stops, naming it")
    # the promise checked: N processes hold one model; a fingerprint of it compared costs under 1% of the steps
    replica_check: str = opt("stop", "2+ processes: where the processes' models part (compared after setup, a "
                             "resume and every --replica-check-every steps): stop naming what differs, warn once, or "
                             "off", choices=REPLICA_CHECKS)
    replica_check_every: int = opt(REPLICA_CHECK_EVERY, "optimizer steps between replica checks")

    # output
    quiet: bool = opt(False, "no progress bar, no per-epoch lines, no list of the files written")
    # a rerun with the same --out replaces that run's files
    out: str = opt("runs/train", "folder for metrics.jsonl, summary.json, curves.png and model.pt")
    # like git's safe.directory: --out, its checkpoints and the folders above --out must otherwise be yours (or
    # root's) and not writable by others, or someone could swap them for a link (trainer/trust.py)
    # one path as given, ":" included; held as a list of str, as summary.json holds it; the library takes a str, a
    # path or a list of them (__post_init__); never taken from a checkpoint (recipe.inherit)
    trust_dir: list[str] = opt((), "a folder to write in although another user owns it or may write into it "
                                     "(a shared project folder, a container's bind mount): it, the folders in it and "
                                     f"above it; several: the flag again; also {TRUST_DIR} (several "
                                     "separated by ':')", many=True)
    # rank 0 writes event files into the run's folder: --out/tensorboard once the run has ended well
    tensorboard: bool = opt(False, "write TensorBoard event files into --out/tensorboard (per-step loss and lr, "
                            "per-epoch metrics; pip install 'multicard[tensorboard]')")
    # a log file or CI gets no progress bar: a plain line now and then shows the run is alive
    progress_every: float = opt(30.0, "seconds between plain progress lines when stderr is not a terminal "
                                "(0: none)")

    def __post_init__(self) -> None:
        # trust_dir: one folder (a str or a path, ":" and all) or several (a list or tuple); "" names none
        given = self.trust_dir
        try:
            many = [given] if isinstance(given, (str, os.PathLike)) else list(given or ())
            self.trust_dir = [name for name in map(os.fspath, many) if name]
            if not all(isinstance(name, str) for name in self.trust_dir):
                raise TypeError
        except TypeError:
            raise UsageError(f"trust_dir={given!r}: name a folder (a str or a path), or a list of them") from None

    def settled(self, processes: int = 1) -> TrainConfig:
        """This config with its auto values made concrete for a job of `processes` (the rule of
        docs/recipes.md): the batch is 256 rounded down to a multiple of processes x accumulate, the rate the
        optimizer's peak at 256 scaled by sqrt(batch / 256). Settled fields stay as they are."""
        batch = self.batch_size
        if batch is None:
            parts = processes * self.accumulate
            batch = max(parts, BATCH // parts * parts)
        lr = self.lr if self.lr is not None else LR[self.optimizer] * math.sqrt(batch / BATCH)
        return replace(self, batch_size=batch, lr=lr)

    def changed(self) -> set[str]:
        """The fields set otherwise than a TrainConfig() has them (compared with one: a field whose default is a
        default_factory has no f.default to compare with)."""
        default = TrainConfig()
        return {f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    def validate(self) -> None:
        """Refuse settings that cannot work, before anything runs (torch would fail later, some after an epoch).
        The library calls this too: TrainConfig(precision="fp8") is refused, never trained in fp32."""
        for flag, value, least in (("--epochs", self.epochs, 1), ("--lr-step", self.lr_step, 1),
                                   ("--batch-size", 1 if self.batch_size is None else self.batch_size, 1),
                                   ("--workers", self.workers, 0), ("--eval-batch-size", self.eval_batch_size, 1),
                                   ("--save-every", self.save_every, 0),
                                   ("--save-every-steps", self.save_every_steps, 0),
                                   ("--keep-checkpoints", self.keep_checkpoints, 0),
                                   ("--max-restarts", self.max_restarts, 0),
                                   ("--synthetic-samples", self.synthetic_samples, 1)):
            rules.at_least(value, f"{flag} {value}", least)
        rules.accumulate(self.accumulate, f"--accumulate {self.accumulate}")
        rules.replica_check_every(self.replica_check_every, f"--replica-check-every {self.replica_check_every}")
        if self.workers > (most := max(64, 4 * (os.cpu_count() or 1))):
            raise UsageError(f"--workers {self.workers}: at most {most} DataLoader worker processes per training "
                             f"process on this machine ({os.cpu_count()} CPU cores); 0 to 2 per core is plenty")
        if not -2**63 <= self.seed < 2**63:  # what torch's generators take
            raise UsageError(f"--seed {self.seed}: out of range (from {-2**63} to {2**63 - 1})")
        rules.timeout(self.timeout, f"--timeout {self.timeout:g}")
        for flag, value in (("--lr", 1 if self.lr is None else self.lr), ("--lr-gamma", self.lr_gamma)):
            if not 0 < value < math.inf:  # also refuses nan
                raise UsageError(f"{flag} {value}: must be a positive number")
        for flag, value in (("--weight-decay", self.weight_decay), ("--clip-grad-norm", self.clip_grad_norm),
                            ("--warmup-epochs", self.warmup_epochs), ("--progress-every", self.progress_every)):
            if not 0 <= value < math.inf:
                raise UsageError(f"{flag} {value}: must be a number of 0 or more")
        if not self.out:
            raise UsageError("--out '': name a folder (it is created if missing)")
        if self.tensorboard:
            need_tensorboard("--tensorboard")
        if not 0 <= self.momentum < 1:
            raise UsageError(f"--momentum {self.momentum}: must be at least 0 and below 1")
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            raise UsageError("--nesterov needs --optimizer sgd and a --momentum above 0")
        if self.warmup_epochs > self.epochs:
            raise UsageError(f"--warmup-epochs {self.warmup_epochs:g}: longer than the run (--epochs {self.epochs})")
        rules.strategy(self.strategy, f"--strategy {self.strategy}")
        rules.precision(self.precision, f"--precision {self.precision}")
        rules.replica_check(self.replica_check, f"--replica-check {self.replica_check}")
        for flag, value, allowed in (("--optimizer", self.optimizer, OPTIMIZERS),
                                     ("--scheduler", self.scheduler, SCHEDULERS),
                                     ("--compile-mode", self.compile_mode, COMPILE_MODES)):
            rules.one_of(value, f"{flag} {value}", allowed)


def idle(config: TrainConfig, processes: int, steps_per_epoch: int, model: str, batchnorm: bool,
         strategy: str = "single") -> list[str]:
    """A line for each flag that has no effect on this run, and why (a flag that quietly does nothing would let a
    user believe in checkpoints, statistics or settings they do not have)."""
    default = TrainConfig()
    lines = [f"{flag} {value}: no effect {why}" for flag, value, why, unused in (
        ("--momentum", config.momentum, f"with --optimizer {config.optimizer} (sgd only)",
         config.optimizer != "sgd" and config.momentum != default.momentum),
        ("--lr-step", config.lr_step, f"with --scheduler {config.scheduler} (step only)",
         config.scheduler != "step" and config.lr_step != default.lr_step),
        ("--lr-gamma", config.lr_gamma, f"with --scheduler {config.scheduler} (step only)",
         config.scheduler != "step" and config.lr_gamma != default.lr_gamma),
        ("--compile-mode", config.compile_mode, "without --compile",
         not config.compile and config.compile_mode != default.compile_mode),
        ("--fsdp-blocks", config.fsdp_blocks, f"under {strategy} (fsdp only)",
         strategy != "fsdp" and bool(config.fsdp_blocks)),
    ) if unused]
    steps = steps_per_epoch * config.epochs
    epochs = f"{config.epochs} epoch{'s' * (config.epochs != 1)}"
    if config.save_every_steps > steps:
        lines.append(f"--save-every-steps {config.save_every_steps}: no effect, this run has {steps} optimizer "
                     f"steps ({epochs} of {steps_per_epoch}); it writes no checkpoint by steps")
    if config.save_every > config.epochs:
        lines.append(f"--save-every {config.save_every}: no effect, this run has {epochs}; it writes no "
                     f"checkpoint by epochs")
    if config.sync_bn and processes == 1:
        lines.append("--sync-bn: no effect with one process (its BatchNorm statistics are the whole batch's)")
    elif config.sync_bn and not batchnorm:
        lines.append(f"--sync-bn: no effect, {model} has no BatchNorm layer")
    return lines

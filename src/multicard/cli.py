"""The command line: multicard train | run | check | bench | env. Flags come from the TrainConfig fields.
Imports stay light here (no torch at module level): `multicard --help` must answer at once."""

from __future__ import annotations

import argparse
import atexit
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

from .errors import UsageError
from .jobs import broken_pipe
from .rules import REPLICA_CHECKS, STRATEGIES
from .trainer.config import FLAG_GROUPS, TrainConfig


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag or value answered in one line (not the whole usage) and exit 2."""

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 (argparse's own signature)
        parsed, extra = self.parse_known_args(args, namespace)
        # a bad flag is named by the subcommand it was given to (argparse would name only `multicard`)
        command = getattr(parsed, "command", None)
        prog = f"{self.prog} {command}" if command else self.prog
        if extra:
            flag = extra[0].partition("=")[0]
            self.fail(prog, f"{flag}: not a flag of {prog}" if flag.startswith("-") else f"{flag}: unexpected")
        for name, number in vars(parsed).items():  # torch takes 64-bit integers: a larger one is its traceback
            if type(number) is int and not -2**63 <= number < 2**63:
                self.fail(prog, f"--{name.replace('_', '-')} {number}: out of range (from {-2**63} to {2**63 - 1})")
        return parsed

    def error(self, message: str):  # noqa: ANN201 (never returns)
        self.fail(self.prog, plain(message))

    def fail(self, prog: str, message: str):  # noqa: ANN201 (never returns)
        self.exit(2, f"{prog}: {message} (see {prog} --help)\n")


def plain(message: str) -> str:
    """argparse's error, said as the rest of multicard says errors: the flag, the value, what is wrong."""
    if m := re.fullmatch(r"argument (\S+?)(?:/\S+)?: invalid choice: '(.*)' \(choose from (.*)\)", message):
        return f"{m[1]} {m[2]}: choose one of {m[3].replace(chr(39), '')}"
    if m := re.fullmatch(r"argument (\S+?)(?:/\S+)?: invalid (int|float) value: '(.*)'", message):
        return f"{m[1]} {m[3]}: not {NUMBERS[m[2]]}"  # a flag of argparse's own int or float (bench's)
    if m := re.fullmatch(r"argument (\S+?)(?:/\S+)?: (.*)", message):
        return f"{m[1]}: needs a value" if m[2].startswith("expected one argument") else f"{m[1]} {m[2]}"
    if m := re.fullmatch(r"the following arguments are required: (.*)", message):
        return f"name a command: {COMMANDS}" if m[1] == "command" else f"missing {m[1]}"
    return message


COMMANDS = "train, run, check, bench or env"
CHECK = ("K SGD steps on one device vs N (default: every card, else cpu:2), gradients and weights compared, for ddp, "
         "dp and dp-balanced as this machine can run them, or the one --strategy names (fsdp included)")
EXAMPLES = """examples:
  multicard train                              train LeNet-5 on the embedded mnist-5k, here
  multicard train --devices cpu:2              the same in 2 processes (ddp over gloo)
  multicard run --devices cpu:2 my_script.py   your own loop (a script using multicard.Multicard) in 2 processes
  multicard check                              N processes learn what one learns
  multicard env                                what this machine offers

each command's flags: multicard COMMAND --help; the docs: README.md and docs/ (docs/cli.md: every command)"""
NUMBERS = {"int": "a whole number", "float": "a number"}


def value(kind: type, auto: bool = False) -> Callable[[str], Any]:
    """An argparse type: a number (its error one line: "abc: not a number"); with `auto`, also "auto" (None:
    the value the job settles on)."""

    def parse(text: str) -> Any:
        if auto and text == "auto":
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text}: not {NUMBERS[kind.__name__]}"
                                             + (" (or auto)" if auto else "")) from None

    return parse


def add_config_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """A flag per TrainConfig field (or per field in `only`; all of them: in FLAG_GROUPS' groups). A flag not given
    leaves no attribute behind (argparse.SUPPRESS): given() tells the flags a user typed from the defaults, which
    --resume needs."""
    groups = [(parser.add_argument_group(*title.split(": ", 1)), names) for title, names in FLAG_GROUPS.items()
              if only is None]
    group = {name: g for g, names in groups for name in names}
    for f in fields(TrainConfig):
        if only is not None and f.name not in only:
            continue
        default = f.default if f.default is not MISSING else None
        flag = "--" + f.name.replace("_", "-")
        help = f.metadata.get("help", "")
        if "(default:" not in help:  # a help that says its default in words keeps them
            help += f" (default: {'auto' if default is None else 'none' if default in ('', ()) else default})"
        kind = str(f.type).removesuffix(" | None")  # None: auto, settled for the job
        add = group.get(f.name, parser).add_argument
        if kind == "bool":
            add(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help)
        elif f.metadata.get("many"):  # each value whole (--trust-dir A --trust-dir B), a list
            add(flag, action="append", type=str, default=argparse.SUPPRESS, help=help, metavar=f.name.upper())
        else:
            number = {"int": int, "float": float}.get(kind)
            add(flag, type=value(number, default is None) if number else str, default=argparse.SUPPRESS, help=help,
                metavar=f.name.upper(), choices=f.metadata.get("choices"))


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields the command line set, with their values."""
    return {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}


def config_from(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**given(args))


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from . import data, models
    from .trainer.run import train
    from .trainer.start import decide

    flags = given(args)
    config = TrainConfig(**flags)
    config.validate()
    # the model and the data are the resumed run's, unless given (and then refused if other); train decides the
    # same way, with the job's processes
    config = decide(config, set(flags)).config
    torch.manual_seed(config.seed)  # the same initial weights in every process and every run
    model = models.build(config.model)
    shape = getattr(model, "input_shape", (1, 28, 28))
    train_data, test_data = data.load(config.data, config.data_dir, config.download, config.augment,
                                      config.synthetic_samples, config.seed, shape)
    if tuple(train_data.tensors[0].shape[1:]) != tuple(shape):
        raise UsageError(f"--model {config.model} takes {'x'.join(map(str, shape))} images, --data {config.data} "
                         f"has {'x'.join(map(str, train_data.tensors[0].shape[1:]))}; use --data synthetic")
    # the flags given, as overrides: what a resume does not take from its checkpoint (--model, which would clash
    # with train's own argument, was checked against it above)
    train(model, train_data, test_data, config, **{k: v for k, v in flags.items() if k != "model"})
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    if args.script:  # the script's own training on one process and on N
        from .tools.check_script import run

        return run(args, given(args))
    from .tools.parity import check

    steps = 20 if args.steps is None else args.steps  # (only the flags check uses are taken into the config)
    results = check(config_from(args), steps, args.tolerance)
    for result in results:
        print("\n".join(result.lines()))
    return 0 if all(r.ok for r in results) else 1


# what multicard check uses of a training run's flags; the others are refused (it would ignore them)
CHECK_FLAGS = ("model", "data", "data_dir", "download", "synthetic_samples", "strategy", "devices", "batch_size",
               "accumulate", "clip_grad_norm", "sync_bn", "seed")


def cmd_run(args: argparse.Namespace) -> int:
    from .tools.script import run

    return run(args, args.own_flags)


def cmd_env(args: argparse.Namespace) -> int:
    import platform

    import torch

    from .jobs.devices import cpu_threads, omp_threads
    from .jobs.dist import job_from_env
    from .tools.bench_report import cpu_name

    print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPU cores")
    one = cpu_threads(1, torch.get_num_threads())  # OMP_NUM_THREADS, where set, read by torch (up to the cores)
    pair = omp_threads(2, os.environ).get("OMP_NUM_THREADS", one)
    print(f"CPU: {cpu_name()}; torch threads: {one} in one process, {pair} in each of 2 (cpu:2)"
          + (f"; OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} here" if os.environ.get("OMP_NUM_THREADS") else ""))
    print(f"CUDA available: {torch.cuda.is_available()}, cards: {torch.cuda.device_count()}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB")
    dist = torch.distributed
    print(f"backends: gloo {dist.is_gloo_available()}, nccl {dist.is_nccl_available()}")
    print(f"launcher: {job_from_env()}")
    return 0


def parser() -> argparse.ArgumentParser:
    from . import __version__

    p = Parser(prog="multicard", description="Train PyTorch models on one CPU, one card or many, with one loop: "
               "--strategy single | ddp | dp | dp-balanced | fsdp.", epilog=EXAMPLES,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"multicard {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model (no flags: LeNet-5 on the embedded mnist-5k)",
                       description="Train a model with multicard's own loop (no flags: LeNet-5 on the embedded "
                       "mnist-5k, the default recipe); what it writes: docs/outputs.md.")
    add_config_flags(t)
    t.set_defaults(run=cmd_train)
    c = sub.add_parser("check", help=f"parity: {CHECK}; or your script's training on one process vs N",
                       description=f"Parity: {CHECK}; exit status 1 where they differ by more than --tolerance. "
                       "With a script (multicard check [--devices D] [--strategy ddp|dp|dp-balanced] script.py "
                       "[its arguments]): the script runs twice, on one process and on N, in this folder, and its "
                       "set-up models' weights are compared after each optimizer step (docs/cli.md).")
    add_config_flags(c, CHECK_FLAGS)
    c.add_argument("--steps", type=int, help="optimizer steps on each side (default: 20; with a script: every step "
                   "it takes, else the first K, the script ending there)")
    c.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest allowed difference of a gradient or a weight (default: 1e-4)")
    c.add_argument("script", nargs="?", help="your script (one written for multicard run), then its own arguments: "
                   "run on one process and on --devices (default: every card, else cpu:2), its set-up models' "
                   "weights compared after each optimizer step")
    c.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    c.set_defaults(run=cmd_check)
    r = sub.add_parser("run", help="run your own script (one using multicard.Multicard) in every process it needs",
                       description="Start SCRIPT (or -m MODULE) as every process of a job on this machine, like "
                       "torchrun; multicard.Multicard() inside picks the job up. The first failure stops all.")
    r.add_argument("--strategy", default="auto", choices=STRATEGIES,
                   help="auto (ddp on 2+ devices, else single), single, ddp, dp, dp-balanced or fsdp (default: auto)")
    r.add_argument("--devices", default="auto", help="auto, cpu, cpu:N, a card count N, card ids 0,1 or cuda:1; "
                   "a card named twice (0,0) rehearses 2 cards on one, over gloo (default: auto)")
    r.add_argument("--replica-check", choices=REPLICA_CHECKS, help="where the processes' models part: stop "
                   "naming what differs, warn once, or off (default: the script's Multicard(replica_check=...), else "
                   "stop)")
    r.add_argument("--replica-check-every", type=value(int), metavar="K", help="optimizer steps between replica "
                   "checks (default: the script's, else 100)")
    r.add_argument("--deterministic", action="store_true", help="the script's Multicard() runs in deterministic "
                   "mode (the same result run after run on a card too), as Multicard(deterministic=True)")
    r.add_argument("--quiet", action="store_true", help="no line as the job starts and none as it ends well (the "
                   "script's own output is untouched)")
    r.add_argument("--stop-grace", type=value(float), metavar="S", default=30.0, help="a job stopped by a signal "
                   "(SIGTERM, SIGINT, SIGHUP): how long each rank gets to act on it (a save) before SIGKILL "
                   "(default: 30, as torchrun)")
    r.add_argument("-m", dest="module", action="store_true", help="SCRIPT names a module, run as python -m does")
    r.add_argument("script", nargs="?", help="the script (or module), then its own arguments")
    r.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    # a flag of run's own after the script goes to the script: said in a line where it leaves the job one process
    r.set_defaults(run=cmd_run, own_flags={s: a.nargs != 0 for a in r._actions for s in a.option_strings
                                           if s.startswith("--") and s != "--help"})
    e = sub.add_parser("env", help="what this machine offers: torch, cards, backends, launcher",
                       description="What this machine offers: python and torch, the CPU and the threads a process "
                       "takes, cards, backends, and the launcher this shell is in.")
    e.set_defaults(run=cmd_env)
    from .tools import bench

    b = sub.add_parser("bench", help="the strategies side by side, against a plain DataLoader loop: table, "
                       "bench.json, bench.md, bench.png", description="The strategies side by side on this machine's "
                       "devices, against a plain DataLoader loop: speed, scaling and memory per process, in a table, "
                       "bench.json, bench.md and bench.png.")
    bench.add_arguments(b)
    b.set_defaults(run=bench.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from .jobs.devices import openmp_env
    from .jobs.failures import RankFailed, Stopped, said, tell_torchrun

    os.environ.update(openmp_env(1, os.environ))  # how OpenMP's threads wait: read once, as torch is imported

    try:
        return args.run(args)
    except UsageError as e:
        tell_torchrun(e)  # a rank torchrun started (torchrun -m multicard train): the line in torchrun's summary too
        print(f"multicard: error: {e}", file=sys.stderr)
        return 2
    except RankFailed as e:
        if said(e.rank, e.trace):  # what became of it, in a sentence: there is no traceback to show
            sentence, _, more = e.trace.rstrip().partition("\n")
            print(f"multicard: {sentence}; every rank was stopped" + (f"\n{more}" if more else ""), file=sys.stderr)
        else:
            print(f"multicard: rank {e.rank} failed; its traceback:\n{e.trace.rstrip()}", file=sys.stderr)
        return 1
    except Stopped as e:  # SIGINT, SIGTERM or SIGHUP to this launcher: every process it started was stopped
        if e.signum != signal.SIGPIPE:  # or its stdout was closed (`| head`): nothing to say then
            print(f"multicard: stopped by {e}; every rank was stopped", file=sys.stderr)
        return 128 + e.signum
    except BrokenPipeError:
        if not broken_pipe.stdout_closed():
            raise
        return broken_pipe.SIGPIPE_EXIT
    except KeyboardInterrupt:
        print("multicard: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The `multicard` command (and `python -m multicard`): main(), then a quick exit. Python's own shutdown
    after torch has been imported tears down thousands of modules one by one, ~0.9 s of every command on 2 CPU
    cores (benchmarks/RESULTS.md); the exit handlers run and the streams are flushed first, and where a
    non-daemon thread is still running the exit is the usual one, which waits for it."""
    try:
        code = main()
    except KeyboardInterrupt:  # Ctrl-C before main's own handling began (reading the command line, its imports)
        print("multicard: interrupted", file=sys.stderr)
        code = 130
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    if broken_pipe.by_pipe(code) and broken_pipe.stdout_closed():  # `| head` read what it wanted: as SIGPIPE ends
        atexit._run_exitfuncs()
        broken_pipe.end_by_sigpipe()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)

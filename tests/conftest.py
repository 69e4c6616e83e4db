"""Shared test helpers: run the CLI in a fresh interpreter, tiny in-memory data, the processes a test starts (and
what they leave running), and an --out made by hand or by a small run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import multicard
from multicard import safefs
from multicard.data.images import ImageData
from multicard.data.loaders import shard
from multicard.jobs import progress
from multicard.models import LeNet5
from multicard.yourloop import determinism

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# how long a process a test starts may run before it is taken for hung: no test fails because the machine is busy
# (the slowest default-suite run took 70 s at load ~15 on 2 cores; a hang is caught all the same, later)
HUNG_S = 900


def run_cli(*args: str, timeout: float = HUNG_S, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """`python -m multicard ARGS` in a new process, output captured as text."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "multicard", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=kw.pop("cwd", ROOT), **kw)


def shown(out) -> dict[str, bytes]:
    """What --out shows a user: its visible files (through their links into the run that ended well), by name."""
    return {p.name: p.read_bytes() for p in sorted(Path(out).iterdir()) if not p.name.startswith(".") and p.is_file()}


def tiny_images(n: int = 96, seed: int = 0) -> ImageData:
    """n MNIST-shaped images whose label is readable from the image (a bright square per class)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randint(0, 40, (n, 1, 28, 28), dtype=torch.uint8, generator=g)
    for i, y in enumerate(labels.tolist()):
        r, c = divmod(y, 5)
        images[i, 0, 4 + 10 * r: 12 + 10 * r, 2 + 5 * c: 6 + 5 * c] = 255
    return ImageData(images, labels, 0.2, 0.3)


@pytest.fixture(autouse=True)
def no_group_left():
    """A test that leaves a Multicard open (single joins a process group of one as it starts) leaves its group to no
    other test: one that counts on joining a group of its own, or on finding none, finds none."""
    yield
    from multicard.strategies import base

    if base._GROUP["ours"] and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    base._GROUP.update(users=0, ours=False)


@pytest.fixture
def restored(monkeypatch):
    """Deterministic mode is process-wide: a test that sets it leaves torch and the environment as it found them."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
              torch.backends.cudnn.deterministic)
    monkeypatch.delenv(determinism.CUBLAS, raising=False)
    monkeypatch.delenv(determinism.ENV, raising=False)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[1:]


@pytest.fixture
def tiny():
    return tiny_images(96, 0), tiny_images(50, 1)


MEASURED_ON = ("26", "2")  # the CPU family and model of the EPYC the docs' result figures were measured on
# (2026-11-28): an EPYC of another model gave other last digits the day before (98.30 / 98.50%, 943)


def where_measured() -> bool:
    """Whether this is the machine the docs' result figures were measured on (a 2-core AMD EPYC of MEASURED_ON,
    torch 2.13.0): there the tests hold them exactly, at the thread count each names; elsewhere the CPU model moves
    their last digits."""
    from multicard.jobs.devices import cpu_cores
    from multicard.tools.bench_report import cpu_name

    return cpu_name() == "AMD EPYC" and cpu_cores() == 2 and torch.__version__.split("+")[0] == "2.13.0" and \
        cpu_model() == MEASURED_ON


def cpu_model() -> tuple[str, str]:
    """/proc/cpuinfo's cpu family and model ("" where it does not say)."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            found.setdefault(key.strip(), value.strip())
    return found.get("cpu family", ""), found.get("model", "")


def cuda(test):
    """Marks a test `cuda` (so that `pytest -m cuda` selects it) and skips it where no card is visible."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA card")(test))


def assert_same(actual: torch.Tensor, expected: torch.Tensor, *, atol: float = 0.0, rtol: float = 0.0,
                what: str = "") -> None:
    """The one comparison of tensors that may come from a card: both are brought to the CPU first (torch.equal of a
    card's tensor and a CPU one raises, and a test run on the CPU alone never sees that), then compared: equal bit
    for bit, or within atol + rtol * |expected|. A failure says which side was on which device."""
    try:
        torch.testing.assert_close(actual.detach().cpu(), expected.detach().cpu(), atol=atol, rtol=rtol)
    except AssertionError as e:
        raise AssertionError(f"{what + ': ' if what else ''}actual (on {actual.device}) and expected (on "
                             f"{expected.device}) differ: {e}") from None


def rehearsal(test):
    """Marks a card test of several processes `cuda` and `rehearse`: with fewer cards than processes they share a card
    (--devices 0,0, over gloo), the code path of as many cards; benchmarks/on_a_card.sh runs these after its probe of
    gloo on a shared card, so that a hang there costs the probe's time limit, not the other CUDA tests'."""
    return pytest.mark.rehearse(cuda(test))


def cpu_and_card(card: str = "cuda:0") -> list:
    """Devices to parametrise one test body over: the CPU, and a card (marked `cuda`, skipped where none is), so
    that a body written for a card also runs where CI runs."""
    return ["cpu", pytest.param(card, marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="needs a CUDA card")])]


def sharded(dataset, batch: int, *, train: bool = True, rank: int = 0, world: int = 1, seed: int = 0, workers: int = 0,
            shuffle: bool = True, **options):
    """What setup_dataloader makes of DataLoader(dataset, batch) in process `rank` of `world` (batch: global)."""
    loader = DataLoader(dataset, batch, shuffle=shuffle, num_workers=workers,
                        generator=torch.Generator().manual_seed(seed) if shuffle else None)
    return shard(loader, train=train, rank=rank, world=world, device=torch.device("cpu"),
                 local_batch=lambda b, k=1: b // (world * k), **options)


# -- the processes a test starts, and what they leave -----------------------------------------------------------------
JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "MULTICARD_LAUNCHER", "TORCHELASTIC_USE_AGENT_STORE", progress.PROGRESS)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES and not k.startswith("SLURM_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def stat(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: [state, ppid, pgrp, ...]; ["X"] once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return ["X"] * 20


def running(pids) -> list[int]:
    return [pid for pid in pids if stat(pid)[0] not in ("X", "Z")]


def gone(pids_of, within: float) -> bool:
    """Whether the processes that pids_of() lists are all gone within `within` seconds."""
    deadline = time.monotonic() + within
    while pids_of() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not pids_of()


def left(tmp_path: Path) -> list[int]:
    """The processes a test's job left running: each is started with TMPDIR at the test's own folder (ranks lead
    sessions of their own, so the launcher's process group does not hold them)."""
    mark, found = f"TMPDIR={tmp_path}".encode(), []
    for pid in (int(entry) for entry in os.listdir("/proc") if entry.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            continue
    return running(found)


@pytest.fixture
def nothing_left(tmp_path):
    """Whatever a test started is gone once it ends, passed or failed."""
    yield
    for pid in left(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def session(command: list[str], tmp_path: Path, cwd: Path | str) -> subprocess.Popen:
    """`command` in a session of its own, with TMPDIR at the test's folder, its output read here as text."""
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(TMPDIR=str(tmp_path)), start_new_session=True)


def started(tmp_path: Path, body: str, *args: str) -> subprocess.Popen:
    """`body` as the script job.py, run in a session of its own."""
    (tmp_path / "job.py").write_text(textwrap.dedent(body))
    return session([sys.executable, str(tmp_path / "job.py"), *args], tmp_path, tmp_path)


def ended(process: subprocess.Popen, within: float) -> tuple[int, str, str]:
    """Its exit status, stdout and stderr; killed with its whole group if it has not ended `within` seconds."""
    try:
        out, err = process.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"still running after {within} s: {err[-2000:]}")
    return process.returncode, out or "", err


# -- an --out made by hand (an earlier run's checkpoints), and small runs into one ------------------------------------
OLD = "20240101T000000-abcdef"  # an earlier run's id, as multicard makes them


def earlier(out: Path, steps=(1, 2, 3), run: str = OLD, started: str | None = None) -> list[Path]:
    """--out/checkpoints as a run `run` leaves it: step folders with its marker and a state.pt, and run.json."""
    made = []
    for step in steps:
        folder = out / "checkpoints" / f"step-{step:08d}"
        folder.mkdir(parents=True)
        torch.save(head(f"{run} {step}", step), folder / "state.pt")
        (folder / ".multicard").write_text(run + "\n")
        made.append(folder)
    (out / "checkpoints" / "run.json").write_text(json.dumps({"run": run, "from": started}))
    return made


def head(note: str, steps: int) -> dict:
    """The smallest state.pt --resume auto takes as a checkpoint of multicard train, with a note to tell it by."""
    return {"config": {"batch_size": 24, "epochs": 1}, "loader": {"epoch": 0, "samples": 0}, "steps": steps,
            "history": [], "note": note}


def note(state: Path) -> str:
    return torch.load(state, weights_only=True)["note"]


def states(out: Path) -> list[str]:
    """The contents of every state.pt under --out, wherever it was moved."""
    return sorted(note(p) for p in out.rglob("state.pt") if safefs.kind(p) == "file")


def train(out: Path, **overrides) -> dict:
    torch.manual_seed(0)
    return multicard.train(LeNet5(), tiny_images(48), None, out=str(out), **{
        **dict(quiet=True, strategy="single", devices="cpu", batch_size=24, epochs=1), **overrides})


def bounded(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`code` in a child process that must end within `timeout` seconds (a FIFO opened for reading would block)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


class Small(nn.Sequential):
    """A model small enough that a run of a few steps costs little (LeNet-5's steps are what other tests time)."""

    def __init__(self):
        super().__init__(nn.Flatten(), nn.Linear(784, 10))


def light(out: Path, model: nn.Module | None = None, **overrides) -> dict:
    """A run of Small on 48 images, 2 steps an epoch, into `out`."""
    torch.manual_seed(0)
    return multicard.train(model or Small(), tiny_images(48), None, out=str(out), **{
        **dict(quiet=True, strategy="single", devices="cpu", batch_size=24, epochs=1), **overrides})

"""Never lose a run: checkpoints, exact resume (one process, ddp, another number of processes), restarts after a dead
process, checkpoints that survive a kill, an earlier run's checkpoints taken over by a new one (a kill at any point of
it; run.json's "from"), and an --out that one run holds and changes all at once."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import multicard
from conftest import HUNG_S, OLD, ROOT, earlier, run_cli, shown, states, tiny_images, train
from multicard.checkpoints import resume, trainer_saves
from multicard.errors import UsageError
from multicard.jobs.failures import RankFailed, Stopped
from multicard.models import LeNet5
from multicard.trainer import start
from multicard.trainer.config import TrainConfig
from multicard.trainer.outdir import Output
from multicard.trainer.report import strict

LIGHT = dict(quiet=True, lr=3e-3, batch_size=24, epochs=3)  # 96 samples: 4 steps per epoch, 12 in all


def lenet_run(out: Path, **overrides) -> dict:
    torch.manual_seed(0)
    return multicard.train(LeNet5(), tiny_images(96), tiny_images(30, 1), out=str(out), **{**LIGHT, **overrides})


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


def identical(a: Path, b: Path) -> bool:
    return (a / "model.pt").read_bytes() == (b / "model.pt").read_bytes() or \
        all(torch.equal(x, y) for x, y in zip(weights(a).values(), weights(b).values(), strict=True))


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """An unstopped run on one process (with augmentation: random streams matter) that checkpoints often."""
    out = tmp_path_factory.mktemp("single")
    lenet_run(out, strategy="single", devices="cpu", save_every_steps=3, save_every=1, keep_checkpoints=0)
    return out


def test_checkpoints_are_whole_folders_named_by_step(single):
    names = [p.name for p in resume.whole(single)]
    assert names == [f"step-{s:08d}" for s in (3, 4, 6, 8, 9, 12)]  # every 3 steps, and every epoch (4 steps)
    state = torch.load(single / "checkpoints" / "step-00000006" / "state.pt", weights_only=True)
    assert {"model", "optimizer", "scheduler", "loader", "history", "steps", "multicard"} <= state.keys()
    assert state["loader"].keys() == {"epoch", "samples", "generators"} and state["steps"] == 6  # the order's
    assert (state["loader"]["epoch"], state["loader"]["samples"]) == (1, 48)  # generator as epoch 1 began
    assert not any(k.startswith("module.") for k in state["model"])


@pytest.mark.parametrize("step", [4, 6, 12], ids=["epoch-boundary", "mid-epoch", "after-the-last-step"])
def test_a_resumed_single_run_ends_bit_identical(single, tmp_path, step):
    lenet_run(tmp_path, strategy="single", devices="cpu", resume=str(single / "checkpoints" / f"step-{step:08d}"))
    assert identical(single, tmp_path)
    assert [r["train_loss"] for r in records(tmp_path)] == pytest.approx([r["train_loss"] for r in records(single)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step-{step:08d}/state.pt") and summary["restarts"] == 0


def test_keep_checkpoints_keeps_the_newest(tmp_path):
    lenet_run(tmp_path, strategy="single", devices="cpu", epochs=2, save_every_steps=1)
    assert [p.name for p in resume.whole(tmp_path)] == ["step-00000007", "step-00000008"]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """An unstopped ddp cpu:2 run, augmented (rank 1's random streams matter too)."""
    out = tmp_path_factory.mktemp("ddp")
    lenet_run(out, strategy="ddp", devices="cpu:2", save_every_steps=3, save_every=1, keep_checkpoints=0)
    return out


@pytest.mark.parametrize("step", [pytest.param(4, marks=pytest.mark.slow), 6],
                         ids=["epoch-boundary", "mid-epoch"])
def test_a_resumed_ddp_run_ends_bit_identical(ddp, tmp_path, step):
    held = ddp / "checkpoints" / f"step-{step:08d}"
    assert sorted(p.name for p in held.iterdir() if p.suffix == ".pt") == ["state.pt"]  # one file: every rank's
    assert list(torch.load(held / "state.pt", weights_only=True)["multicard"]["ranks"]) == [1]  # streams in it
    lenet_run(tmp_path, strategy="ddp", devices="cpu:2", resume=str(ddp / "checkpoints" / f"step-{step:08d}"))
    assert identical(ddp, tmp_path)


@pytest.mark.slow
def test_resuming_on_three_processes_continues_the_same_data_order(tmp_path):
    plain = dict(augment=False, batch_size=48, epochs=2)  # 48 splits over 2 and 3; 96 samples: no padding
    lenet_run(tmp_path / "two", strategy="ddp", devices="cpu:2", save_every_steps=1, **plain)
    lenet_run(tmp_path / "three", strategy="ddp", devices="cpu:3", resume=str(tmp_path / "two" / "checkpoints"
                                                                                / "step-00000003"), **plain)
    a, b = weights(tmp_path / "two"), weights(tmp_path / "three")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


# -- told to stop: SIGTERM / SIGUSR1 save the step in hand (issue 48, item 4) -------------------------------------
class SignalsItself(LeNet5):
    """Rank `rank` (its RANK; one process: 0) sends `signum` to itself alone at its `at`-th training forward; every
    training forward's dispositions of SIGTERM and SIGUSR1 are noted in `seen`."""

    def __init__(self, signum: int, at: int, rank: int = 0):
        super().__init__()
        self.signum, self.at, self.rank, self.batches, self.seen = int(signum), at, rank, 0, set()

    def forward(self, x):
        if self.training:
            self.seen.add((signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)))
        if self.training and int(os.environ.get("RANK", "0")) == self.rank:
            self.batches += 1
            if self.batches == self.at:
                os.kill(os.getpid(), self.signum)
        return super().forward(x)


def stopped_run(out: Path, signum: int, at: int, rank: int = 0, **overrides) -> Stopped:
    torch.manual_seed(0)
    with pytest.raises(Stopped) as stopped:
        multicard.train(SignalsItself(signum, at, rank), tiny_images(96), tiny_images(30, 1), out=str(out),
                        **{**LIGHT, **overrides})
    return stopped.value


@pytest.mark.parametrize("signum, every", [(signal.SIGTERM, 0), (signal.SIGUSR1, 3)],
                         ids=["SIGTERM", "SIGUSR1-after-a-periodic-save"])
def test_a_signal_saves_the_step_in_hand_and_resume_auto_goes_on_bit_identical(single, tmp_path, capsys, signum,
                                                                                 every):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    stopped = stopped_run(tmp_path, signum, 6, strategy="single", devices="cpu",
                          save_every_steps=every, keep_checkpoints=0)
    assert stopped.signum == signum
    # step 6, mid-epoch 2; with saves every 3 steps, step 6 is written once (a second write would be refused)
    assert [p.name for p in resume.whole(tmp_path)] == [f"step-{s:08d}" for s in ((3, 6) if every else (6,))]
    name = signal.Signals(signum).name
    assert (f"multicard: stopped by {name} after step 6: checkpoint {tmp_path / 'checkpoints' / 'step-00000006'} "
            f"written; go on with: the same multicard.train(...) call with out={str(tmp_path)!r}, resume=\"auto\""
            ) in capsys.readouterr().out
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before  # put back
    assert not list(tmp_path.glob("model.pt"))  # a stopped run shows no files
    lenet_run(tmp_path, strategy="single", devices="cpu", resume="auto")
    assert identical(single, tmp_path)
    assert [r["train_loss"] for r in records(tmp_path)] == pytest.approx([r["train_loss"] for r in records(single)])


def test_no_save_on_signal_leaves_the_signals_as_they_were_and_sigint_saves_nothing(tmp_path):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    for on in (False, True):
        model = SignalsItself(signal.SIGINT, 99)  # never sent: it notes the handlers each training step meets
        multicard.train(model, tiny_images(96), None, out=str(tmp_path / str(on)), strategy="single", devices="cpu",
                        **{**LIGHT, "epochs": 1, "save_on_signal": on})
        # on: as they were until the first read (after step 1), then multicard's, which only record the signal
        assert before in model.seen and len(model.seen) == (2 if on else 1)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before
    torch.manual_seed(0)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C stops at once, as it did: nothing saved
        multicard.train(SignalsItself(signal.SIGINT, 6), tiny_images(96), None, out=str(tmp_path / "int"),
                        strategy="single", devices="cpu", **LIGHT)
    assert resume.whole(tmp_path / "int") == []


def test_outside_the_main_thread_a_run_says_it_cannot_save_on_a_signal(tmp_path, capsys):
    import threading

    thread = threading.Thread(target=lenet_run, args=(tmp_path,), kwargs=dict(strategy="single", devices="cpu",
                                                                              epochs=1))
    thread.start()
    thread.join()
    assert (tmp_path / "model.pt").exists()
    assert "multicard: --save-on-signal: off in this run: it trains outside the main thread" in capsys.readouterr().out


def saved_step(tmp_path: Path, signalled: int) -> int:
    """The one checkpoint a stop wrote: at the first read after the signal's step at which the ranks met (reads
    1, 2, 4, 8, ... meet while a second's worth of reads is more: the 8th, after step 7, in these runs)."""
    steps = [int(p.name.partition("-")[2]) for p in resume.whole(tmp_path)]
    assert len(steps) == 1 and steps[0] >= signalled
    return steps[0]


def test_a_signal_to_one_rank_of_two_stops_both_at_the_same_step(ddp, tmp_path, capsys):
    """Rank 1 alone gets SIGUSR1 (os.kill of its own pid) in its step 6: both ranks agree at the next read at which
    they meet, write that step together, and the launch raises Stopped; --resume auto ends bit-identical to the
    unstopped run."""
    stopped = stopped_run(tmp_path, signal.SIGUSR1, 6, rank=1, strategy="ddp", devices="cpu:2")
    assert stopped.signum == signal.SIGUSR1
    step = saved_step(tmp_path, 6)
    assert f"multicard: stopped by SIGUSR1 after step {step}: checkpoint" in capsys.readouterr().out
    lenet_run(tmp_path, strategy="ddp", devices="cpu:2", resume="auto")
    assert identical(ddp, tmp_path)


@pytest.mark.slow
def test_a_signal_under_fsdp_saves_its_shards_and_resumes_bit_identical(tmp_path):
    lenet_run(tmp_path / "whole", strategy="fsdp", devices="cpu:2")
    stopped = stopped_run(tmp_path / "run", signal.SIGTERM, 7, rank=1, strategy="fsdp", devices="cpu:2")
    assert stopped.signum == signal.SIGTERM
    saved_step(tmp_path / "run", 7)
    lenet_run(tmp_path / "run", strategy="fsdp", devices="cpu:2", resume="auto")
    assert identical(tmp_path / "whole", tmp_path / "run")


SIGNALS_ONCE = """
import os, signal
from pathlib import Path
from multicard.models import LeNet5

class SignalsOnce(LeNet5):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def forward(self, x):
        if self.training and os.environ.get("RANK", "0") == os.environ["SIGNAL_RANK"]:
            self.batches += 1
            if self.batches == 5 and not os.path.exists("signalled"):
                Path("signalled").touch()
                os.kill(os.getpid(), signal.SIGTERM)
        return super().forward(x)
"""


@pytest.mark.parametrize("devices", ["cpu", pytest.param("cpu:2", marks=pytest.mark.slow)])
def test_multicard_train_on_sigterm_saves_says_how_to_go_on_and_exits_143(tmp_path, devices):
    (tmp_path / "once.py").write_text(SIGNALS_ONCE)
    job = ["--model", "once.py:SignalsOnce", "--data", "synthetic", "--synthetic-samples", "96", "--batch-size", "24",
           "--epochs", "3", "--quiet", "--devices", devices]
    env = {"SIGNAL_RANK": "1" if devices == "cpu:2" else "0", "PYTHONPATH": os.path.join(ROOT, "src")}
    (tmp_path / "signalled").touch()  # the unstopped run sends no signal
    plain = run_cli("train", *job, "--out", "plain", cwd=tmp_path, env=env)
    assert plain.returncode == 0, plain.stderr
    (tmp_path / "signalled").unlink()
    stopped = run_cli("train", *job, "--out", "run", cwd=tmp_path, env=env)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1] == "multicard: stopped by SIGTERM; every rank was stopped"
    line = next(line for line in stopped.stdout.splitlines() if "stopped by" in line)
    command = shlex.join(["multicard", "train", *job, "--out", "run", "--resume", "auto"])
    step = int(re.match(r"multicard: stopped by SIGTERM after step (\d+): ", line)[1])  # one process: the 5th;
    assert step == 5 if devices == "cpu" else step >= 5  # two: the first read after it at which the ranks meet
    assert line == (f"multicard: stopped by SIGTERM after step {step}: checkpoint run/checkpoints/step-{step:08d} "
                    f"written; go on with: {command}")
    again = run_cli(*shlex.split(line.partition("go on with: multicard ")[2]), cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr
    assert f"resuming from run/checkpoints/step-{step:08d}/state.pt" in again.stdout
    assert identical(tmp_path / "plain", tmp_path / "run")
    # --no-save-on-signal: SIGTERM ends one process at once, as it did before (the default disposition)
    if devices == "cpu":
        (tmp_path / "signalled").unlink()
        off = run_cli("train", *job, "--out", "off", "--no-save-on-signal", cwd=tmp_path, env=env)
        assert off.returncode == -signal.SIGTERM and resume.whole(tmp_path / "off") == []


class DiesOnce(LeNet5):
    """Rank 1 kills itself (SIGKILL: no traceback, no cleanup) at its `at`-th training batch, on the first attempt
    (the one that finds no `marker`)."""

    def __init__(self, marker: str, at: int = 7):
        super().__init__()
        self.marker, self.at, self.batches = marker, at, 0

    def forward(self, x):
        if self.training and os.environ.get("RANK") == "1":
            self.batches += 1
            if self.batches == self.at and not os.path.exists(self.marker):
                Path(self.marker).touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


@pytest.mark.slow
def test_a_dead_process_is_restarted_from_the_newest_checkpoint(ddp, tmp_path, capsys):
    torch.manual_seed(0)
    summary = multicard.train(DiesOnce(str(tmp_path / "died")), tiny_images(96), tiny_images(30, 1),
                              out=str(tmp_path / "run"), strategy="ddp", devices="cpu:2", save_every_steps=3,
                              max_restarts=1, **{**LIGHT, "quiet": False})
    assert (tmp_path / "died").exists() and summary["restarts"] == 1
    assert summary["resumed_from"].endswith(("step-00000006/state.pt", "step-00000003/state.pt"))
    assert identical(ddp, tmp_path / "run")
    assert "rank 1 failed; restart 1 of 1" in capsys.readouterr().out


@pytest.mark.slow
def test_once_the_restarts_are_spent_the_run_fails_naming_the_rank(tmp_path):
    earlier = tmp_path / "run"
    lenet_run(earlier, strategy="single", devices="cpu", epochs=1)
    before = shown(earlier)
    torch.manual_seed(0)
    with pytest.raises(RankFailed) as failure:
        multicard.train(DiesOnce(str(tmp_path / "died")), tiny_images(96), None, out=str(earlier),
                        strategy="ddp", devices="cpu:2", **LIGHT)
    assert failure.value.rank == 1 and "rank 1 ended with signal SIGKILL" in failure.value.trace
    assert shown(earlier) == before  # the failed run replaced nothing
    assert [p.name for p in earlier.glob(".run-*")] == [os.readlink(earlier / ".current")]


DIES_ONCE = """
import os, signal
from pathlib import Path
from multicard.models import LeNet5

class DiesOnce(LeNet5):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def forward(self, x):
        if self.training and os.environ.get("RANK") == "1":
            self.batches += 1
            if self.batches == 9 and not os.path.exists({marker!r}):
                Path({marker!r}).touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)
"""


@pytest.mark.slow
def test_torchrun_restarts_go_on_from_the_newest_checkpoint_with_resume_auto(tmp_path):
    from multicard.jobs.launcher import free_port

    (tmp_path / "dies.py").write_text(DIES_ONCE.format(marker=str(tmp_path / "died")))
    job = ["--data", "synthetic", "--synthetic-samples", "480", "--batch-size", "48", "--epochs", "3", "--quiet",
           "--save-every-steps", "4"]
    plain = subprocess.run([sys.executable, "-m", "multicard", "train", "--devices", "cpu:2", *job, "--out",
                            str(tmp_path / "plain")], capture_output=True, text=True, timeout=HUNG_S, cwd=ROOT)
    assert plain.returncode == 0, plain.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    run = subprocess.run([*torchrun, "-m", "multicard", "train", "--model", "dies.py:DiesOnce", *job, "--resume",
                          "auto", "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=HUNG_S,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "died").exists() and "resuming from" in run.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["launcher"] == "torchrun" and summary["restarts"] == 1
    assert identical(tmp_path / "plain", tmp_path / "run")


def test_resume_auto_without_a_checkpoint_starts_from_the_beginning(tmp_path, capsys):
    lenet_run(tmp_path / "a", strategy="single", devices="cpu", epochs=1)
    lenet_run(tmp_path / "b", strategy="single", devices="cpu", epochs=1, resume="auto", quiet=False)
    assert identical(tmp_path / "a", tmp_path / "b")
    assert "no checkpoint in" in capsys.readouterr().out


def test_resume_refuses_what_cannot_continue(single, tmp_path):
    step = str(single / "checkpoints" / "step-00000006")
    with pytest.raises(UsageError, match=r"global batch was 24, this one's is 48: resume with --batch-size 24"):
        lenet_run(tmp_path, strategy="single", devices="cpu", resume=step, batch_size=48)
    with pytest.raises(UsageError, match=r"--resume .*nowhere: no checkpoint there"):
        lenet_run(tmp_path, strategy="single", devices="cpu", resume=str(tmp_path / "nowhere"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match=r"not a readable checkpoint"):
        lenet_run(tmp_path, strategy="single", devices="cpu", resume=str(tmp_path / "junk.pt"))
    assert shown(tmp_path) == {"junk.pt": b"not a checkpoint"}


def test_resume_takes_the_newest_of_an_out_or_its_checkpoints_folder(single):
    newest = single / "checkpoints" / "step-00000012" / "state.pt"
    assert resume.resolve("auto", single) == newest
    assert resume.resolve(str(single), "elsewhere") == newest
    assert resume.resolve(str(single / "checkpoints"), "elsewhere") == newest


KILLER = """
import sys, torch, multicard
from multicard.models import LeNet5
sys.path.insert(0, {tests!r})
from conftest import tiny_images
torch.manual_seed(0)
multicard.train(LeNet5(), tiny_images(96), None, out={out!r}, strategy="single", devices="cpu", quiet=True,
                batch_size=8, epochs=1000, save_every_steps=1, keep_checkpoints=2)
"""


def test_a_kill_at_any_instant_leaves_a_checkpoint_to_resume_from(tmp_path):
    """SIGKILL while checkpoints are written every step (most instants fall inside a write): the newest whole
    checkpoint always loads, and the next run clears what the kill left half-written."""
    out = tmp_path / "run"
    script = tmp_path / "killed.py"
    script.write_text(KILLER.format(tests=str(Path(__file__).parent), out=str(out)))
    for delay in (0.2, 0.45, 0.7):
        proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT)
        deadline = time.monotonic() + 60
        while not resume.whole(out) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        found = resume.resolve("auto", out)
        state = torch.load(found, weights_only=True)
        LeNet5().load_state_dict(state["model"])
        assert state["steps"] == int(found.parent.name.split("-")[1])
    with Output(str(out)) as output:  # the next run's start
        output.new_run()
    assert len(list(out.glob(".run-*"))) == 1  # only the new one
    assert not list(out.glob("checkpoints/*.part"))


# -- an earlier run's checkpoints, taken over by a new run: a kill at any point publishes none as the new run's -------
class Killed(BaseException):
    """What a SIGKILL leaves: nothing after it runs."""


@pytest.mark.parametrize("rewind", [False, True], ids=["fresh", "from-step-1"])
def test_a_kill_at_each_point_of_claim_never_publishes_the_earlier_run_as_the_new_one(tmp_path, monkeypatch,
                                                                                       rewind):
    """Each call of claim that changes the disk (a folder made, a file created, a rename), in turn, is where the
    launcher dies: --resume auto then goes on with the earlier run only where run.json still names it (nothing
    moved yet), else from where the new run began (the beginning, or step 1), never from the earlier run's
    newest. The next start finishes the moves, and no checkpoint is lost."""
    real = {"replace": os.replace, "mkdir": os.mkdir, "open": os.open}
    point = 0
    while True:
        out = tmp_path / f"kill-{point}"
        made = earlier(out)
        resumed = made[0] / "state.pt" if rewind else None
        left = [point]

        def counted(name, left=left):
            def call(*args, **kwargs):
                creates = name != "open" or args[1] & os.O_CREAT
                if creates:
                    left[0] -= 1
                    if left[0] < 0:
                        raise Killed(name)
                return real[name](*args, **kwargs)
            return call

        for name in real:
            monkeypatch.setattr(os, name, counted(name))
        try:
            run = trainer_saves.claim(out, resumed)
            done = True
        except Killed:
            done = False
        monkeypatch.undo()
        own, auto = resume.owner(out)["run"], resume.resolve("auto", out)
        if own == OLD:  # killed before the claim: the earlier run is as it was, and auto goes on with it
            assert auto == made[-1] / "state.pt" and all(p.is_dir() for p in made), f"killed at call {point}"
        else:
            assert auto == (resumed.absolute() if rewind else None), f"killed at call {point}"
            assert not done or own == run
        again = trainer_saves.claim(out, auto)  # the next start: --resume auto
        assert states(out) == [f"{OLD} {s}" for s in (1, 2, 3)]  # none lost, none doubled
        if own != OLD:
            assert (again == own) == rewind  # from step 1: the same new run goes on; from nothing: a new one
            assert resume.owner(out)["run"] == again
            assert [p.name for p in resume.whole(out)] == (["step-00000001"] if rewind else [])
        if done:
            break
        point += 1
    assert point >= 4  # the run folder aside, run.json's temporary and its rename, and the moves


def test_a_new_run_killed_before_its_first_checkpoint_starts_over_under_auto(tmp_path):
    out = tmp_path / "out"
    earlier(out)
    trainer_saves.claim(out, None)
    assert resume.resolve("auto", out) is None


def owned_from(out: Path, started: str) -> None:
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    (out / "checkpoints" / "run.json").write_text(json.dumps({"run": OLD, "from": started}))


def test_run_json_naming_a_checkpoint_elsewhere_is_one_line_not_a_resume_from_there(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    train(elsewhere, save_every_steps=1)
    theirs = next(elsewhere.glob("checkpoints/step-*/state.pt"))
    out = tmp_path / "out"
    owned_from(out, str(theirs))  # planted, or a run that began from --resume elsewhere and wrote nothing yet
    with pytest.raises(UsageError, match=r"--resume auto: the run in .* started from .*, which is not a checkpoint "
                                         r"in --out, and wrote none of its own: to go on from there, give it as "
                                         r"--resume; to start over, leave --resume out"):
        train(out, resume="auto")
    assert not list(out.glob(".run-*")) and not (out / "model.pt").exists()
    # the user who means it says so, and the run goes on from there
    assert train(out, resume=str(theirs))["optimizer_steps"] == 2


def test_run_json_naming_a_checkpoint_in_out_resumes_the_one_found_there(tmp_path):
    made = earlier(tmp_path, steps=(1, 2))
    aside = tmp_path / "checkpoints" / f"run-{OLD}"
    aside.mkdir()
    os.replace(made[0], aside / made[0].name)
    (tmp_path / "checkpoints" / "run.json").write_text(json.dumps(
        {"run": "20250101T000000-123456", "from": str(aside / made[0].name / "state.pt")}))
    assert resume.newest(tmp_path / "checkpoints") == aside / made[0].name / "state.pt"


def test_a_restart_before_the_first_checkpoint_goes_on_from_where_the_run_began(tmp_path):
    """The start is known to the job; run.json's word for it is not needed (nor taken)."""
    elsewhere = tmp_path / "elsewhere"
    train(elsewhere, save_every_steps=1)
    theirs = next(elsewhere.glob("checkpoints/step-*/state.pt"))
    out = tmp_path / "out"
    owned_from(out, str(theirs))
    config = TrainConfig(out=str(out), resume="auto", devices="cpu", strategy="single", batch_size=24, epochs=1)
    again = start.restart(start.Start(config, theirs, ""))
    assert again.checkpoint == theirs and again.line.startswith(f"resuming from {theirs}")


def test_a_refused_resume_claims_nothing(tmp_path):
    train(tmp_path, save_every_steps=1)
    checkpoints = tmp_path / "checkpoints"
    before = {p.name: p.read_bytes() for p in checkpoints.rglob("*") if p.is_file()}
    with pytest.raises(UsageError, match=r"--resume .*step-00000001/state\.pt: its model does not fit the model"):
        multicard.train(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), tiny_images(48), None, out=str(tmp_path),
                        quiet=True, strategy="single", devices="cpu", batch_size=24,
                        resume=str(checkpoints / "step-00000001"))
    assert {p.name: p.read_bytes() for p in checkpoints.rglob("*") if p.is_file()} == before


# -- --out -------------------------------------------------------------------------------------------------------
def test_a_second_run_into_an_out_in_use_is_refused_at_once(tmp_path):
    with Output(str(tmp_path)):
        start = time.monotonic()
        with pytest.raises(UsageError, match=r"--out .*: another run is writing there"):
            lenet_run(tmp_path, strategy="single", devices="cpu", epochs=1)
        assert time.monotonic() - start < 60  # at once, not blocked on the lock this process holds
    lenet_run(tmp_path, strategy="single", devices="cpu", epochs=1)  # released: the next run goes ahead
    assert list(shown(tmp_path)) == ["curves.png", "metrics.jsonl", "model.pt", "summary.json"]


def test_a_run_that_fails_at_its_last_write_replaces_nothing(tmp_path, monkeypatch):
    lenet_run(tmp_path, strategy="single", devices="cpu", epochs=1)
    before = shown(tmp_path)

    real = Path.write_text

    def full_disk(self, *args, **kwargs):  # the disk fills up at the last file: after model.pt and the metrics
        if self.name == "summary.json":
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError):
        lenet_run(tmp_path, strategy="single", devices="cpu", epochs=2)
    monkeypatch.undo()
    assert shown(tmp_path) == before
    assert len(list(tmp_path.glob(".run-*"))) == 1  # the failed run's folder went with it


def test_out_files_change_together_and_leftovers_are_cleared(tmp_path):
    lenet_run(tmp_path, strategy="single", devices="cpu", epochs=1)
    killed = tmp_path / ".run-20200101T000000-1-1"  # a killed run's folder, and its half-made link
    killed.mkdir()
    (killed / ".multicard").write_text("")
    os.symlink(".current/summary.json", tmp_path / "summary.json.123.part")
    lenet_run(tmp_path, strategy="single", devices="cpu", epochs=1)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".run-")) == \
        [".current", "curves.png", "metrics.jsonl", "model.pt", "summary.json"]
    assert all(os.readlink(tmp_path / name) == f".current/{name}" for name in ("model.pt", "summary.json"))
    assert len(list(tmp_path.glob(".run-*"))) == 1


def test_out_files_get_the_users_usual_mode(tmp_path):
    old = os.umask(0o002)
    try:
        lenet_run(tmp_path, strategy="single", devices="cpu", epochs=1)
    finally:
        os.umask(old)
    for name in ("model.pt", "metrics.jsonl", "summary.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o664, name


def test_an_empty_out_and_a_path_object(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"--out '': name a folder"):
        lenet_run("", strategy="single", devices="cpu", epochs=1)
    assert list(tmp_path.iterdir()) == []
    torch.manual_seed(0)
    multicard.train(LeNet5(), tiny_images(96), None, out=tmp_path / "as-path", strategy="single", devices="cpu",
                    **{**LIGHT, "epochs": 1})
    assert json.loads((tmp_path / "as-path" / "summary.json").read_text())["epochs"] == 1


@pytest.mark.parametrize("which", ["training", "test"])
def test_an_empty_set_is_one_line(tmp_path, which):
    empty = tiny_images(96)[0:0]
    sets = (torch.utils.data.TensorDataset(*empty), tiny_images(30)) if which == "training" else \
        (tiny_images(96), torch.utils.data.TensorDataset(*empty))
    with pytest.raises(UsageError, match=f"the {which} set is empty"):
        multicard.train(LeNet5(), *sets, out=str(tmp_path), strategy="single", devices="cpu", **LIGHT)
    assert list(tmp_path.iterdir()) == []


def test_summary_is_strict_json():
    assert strict({"a": [float("nan"), 1.5], "b": {"c": float("inf")}}) == {"a": [None, 1.5], "b": {"c": None}}
    json.dumps(strict({"x": math.nan}), allow_nan=False)


# -- the front object --------------------------------------------------------------------------------------------
def user_loop(mc: multicard.Multicard, out: Path, stop_at: int | None, resume_from: Path | None) -> list[float]:
    """A user's own loop that checkpoints the whole training state every step with mc.save."""
    torch.manual_seed(0)
    model = mc.setup(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.2), torch.nn.Linear(784, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.5)
    loader = mc.setup_dataloader(DataLoader(tiny_images(96, 2), 16, shuffle=True,
                                            generator=torch.Generator().manual_seed(3)))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "step": 0}
    if resume_from is not None:
        mc.load(resume_from, state)
    losses = []
    while loader.epoch < 3:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            mc.backward(loss)
            optimizer.step()
            scheduler.step()
            state["step"] += 1
            losses.append(loss.item())
            mc.save(out, state)
            if state["step"] == stop_at:
                return losses
    return losses


def test_the_front_objects_save_and_load_resume_a_users_loop_exactly(tmp_path):
    path = tmp_path / "ckpt.pt"
    whole = user_loop(multicard.Multicard("single", "cpu"), tmp_path / "whole.pt", None, None)
    first = user_loop(multicard.Multicard("single", "cpu"), path, 8, None)
    torch.manual_seed(123)  # whatever the random streams are now: load puts them back
    rest = user_loop(multicard.Multicard("single", "cpu"), path, None, path)
    assert first + rest == whole
    a, b = torch.load(tmp_path / "whole.pt", weights_only=True), torch.load(path, weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and b["step"] == 18


def test_a_plain_state_dict_is_saved_plain(tmp_path):
    """mc.save(path, model.state_dict()) writes what torch.save would: a one-card script loads it as it is."""
    mc = multicard.Multicard("single", "cpu")
    model = mc.setup(LeNet5())
    mc.save(tmp_path / "plain.pt", model.state_dict())
    LeNet5().load_state_dict(torch.load(tmp_path / "plain.pt", weights_only=True))


def test_an_auto_batch_and_rate_resume_as_the_checkpoint_had_them(tmp_path):
    from multicard.trainer.config import TrainConfig
    from multicard.trainer.recipe import inherit

    path = tmp_path / "state.pt"
    torch.save({"config": {"batch_size": 256, "lr": 0.008, "epochs": 2}, "loader": {"epoch": 0, "samples": 768},
                "steps": 3, "history": []}, path)
    assert (inherit(path, TrainConfig()).batch_size, inherit(path, TrainConfig()).lr) == (256, 0.008)
    # on 3 processes the default would settle on 255, and the data order could not continue: the saved 256 is kept
    # (and refused there in one line, as a given --batch-size 256 would be)
    assert inherit(path, TrainConfig()).settled(3).batch_size == 256
    assert inherit(path, TrainConfig(batch_size=64)).batch_size == 64  # given: kept (describe() then refuses it)
    with pytest.raises(UsageError, match="--lr 0.01: the run in .* has --lr 0.008, which a resume keeps"):
        inherit(path, TrainConfig(lr=0.01))  # the loaded optimizer's rate would have overruled it, unsaid
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="not a readable checkpoint"):  # one line, before any process starts
        inherit(path, TrainConfig())

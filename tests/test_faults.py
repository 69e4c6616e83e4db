"""Never lose a run, never hang: signals to the launcher or to one rank, a launcher killed outright, a frozen rank (one
frozen in the kernel too), and a stale environment; the first failure named truly; orphans (a DataLoader worker, a
helper a script started, a rank whose launcher is gone) end with the job; a library job (train, launch) stopped by
SIGTERM, and a job whose stdout is closed (`| head`). Each end-to-end test runs a tiny `multicard train` in a process
group of its own and kills whatever is left of that group when it ends."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import multicard
from conftest import HUNG_S, JOB_VARIABLES, ROOT, clean_env, ended, gone, left, run_cli, running, session, started, stat
from multicard.errors import UsageError
from multicard.jobs import dist, job_end, launcher, launcher_watch, progress, protocol
from multicard.jobs.dist import Job

TRAIN = ["train", "--devices", "cpu:2", "--data", "synthetic", "--synthetic-samples", "512", "--epochs", "50",
         "--quiet", "--no-augment"]


def dispositions(ignore_sigint: bool) -> None:
    """In the launcher before it runs: SIGINT ignored as under `cmd &` where asked, else the signals at their
    defaults, whatever this test run inherited (a CI started in the background or under nohup ignores them)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


class Run:
    """`multicard train` in a new session (its own process group), its output read as it comes."""

    def __init__(self, out, *extra: str, ignore_sigint: bool = False):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "multicard", *TRAIN, "--out", str(out), *extra], cwd=ROOT,
            env=clean_env(TMPDIR=str(out.parent)),  # what a killed launcher cannot clean up stays in the test's folder
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            preexec_fn=lambda: dispositions(ignore_sigint))
        self.pid, self.lines, self.err, self.ranks = self.process.pid, queue.Queue(), [], []
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.process.stdout], daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.process.stderr), daemon=True).start()

    def training(self, within: float = 60) -> None:
        """Wait until rank 0 says it trains."""
        deadline = time.monotonic() + within
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if "training" in line:
                self.ranks = self.workers()
                return

    def workers(self) -> list[int]:
        """The launcher's spawned processes, in the order they started (ranks 0, 1, ...)."""
        return [pid for _, pid in sorted((int(stat(pid)[19]), pid) for pid in processes()
                                         if stat(pid)[1] == str(self.pid) and "spawn_main" in cmdline(pid))]

    def job(self) -> list[int]:
        """What is left of the job: the launcher's process group (it, the resource tracker) and each rank's (it, its
        DataLoader workers; a rank leads a session of its own), the ranks as they were once training."""
        return [pid for leader in (self.pid, *self.ranks) for pid in group(leader)]

    def end(self, within: float) -> tuple[int, str]:
        code = self.process.wait(within)
        time.sleep(0.2)  # the reading thread catches up
        return code, "".join(self.err)

    def kill(self) -> None:
        """Leave nothing behind: every process of the group, stopped ones too."""
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def runs():
    started: list[Run] = []
    yield lambda *args, **kw: started.append(Run(*args, **kw)) or started[-1]
    for run in started:
        run.kill()


def processes() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def group(pgid: int) -> list[int]:
    return running(pid for pid in processes() if stat(pid)[2] == str(pgid))


@pytest.mark.parametrize("name", ["SIGTERM", pytest.param("SIGHUP", marks=pytest.mark.slow),
                                  pytest.param("SIGINT", marks=pytest.mark.slow)])
def test_a_signal_to_the_launcher_stops_every_rank(tmp_path, runs, name):
    run = runs(tmp_path / "out")
    run.training()
    workers = run.workers()
    assert len(workers) == 2
    assert [os.getsid(pid) for pid in workers] == workers  # each leads a session of its own: see the next test
    os.kill(run.pid, getattr(signal, name))
    code, err = run.end(30)
    assert code == 128 + getattr(signal, name)
    assert err.rstrip().splitlines()[-1] == f"multicard: stopped by {name}; every rank was stopped"
    assert "leaked semaphore" not in err  # the ranks were stopped cleanly, not killed
    assert running(workers) == [] and gone(run.job, 5)
    assert not (tmp_path / "out" / "model.pt").exists()


SESSIONS = """
import os, sys, time
import multicard

mc = multicard.Multicard()
# one write a line (print writes the text and its newline apart, unbuffered): the ranks' lines never interleave
sys.stdout.write(f"rank {mc.rank} leads a session of its own: {os.getsid(0) == os.getpid()}\\n")
sys.stdout.flush()
try:
    while True:
        time.sleep(0.01)
except KeyboardInterrupt:
    sys.stdout.write(f"rank {mc.rank}: KeyboardInterrupt\\n")
    sys.stdout.flush()
"""


def test_run_ranks_lead_sessions_of_their_own_and_hear_ctrl_z_and_ctrl_c_through_the_launcher(tmp_path):
    """Each rank leads a session of its own, as torchrun's do: Linux shares a busy machine's cores between sessions
    first (autogroup), and ranks in the user's shell session shared one part of it (the same job waited for cores
    torchrun's got). Out of the terminal's reach, they hear of Ctrl-Z and Ctrl-C (SIGTSTP, SIGINT to the terminal's
    foreground group: the launcher) through it: they pause with it, go on after `fg` (SIGCONT), and the script sees
    its KeyboardInterrupt as it would alone."""
    (tmp_path / "job.py").write_text(SESSIONS)
    job = subprocess.Popen([sys.executable, "-m", "multicard", "run", "--devices", "cpu:2", "job.py"], cwd=tmp_path,
                           env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, preexec_fn=lambda: dispositions(False))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in job.stdout], daemon=True).start()
    ranks = []
    try:
        assert sorted(lines.get(timeout=HUNG_S) for _ in range(2)) == [
            f"rank {r} leads a session of its own: True" for r in (0, 1)]
        ranks = [pid for pid in processes() if stat(pid)[1] == str(job.pid)]
        assert len(ranks) == 2
        os.killpg(job.pid, signal.SIGTSTP)
        assert settles(lambda: [stat(pid)[0] for pid in (job.pid, *ranks)] == ["T"] * 3)
        os.killpg(job.pid, signal.SIGCONT)
        assert settles(lambda: all(stat(pid)[0] not in ("T", "t") for pid in (job.pid, *ranks)))
        os.killpg(job.pid, signal.SIGINT)
        assert job.wait(60) == 130
        assert sorted(lines.get(timeout=30) for _ in range(2)) == [f"rank {r}: KeyboardInterrupt" for r in (0, 1)]
        assert job.stderr.read().splitlines()[-1] == "multicard: stopped by SIGINT; every rank was stopped"
    finally:
        for pid in (job.pid, *ranks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def settles(check, within: float = 30) -> bool:
    """Whether check() holds within `within` seconds."""
    deadline = time.monotonic() + within
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


@pytest.mark.parametrize("when", ["start-up", pytest.param("training", marks=pytest.mark.slow)])
def test_a_launcher_killed_outright_takes_its_workers_along(tmp_path, runs, when):
    run = runs(tmp_path / "out", ignore_sigint=True)  # as under `&` or nohup: torch's SIGINT on parent death is lost
    if when == "training":
        run.training()
    deadline = time.monotonic() + 30
    while len(run.workers()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = run.workers()
    assert len(workers) == 2
    os.kill(run.pid, signal.SIGKILL)
    assert gone(lambda: running(workers), 15)
    time.sleep(1)  # nothing comes later either
    assert not (tmp_path / "out" / "model.pt").exists()


@pytest.mark.slow
def test_sigint_to_one_worker_fails_the_job_naming_it(tmp_path, runs):
    run = runs(tmp_path / "out")
    run.training()
    os.kill(run.workers()[1], signal.SIGINT)
    code, err = run.end(30)
    assert code == 1
    assert "multicard: rank 1 was interrupted (SIGINT); every rank was stopped" in err
    assert "leaked semaphore" not in err
    assert gone(run.job, 5)


@pytest.mark.slow
def test_a_frozen_rank_is_named_within_the_timeout(tmp_path, runs):
    run = runs(tmp_path / "out", "--timeout", "5")
    run.training()
    os.kill(run.workers()[1], signal.SIGSTOP)
    code, err = run.end(5 + 120)  # the timeout, then the stop (grace 5 s); no hang, however busy the machine
    assert code != 0
    assert ("multicard: rank 1 stopped making progress (it was stopped by a signal; rank 0 timed out waiting for it "
            "after 5 s); every rank was stopped") in err
    assert "leaked semaphore" not in err
    assert gone(run.job, 10)


@pytest.mark.slow
def test_multicard_run_names_a_frozen_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, signal\nimport multicard\nfrom multicard.jobs import dist\n"
                      "mc = multicard.Multicard(timeout=3)\n"
                      "for step in range(10**6):\n    dist.progress()\n    mc.all_reduce(1.0)\n"
                      "    if step == 20 and mc.rank == 1:\n        os.kill(os.getpid(), signal.SIGSTOP)\n")
    out = subprocess.Popen([sys.executable, "-m", "multicard", "run", "--devices", "cpu:2", str(script)], cwd=ROOT,
                           env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, preexec_fn=lambda: dispositions(False))
    try:
        err = out.communicate(timeout=HUNG_S)[1]
        assert out.returncode != 0
        assert err.rstrip().splitlines()[-1] == ("multicard: rank 1 stopped making progress (it was stopped by a "
                                                 "signal; rank 0 timed out waiting for it after 3 s); every rank was "
                                                 "stopped")
    finally:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.killpg(out.pid, sig)
            except ProcessLookupError:
                pass


def test_a_stale_environment_names_the_missing_rank(tmp_path):
    port = launcher.free_port()
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "multicard", "train", "--data", "synthetic", "--synthetic-samples",
                          "64", "--epochs", "1", "--quiet", "--timeout", "3", "--out", str(tmp_path)], cwd=ROOT,
                         env=clean_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                         capture_output=True, text=True, timeout=HUNG_S)
    assert out.returncode == 2 and time.monotonic() - start < 100  # --timeout 3, not the default 120 s
    assert out.stderr.splitlines() == [
        f"multicard: error: rendezvous at 127.0.0.1:{port}: 1 of 2 processes joined within 3 s; missing rank 1 "
        f"(RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT came from the environment (torchrun, SLURM or your shell): a "
        f"stale environment? unset RANK and WORLD_SIZE to run alone)"]


@pytest.mark.parametrize("env, words", [({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5 with WORLD_SIZE=2"),
                                        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' in the environment is not a")])
def test_an_impossible_job_is_one_line_at_once(tmp_path, env, words):
    start = time.monotonic()
    out = run_cli("train", "--out", str(tmp_path), env=clean_env(**env), timeout=HUNG_S)
    assert out.returncode == 2 and time.monotonic() - start < 100  # refused before any wait (the timeout: 120 s)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("multicard: error: ") and words in lines[0]


# -- the parts, in this process ------------------------------------------------------------------------------
@pytest.fixture
def slot(tmp_path, monkeypatch):
    """This process as rank 0 of a job our launcher started: its progress file."""
    path = job_end.slot_path(str(tmp_path), 0)
    progress.new_slot(path)
    monkeypatch.setenv(progress.PROGRESS, path)
    progress.progress_slot.cache_clear()  # mapped afresh, as a new rank maps it
    yield path
    progress.progress_slot.cache_clear()


def test_progress_reaches_the_launcher(slot):
    assert protocol.read_slot(slot).fields() == dict.fromkeys(protocol.FIELDS, 0.0)
    before = time.monotonic()
    progress.progress()
    shown = protocol.read_slot(slot)
    assert before <= shown.last <= time.monotonic() and not shown.state
    progress.failed(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"))
    assert protocol.read_slot(slot).state == protocol.TIMED_OUT_STATE


def test_progress_outside_a_job_is_nearly_free(monkeypatch):
    monkeypatch.delenv(progress.PROGRESS, raising=False)
    progress.progress_slot.cache_clear()
    def timed(call) -> float:
        start = time.perf_counter()
        for _ in range(100_000):
            call()
        return time.perf_counter() - start

    # about 0.2 us a call, a few times a call that does nothing (the reference, timed alike: a busy machine slows both)
    assert timed(progress.progress) < 20 * timed(lambda: None) + 0.05


def test_blame_falls_on_the_stopped_rank_else_the_one_without_progress(tmp_path):
    folder = str(tmp_path)
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        for rank in range(3):
            progress.new_slot(job_end.slot_path(folder, rank))

        def show(rank: int, last: float, timed_out: bool = False) -> None:
            slot = protocol.mapped(job_end.slot_path(folder, rank))
            slot.last, slot.timeout, slot.state = last, 5.0, protocol.TIMED_OUT_STATE if timed_out else 0.0

        now = time.monotonic()
        show(0, now - 6)
        show(1, now - 1)
        show(2, now - 9)
        others = {1: sleepers[0].pid, 2: sleepers[1].pid}
        assert job_end.blame(0, others, folder) is None  # rank 0 did not time out: it failed on its own
        show(0, now - 6, timed_out=True)
        rank, why = job_end.blame(0, others, folder)
        assert rank == 2 and why.startswith("rank 2 stopped making progress (no progress from it for 9 s; rank 0 "
                                            "timed out waiting for it after 5 s")
        os.kill(sleepers[0].pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while stat(sleepers[0].pid)[0] != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job_end.blame(0, others, folder) == (1, "rank 1 stopped making progress (it was stopped by a signal; "
                                                        "rank 0 timed out waiting for it after 5 s)")
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


def test_a_rendezvous_names_who_is_missing(monkeypatch):
    port, other = launcher.free_port(), launcher.free_port()  # the store of the first try may outlive it
    for name in JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UsageError, match=rf"^rendezvous at 127.0.0.1:{port}: 1 of 3 processes joined within "
                                              r"1 s; missing ranks 1 and 2 \(RANK/WORLD_SIZE"):
        dist.rendezvous(Job(0, 3, launcher="torchrun"), 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", str(other))
    with pytest.raises(UsageError, match=rf"^rendezvous at 127.0.0.1:{other}: rank 1 of 3 found no rank 0 "
                                              r"there within 1 s \(RANK/WORLD_SIZE"):
        dist.rendezvous(Job(1, 3, launcher="torchrun"), 1)


# -- the first failure, truly -----------------------------------------------------------------------------------------
def test_a_rank_that_only_lost_another_is_not_named_first(tmp_path):
    folder = str(tmp_path)
    for rank in range(3):
        progress.new_slot(job_end.slot_path(folder, rank))
    slot = protocol.mapped(job_end.slot_path(folder, 0))
    slot.last, slot.timeout, slot.state = 1.0, 5.0, protocol.LOST_PEER
    codes = {0: 1, 1: 3, 2: 0}
    order = [[0], [], [1], [2]]  # rank 0 is seen to end first (its gloo error), rank 1 (the cause) a moment later
    ended = lambda running, timeout: order.pop(0) if order else []  # noqa: E731
    assert job_end.first_to_fail(3, ended, codes.get, folder) == 1
    order[:] = [[0], [2]]  # no other failure within the grace: rank 0 is all there is to name
    assert job_end.first_to_fail(3, lambda running, timeout: order.pop(0) if order else [], codes.get, folder) == 0


def test_only_a_rank_stopped_on_purpose_is_meant(tmp_path):
    import pickle

    folder = str(tmp_path)
    for rank in range(2):
        progress.new_slot(job_end.slot_path(folder, rank))
    with open(os.path.join(folder, "error-1"), "wb") as f:
        pickle.dump(("said", "rank 1 was interrupted (SIGINT)"), f)
    meant = launcher._failure(1, [], folder)
    assert meant.meant and pickle.loads(pickle.dumps(meant)).meant
    slot = protocol.mapped(job_end.slot_path(folder, 0))  # rank 0 timed out waiting: for a frozen rank 1
    slot.last, slot.timeout, slot.state = 1.0, 5.0, protocol.TIMED_OUT_STATE
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        frozen = launcher._failure(0, [Alive(0), Alive(sleeper.pid)], folder)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert frozen.rank == 1 and "stopped making progress" in frozen.trace and not frozen.meant


class Alive:
    def __init__(self, pid: int):
        self.pid, self.exitcode = pid, 1

    def is_alive(self) -> bool:
        return True


def test_ranks_that_each_timed_out_waiting_for_the_other_called_different_collectives(tmp_path, monkeypatch):
    monkeypatch.setattr(job_end, "MISMATCH_S", 0.2)
    folder = str(tmp_path)
    now = time.monotonic()
    for rank in range(3):
        progress.new_slot(job_end.slot_path(folder, rank))

    def show(rank: int, last: float, state: float) -> None:
        slot = protocol.mapped(job_end.slot_path(folder, rank))
        slot.last, slot.timeout, slot.state = last, 5.0, state

    show(0, now - 6, protocol.TIMED_OUT_STATE)
    show(1, now - 6, protocol.TIMED_OUT_STATE)
    show(2, now - 5, protocol.TIMED_OUT_STATE)
    assert job_end.blame(0, {}, folder, 3) == (0, "rank 0 timed out waiting for ranks 1 and 2 after 5 s, and ranks 1 "
                                                   "and 2 for it: the ranks called different collectives (or the "
                                                   "same ones in another order)")
    show(2, now - 9, 0.0)  # rank 2 did not wait: it stopped making progress
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        rank, why = job_end.blame(0, {2: sleeper.pid}, folder, 3)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert rank == 2 and why.startswith("rank 2 stopped making progress (no progress from it for 9 s")


class Frozen:
    """A process that SIGKILL does not end (one frozen by a cgroup freezer ends only once thawed)."""

    pid, returncode, exitcode, sentinel = 999_999, None, None, -1
    killed = False

    def poll(self):
        return None

    def wait(self, timeout=None):
        if timeout is None:
            raise AssertionError("waited on a frozen process without a limit")
        time.sleep(min(timeout, 0.05))
        raise subprocess.TimeoutExpired("frozen", timeout)

    def is_alive(self):
        return True

    def join(self, timeout=None):
        if timeout is None:
            raise AssertionError("waited on a frozen process without a limit")
        time.sleep(min(timeout, 0.05))

    def terminate(self):
        pass

    def send_signal(self, signum):
        pass

    kill = terminate


class FrozenCommand(Frozen, subprocess.Popen):
    """Frozen, as multicard run holds its ranks."""

    _child_created = False  # nothing for Popen's own __del__ to reap

    def __new__(cls):
        return object.__new__(cls)

    def __init__(self):
        pass


@pytest.mark.parametrize("stop", ["run", "spawn"])
def test_a_rank_frozen_in_the_kernel_is_not_waited_for_without_limit(monkeypatch, capsys, stop):
    monkeypatch.setattr(job_end, "KILLED_S", 0.2)
    for name in ("kill", "killpg"):  # the signals for a process that is not there
        monkeypatch.setattr(os, name, lambda pid, sig: None)
    start = time.monotonic()
    job_end.stop([FrozenCommand() if stop == "run" else Frozen()], grace_s=0.2)
    assert time.monotonic() - start < 60  # its 0.2 s graces, not forever (a busy machine may take seconds)
    assert "multicard: rank 0 (pid 999999) did not end on SIGKILL" in capsys.readouterr().err


def test_a_progress_variable_naming_a_users_file_writes_nothing_into_it(tmp_path, monkeypatch, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious data, 32 bytes of it!!\n")
    monkeypatch.setenv(progress.PROGRESS, str(victim))
    progress.progress_slot.cache_clear()
    progress.progress()
    progress.failed(RuntimeError("Timed out waiting 5000ms"))
    assert victim.read_bytes() == b"precious data, 32 bytes of it!!\n"
    assert capsys.readouterr().err.splitlines() == [
        f"multicard: {progress.PROGRESS}={victim} is not a progress file a multicard launcher made; ignored"]


@pytest.mark.slow
def test_a_rank_that_raises_is_the_only_traceback_shown(tmp_path):
    (tmp_path / "boom.py").write_text(
        "import os\nimport torch\n\n\nclass Net(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.f, self.calls = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)), 0\n\n"
        "    def forward(self, x):\n        self.calls += 1\n"
        "        if os.environ['RANK'] == '1' and self.calls == 3:\n            raise ValueError('boom on rank 1')\n"
        "        return self.f(x)\n")
    out = run_cli("train", "--model", f"{tmp_path / 'boom.py'}:Net", "--devices", "cpu:2", "--data", "synthetic",
                  "--synthetic-samples", "2048", "--epochs", "1", "--quiet", "--out", str(tmp_path / "out"),
                  env=clean_env(), timeout=HUNG_S)
    assert out.returncode == 1
    assert out.stderr.startswith("multicard: rank 1 failed; its traceback:\nTraceback")
    assert out.stderr.count("Traceback") == 1 and out.stderr.rstrip().endswith("ValueError: boom on rank 1")
    assert "gloo" not in out.stderr and "peer" not in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["launcher", "rank"])
def test_with_workers_a_kill_leaves_no_process_behind(tmp_path, runs, victim):
    """SIGKILL to the launcher, or to one rank: its DataLoader workers and the resource tracker end too (the
    workers are started by the ranks, the tracker lives while any of them holds its pipe). A worker still
    starting (importing torch: seconds on 2 busy cores) ends once it has."""
    run = runs(tmp_path / "out", "--workers", "2", ignore_sigint=True)
    run.training()
    deadline = time.monotonic() + 60
    while len(run.job()) < 1 + 2 + 2 * 2 and time.monotonic() < deadline:  # launcher, ranks, their workers
        time.sleep(0.05)
    assert len(run.job()) >= 1 + 2 + 2 * 2
    os.kill(run.pid if victim == "launcher" else run.ranks[1], signal.SIGKILL)
    if victim == "rank":
        code, err = run.end(60)
        assert code != 0 and "rank 1 ended with signal SIGKILL" in err
    assert gone(run.job, 30)


def test_a_rank_whose_launcher_died_while_it_imported_ends_once_it_watches():
    """The launcher (here a shell standing in for torchrun's agent) is gone before the rank starts watching it
    (a rank importing torch on busy cores takes seconds): the rank, adopted by another process by then, still
    sees its launcher gone and ends with one line, instead of waiting on a store that nobody holds."""
    rank = ("import os, sys, time, multicard\nfrom multicard.jobs import launcher_watch\nfirst = os.getppid()\n"
            "print('imported', flush=True)\nwhile os.getppid() == first:\n    time.sleep(0.05)\n"
            "launcher_watch.watch_parent(1)\nprint('still here', file=sys.stderr)\n")
    launcher = ("import os, subprocess, sys\n"
                "rank = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdout=subprocess.PIPE, text=True)\n"
                "rank.stdout.readline()\nos._exit(0)\n")  # gone once the rank has imported multicard
    done = subprocess.run([sys.executable, "-c", launcher, rank], capture_output=True, text=True, timeout=HUNG_S,
                          cwd=ROOT, env=clean_env())
    assert re.fullmatch(r"multicard: rank 1: its launcher \(pid \d+\) is gone; this rank ends\n", done.stderr)


@pytest.mark.slow
def test_torchrun_killed_outright_takes_its_ranks_along_and_publishes_nothing(tmp_path):
    """torchrun's agent does not end its ranks when it is killed outright: they watch it, end within a second or
    so, and rank 0 never shows its run in --out."""
    out = tmp_path / "out"
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "-m", "multicard", "train", *TRAIN[3:], "--out", str(out)], cwd=ROOT, env=clean_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while len(ranks := [p for p in processes() if stat(p)[1] == str(agent.pid) and "multicard" in cmdline(p)
                            and "torch.distributed.run" not in cmdline(p)]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(ranks) == 2
        while not list(out.glob(".run-*")) and time.monotonic() < deadline:  # rank 0 has begun its run
            time.sleep(0.1)
        os.kill(agent.pid, signal.SIGKILL)
        assert gone(lambda: running(ranks), 15)
        assert not (out / "model.pt").exists()
    finally:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.killpg(agent.pid, sig)
            except ProcessLookupError:
                pass


@pytest.mark.slow
def test_a_frozen_rank_is_restarted_under_max_restarts(tmp_path, runs):
    """A rank stopped by SIGSTOP did not choose to stop (as one sent SIGINT or SIGTERM did): it is restarted."""
    run = runs(tmp_path / "out", "--timeout", "5", "--max-restarts", "2")
    run.training()
    os.kill(run.workers()[1], signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while "restart 1 of 2" not in (line := run.lines.get(timeout=max(0.0, deadline - time.monotonic()))):
        pass
    assert line.startswith("multicard: rank 1 failed; restart 1 of 2")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGHUP", "SIGINT"])
def test_a_signal_to_the_whole_process_group_is_one_line(tmp_path, runs, name):
    """As a closed terminal (SIGHUP) or Ctrl-C (SIGINT) signals the launcher and the resource tracker at once (the
    ranks lead sessions of their own: the launcher passes it on): the tracker lives on (else each rank's cleanup
    starts a new one: a traceback per rank)."""
    run = runs(tmp_path / "out")
    run.training()
    os.killpg(run.pid, getattr(signal, name))
    code, err = run.end(30)
    assert code == 128 + getattr(signal, name)
    assert err.strip().splitlines() == [f"multicard: stopped by {name}; every rank was stopped"]
    assert gone(run.job, 5)


# -- orphans: what a rank or its script started ends with the job -----------------------------------------------------
@pytest.mark.parametrize("start", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])  # fork: Linux's default
def test_a_dataloader_worker_hung_in_getitem_ends_with_the_job_when_its_rank_is_killed(tmp_path, start):
    """A worker of a loader multicard set up, hung in __getitem__, when its rank is killed outright (the OOM
    killer): the launcher stops the job, and the worker goes with its rank's process group."""
    (tmp_path / "hangs.py").write_text(
        "import os, time\nimport torch\nimport multicard\n"
        "class Hangs(torch.utils.data.Dataset):\n    def __len__(self):\n        return 8\n"
        "    def __getitem__(self, i):\n        print('worker', os.getpid(), flush=True)\n        time.sleep(600)\n"
        "if __name__ == '__main__':\n"
        "    mc = multicard.Multicard()\n"
        "    print('rank', os.getpid(), flush=True)\n"
        f"    loader = torch.utils.data.DataLoader(Hangs(), 4, num_workers=1, multiprocessing_context='{start}')\n"
        "    next(iter(mc.setup_dataloader(loader, train=False)))\n")
    job = subprocess.Popen([sys.executable, "-m", "multicard", "run", "--devices", "cpu:1", "--quiet", "hangs.py"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}, start_new_session=True)
    try:
        said = dict(job.stdout.readline().split() for _ in range(2))  # the rank, then its worker in __getitem__
        rank, worker = int(said["rank"]), int(said["worker"])
        assert worker != rank and alive(worker)
        os.kill(rank, 9)
        assert job.wait(HUNG_S) == 128 + 9
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, 9)


def test_a_rank_whose_launcher_is_gone_ends_and_never_publishes(monkeypatch, capsys):
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(launcher_watch, "_parent", os.getppid())
    launcher_watch.end_if_orphaned(0)
    assert killed == []  # its launcher is there
    monkeypatch.setattr(launcher_watch, "_parent", os.getppid() + 1)  # as after the launcher died: another parent
    launcher_watch.end_if_orphaned(3)
    assert killed == [(os.getpid(), 9)]
    err = capsys.readouterr().err
    assert f"multicard: rank 3: its launcher (pid {os.getppid() + 1}) is gone; this rank ends" in err


def test_a_launcher_killed_outright_takes_its_ranks_and_every_helper_they_started(tmp_path):
    """SIGKILL to `multicard run`: each rank sees its launcher gone and ends with its whole process group, so a
    helper the script started ends too, tied to the rank by the script itself or not (docs/distributed.md)."""
    (tmp_path / "helpers.py").write_text(textwrap.dedent(f"""
        import ctypes, os, signal, subprocess
        import multicard
        mc = multicard.Multicard(timeout=300)
        tied = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL))
        loose = subprocess.Popen(["sleep", "60"])
        with open({str(tmp_path)!r} + f"/pids-{{mc.rank}}", "w") as f:
            f.write(f"{{os.getpid()}} {{tied.pid}} {{loose.pid}}")
        mc.barrier()
        signal.pause()
    """))
    command = [sys.executable, "-m", "multicard", "run", "--devices", "cpu:2", str(tmp_path / "helpers.py")]
    run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=clean_env())
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 6 and time.monotonic() < deadline:
            found = [tmp_path / f"pids-{r}" for r in range(2)]
            pids = [int(p) for f in found if f.exists() for p in f.read_text().split()]
            time.sleep(0.1)
        assert len(pids) == 6
        run.kill()
        run.wait(10)
        deadline = time.monotonic() + 10
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(alive, pids))
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended and not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


# -- issue 48: a rank lives as your script would -------------------------------------------------------------------
PLAIN_OR_LAUNCHED = """

if __name__ == "__main__":  # job(mc, folder): as a plain script would run it, or launched on 2 processes
    if sys.argv[2] == "plain":
        job(None, sys.argv[1])
    else:
        multicard.launch(job, sys.argv[1], strategy="ddp", devices="cpu:2")
"""
FORKS = """
import multiprocessing, os, sys, threading, time
import torch
from torch.utils.data import DataLoader
import multicard


def work(path):
    time.sleep(1)
    with open(path, "w") as f:
        f.write("done")


def from_a_thread(path, started):  # the thread ends as soon as its process is started
    started.append(multiprocessing.get_context("fork").Process(target=work, args=(path,)))
    started[-1].start()


def daemon(path):  # a double fork: the middle process ends at once
    if os.fork() == 0:
        if os.fork() == 0:
            work(path)
            os._exit(0)
        os._exit(0)


def job(mc, where):
    rank = mc.rank if mc is not None else 0
    started = []
    helper = threading.Thread(target=from_a_thread, args=(f"{where}/thread-{rank}", started))
    helper.start()
    helper.join()
    daemon(f"{where}/daemon-{rank}")
    loader = DataLoader(torch.arange(16.0), batch_size=4, num_workers=1, persistent_workers=True)
    if mc is not None:
        loader = mc.setup_dataloader(loader, train=False)
    served = []
    helper = threading.Thread(target=lambda: served.extend(loader))  # its workers start in a thread that ends
    helper.start()
    helper.join()
    time.sleep(0.5)
    served.extend(loader)  # a second pass: the persistent workers still serve
    started[0].join()
    with open(f"{where}/served-{rank}", "w") as f:
        f.write(str(len(served)))
""" + PLAIN_OR_LAUNCHED


@pytest.mark.parametrize("how", ["plain", "launch"])
def test_what_a_rank_forks_lives_until_it_finishes_as_under_plain_python(tmp_path, how):
    """A process forked from a helper thread that then ends, a double-forked daemon, and persistent DataLoader
    workers first iterated in a helper thread: plain python lets each finish, and so does every rank (nothing of
    the job ties them to the thread that forked them)."""
    (tmp_path / "forks.py").write_text(FORKS)
    (tmp_path / "out").mkdir()
    done = subprocess.run([sys.executable, "forks.py", str(tmp_path / "out"), how], cwd=tmp_path, capture_output=True,
                          text=True, timeout=HUNG_S, env=clean_env())
    assert done.returncode == 0, done.stderr
    ranks = (0,) if how == "plain" else (0, 1)
    expected = {f"{kind}-{r}" for r in ranks for kind in ("thread", "daemon", "served")}
    assert settles(lambda: {p.name for p in (tmp_path / "out").iterdir()} == expected)  # the daemons end after
    assert all((tmp_path / "out" / f"thread-{r}").read_text() == "done" for r in ranks)


KIDS = """
import os, signal, subprocess, sys, time
import multicard

mc = multicard.Multicard()
mc.barrier()  # it has joined the job: it watches its launcher
child = subprocess.Popen(["sleep", "600"])  # a rank's own child, in its process group
if os.fork() == 0:  # a worker of its own, forked
    time.sleep(600)
    os._exit(0)
sys.stdout.write(f"up {mc.rank}\\n")
sys.stdout.flush()
while True:
    time.sleep(0.05)
"""


def ctrl_z_then(signum: int):
    def stop(launcher: int) -> None:
        os.killpg(launcher, signal.SIGTSTP)  # the terminal's Ctrl-Z: the launcher pauses the ranks, then itself
        assert settles(lambda: stat(launcher)[0] == "T")
        os.killpg(launcher, signum)  # `kill %1` (SIGTERM) or the shell's exit (SIGHUP), each with a SIGCONT
        os.killpg(launcher, signal.SIGCONT)
    return stop


STOPS = {
    "SIGTERM": lambda launcher: os.kill(launcher, signal.SIGTERM),
    "SIGHUP": lambda launcher: os.killpg(launcher, signal.SIGHUP),  # a closed terminal
    "SIGINT": lambda launcher: os.killpg(launcher, signal.SIGINT),  # Ctrl-C
    "ctrl-z-then-kill": ctrl_z_then(signal.SIGTERM),
    "ctrl-z-then-exit": ctrl_z_then(signal.SIGHUP),
    "launcher-group-sigkill": lambda launcher: os.killpg(launcher, signal.SIGKILL),  # kill -9 -- -PGID
}


@pytest.mark.parametrize("stop", [*STOPS][:2] + [pytest.param(s, marks=pytest.mark.slow) for s in [*STOPS][2:-1]]
                         + [[*STOPS][-1]])
def test_every_stop_leaves_no_process_of_the_job_behind(tmp_path, stop):
    """Each rank of `multicard run` starts a process of its own and forks a worker (both stay in the process group
    the rank leads, as torchrun's ranks do); however the job is stopped, none of them is left, running or
    stopped."""
    (tmp_path / "kids.py").write_text(KIDS)
    job = subprocess.Popen([sys.executable, "-m", "multicard", "run", "--devices", "cpu:2", "kids.py"], cwd=tmp_path,
                           env=clean_env(TMPDIR=str(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True, preexec_fn=lambda: dispositions(False))
    try:
        assert sorted(job.stdout.readline().split()[1] for _ in range(2)) == ["0", "1"]
        assert settles(lambda: len(left(tmp_path)) == 1 + 2 * 3)  # the launcher; each rank, its child and its fork
        STOPS[stop](job.pid)
        job.wait(HUNG_S)
        assert gone(lambda: left(tmp_path), 30), [cmdline(pid) for pid in left(tmp_path)]
    finally:
        for pid in [job.pid, *left(tmp_path)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


WARNED = """
import os, signal, sys, time
import multicard

mc = multicard.Multicard()
mc.barrier()
warned = []
if sys.argv[1] == "handled":  # a script that saves when the cluster warns it (SLURM's --signal=USR1@90)
    signal.signal(signal.SIGUSR1, lambda signum, frame: warned.append(signum))
sys.stdout.write(f"up {mc.rank}\\n")
sys.stdout.flush()
while not warned:
    time.sleep(0.05)
with open(f"saved-{mc.rank}", "w") as f:
    f.write("saved")
"""


@pytest.mark.parametrize("handled", ["handled", "unhandled"])
def test_sigusr1_to_the_launcher_reaches_every_ranks_handler(tmp_path, handled):
    """SIGUSR1 (SIGUSR2 alike) is passed on to every rank, whose own handler runs and the job goes on; where the
    script sets none, the signal ends each rank as it ends a plain script, and the launcher says so in one line."""
    (tmp_path / "warned.py").write_text(WARNED)
    job = subprocess.Popen([sys.executable, "-m", "multicard", "run", "--devices", "cpu:2", "warned.py", handled],
                           cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, preexec_fn=lambda: dispositions(False))
    try:
        assert sorted(job.stdout.readline().split()[1] for _ in range(2)) == ["0", "1"]
        os.kill(job.pid, signal.SIGUSR1)
        code, err = job.wait(HUNG_S), job.stderr.read()
        if handled == "handled":
            assert code == 0 and sorted(p.name for p in tmp_path.glob("saved-*")) == ["saved-0", "saved-1"], err
        else:
            assert code == 128 + signal.SIGUSR1 and not list(tmp_path.glob("saved-*"))
            assert re.search(r"multicard: rank [01] ended on SIGUSR1, which this launcher passed on to every rank: the "
                             r"script has no handler for it \(set one with signal.signal\(SIGUSR1, \.\.\.\) to act on "
                             r"it, e\.g\. save a checkpoint\); the other ranks were stopped\n$", err), err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)


SLOW_SAVE = """
import signal, sys, time
import multicard

mc = multicard.Multicard()
mc.barrier()
stopping = []
signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
sys.stdout.write(f"up {mc.rank}\\n")
sys.stdout.flush()
while not stopping:
    time.sleep(0.05)
time.sleep(6)  # a save that takes longer than the 5 s a launcher once gave
with open(f"saved-{mc.rank}", "w") as f:
    f.write("saved")
sys.exit(143)
"""


@pytest.mark.parametrize("grace", [None, pytest.param("1", marks=pytest.mark.slow)])
def test_a_sigterm_handler_gets_torchruns_30_s_to_save_or_the_grace_given(tmp_path, grace):
    (tmp_path / "slow_save.py").write_text(SLOW_SAVE)
    flags = ["--stop-grace", grace] if grace else []
    job = subprocess.Popen([sys.executable, "-m", "multicard", "run", *flags, "--devices", "cpu:2", "slow_save.py"],
                           cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, preexec_fn=lambda: dispositions(False))
    try:
        assert sorted(job.stdout.readline().split()[1] for _ in range(2)) == ["0", "1"]
        os.kill(job.pid, signal.SIGTERM)
        assert job.wait(HUNG_S) == 128 + signal.SIGTERM
        saved = sorted(p.name for p in tmp_path.glob("saved-*"))
        assert saved == ([] if grace else ["saved-0", "saved-1"])
        assert job.stderr.read().splitlines()[-1] == "multicard: stopped by SIGTERM; every rank was stopped"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)


@pytest.mark.parametrize("grace", ["-1", "inf", "nan"])
def test_a_stop_grace_that_is_no_number_of_seconds_is_one_line(grace):
    done = run_cli("run", "--stop-grace", grace, "--devices", "cpu:2", "job.py")
    assert done.returncode == 2 and "\n" not in done.stderr.strip()
    assert done.stderr.strip().endswith(f"--stop-grace {float(grace):g}: give the seconds a rank gets between the "
                                        f"stop signal and SIGKILL (0 or more)")
    with pytest.raises(UsageError, match=rf"^stop_grace={float(grace)!r}: give the seconds"):
        multicard.launch(print, strategy="ddp", devices="cpu:2", stop_grace=float(grace))


# -- a library job (train, launch) stopped by SIGTERM -----------------------------------------------------------------
def up(process: subprocess.Popen, ranks: int, within: float = 120) -> None:
    """Wait until every rank has said "up" on stdout."""
    deadline, seen = time.monotonic() + within, 0
    while seen < ranks:
        assert time.monotonic() < deadline, "the ranks did not start"
        seen += process.stdout.readline().count("up")  # print writes "up" and "\n" apart: lines may interleave


LIBRARY_JOB = """
    import sys, time, torch, multicard
    from torch import nn
    from torch.utils.data import TensorDataset

    class Slow(nn.Linear):
        def forward(self, x):
            time.sleep(0.05)
            return super().forward(x)

    def job(mc):
        print("up", flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        devices = f"cpu:{sys.argv[2]}"
        if sys.argv[1] == "train":
            data = TensorDataset(torch.randn(4608, 16), torch.randint(0, 2, (4608,)))
            multicard.train(Slow(16, 2), data, None, out="out", devices=devices, strategy="ddp", epochs=50,
                            batch_size=96, save_every_steps=2)
        else:
            multicard.launch(job, devices=devices)
"""


def sigterm_ends_the_library_job(tmp_path: Path, how: str, processes: int) -> None:
    job = started(tmp_path, LIBRARY_JOB, how, str(processes))
    if how == "train":  # --out holds an earlier run's files, which the stopped one leaves as they were
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "notes.txt").write_text("mine")
        deadline = time.monotonic() + 120
        while not list((tmp_path / "out").glob("checkpoints/step-*")):
            assert time.monotonic() < deadline and job.poll() is None, "no checkpoint came"
            time.sleep(0.1)
    else:
        up(job, processes)
    before = time.monotonic()
    job.send_signal(signal.SIGTERM)
    code, _, err = ended(job, 60)
    assert code == -signal.SIGTERM, err
    assert err.splitlines()[-1] == "multicard: stopped by SIGTERM; every rank was stopped", err
    assert "Traceback" not in err
    assert time.monotonic() - before < 30  # the ranks get 5 s after SIGTERM, then SIGKILL
    assert gone(lambda: left(tmp_path), 10)
    if how == "train":
        assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")) == \
            ["checkpoints", "notes.txt"]
        assert (tmp_path / "out" / "notes.txt").read_text() == "mine" and not list((tmp_path / "out").glob(".run-*"))


@pytest.mark.usefixtures("nothing_left")
@pytest.mark.slow
def test_sigterm_ends_a_train_call_and_its_ranks_as_the_signal_would(tmp_path):
    sigterm_ends_the_library_job(tmp_path, "train", 2)


@pytest.mark.usefixtures("nothing_left")
@pytest.mark.slow
@pytest.mark.parametrize("how", ["train", "launch"])
def test_sigterm_ends_a_three_process_library_job(tmp_path, how):
    sigterm_ends_the_library_job(tmp_path, how, 3)


# -- a closed stdout (`| head`) ---------------------------------------------------------------------------------------
TALKS = """
    import multicard
    mc = multicard.Multicard()
    step = 0
    while True:  # until stdout is closed under it
        mc.all_reduce(1.0)
        mc.print(f"line {step}")
        step += 1
"""


def head_of_multicard_run(tmp_path: Path, processes: int) -> None:
    """`multicard run script.py | head -2`: the reader goes after two lines; the job ends as `yes | head -2`
    does (by SIGPIPE, a shell shows 141), without a word on stderr, no rank left."""
    (tmp_path / "job.py").write_text(textwrap.dedent(TALKS))
    job = session([sys.executable, "-m", "multicard", "run", "--quiet", "--devices", f"cpu:{processes}",
                   str(tmp_path / "job.py")], tmp_path, ROOT)
    assert [job.stdout.readline() for _ in range(2)] == ["line 0\n", "line 1\n"]
    job.stdout.close()  # what head does once it has its lines
    code, _, err = ended(job, 60)
    assert code == -signal.SIGPIPE and err == ""
    assert gone(lambda: left(tmp_path), 10)


@pytest.mark.usefixtures("nothing_left")
@pytest.mark.slow
def test_multicard_run_into_a_closed_pipe_ends_quietly_by_sigpipe(tmp_path):
    head_of_multicard_run(tmp_path, 2)


@pytest.mark.usefixtures("nothing_left")
@pytest.mark.slow
def test_multicard_run_of_three_into_a_closed_pipe_ends_quietly_by_sigpipe(tmp_path):
    head_of_multicard_run(tmp_path, 3)


@pytest.mark.usefixtures("nothing_left")
@pytest.mark.slow
def test_multicard_train_into_a_closed_pipe_ends_quietly_by_sigpipe_and_shows_nothing(tmp_path):
    job = session([sys.executable, "-m", "multicard", "train", "--devices", "cpu:2", "--data", "synthetic",
                   "--synthetic-samples", "512", "--epochs", "3", "--out", str(tmp_path / "out")], tmp_path, ROOT)
    assert job.stdout.readline().startswith("multicard: training LeNet5")
    job.stdout.close()
    code, _, err = ended(job, 120)
    assert code == -signal.SIGPIPE and err == ""
    assert gone(lambda: left(tmp_path), 10)
    assert list((tmp_path / "out").iterdir()) == []

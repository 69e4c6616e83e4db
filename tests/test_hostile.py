"""A hostile user's second round (issue 23): no hang past --timeout, no process left behind, one line instead of a
traceback, no file written that multicard did not make. The parts are tried in this process where they can be;
what needs a whole job runs a tiny one."""

from __future__ import annotations

import contextlib
import gzip
import http.server
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from conftest import HUNG_S, ROOT, run_cli
from multicard import models
from multicard.data import idx
from multicard.errors import UsageError
from multicard.jobs import dist, launcher, lifeline, outcome, progress
from multicard.jobs.dist import Job, job_from_env, rendezvous_env
from test_faults import JOB_VARIABLES, clean_env


# -- hangs ---------------------------------------------------------------------------------------------------
@pytest.fixture
def job_env(monkeypatch):
    """This process as rank 1 of 2 of a job met at a port (given later), its launcher's variables cleared."""
    for name in (*JOB_VARIABLES, lifeline.LAUNCHER_PID):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(progress, "_slot", None)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    return monkeypatch


def silent_listener(sock: socket.socket) -> None:
    sock.listen(8)  # accepts connections (the system does) and never says a word


def web_server(sock: socket.socket) -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler, bind_and_activate=False)
    server.socket = sock
    sock.listen(8)
    threading.Thread(target=server.serve_forever, daemon=True).start()


@pytest.mark.parametrize("serve", [silent_listener, web_server], ids=["silent", "http"])
def test_something_else_at_master_port_ends_within_the_timeout(job_env, serve):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        serve(sock)
        port = sock.getsockname()[1]
        job_env.setenv("MASTER_PORT", str(port))
        start = time.monotonic()
        with pytest.raises(UsageError, match=rf"^rendezvous at 127.0.0.1:{port}: rank 1 of 2: something listens "
                                             r"there but does not answer as the job's store \(RANK/WORLD_SIZE"):
            dist.rendezvous(Job(1, 2, launcher="torchrun"), 2)
        assert time.monotonic() - start < 2 + 60  # the timeout, not forever (torch's client waits without limit)


def test_a_process_a_rank_started_is_no_rank_of_that_job():
    ours = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234",
            "MULTICARD_LAUNCHER": "multicard"}
    assert job_from_env({**ours, lifeline.LAUNCHER_PID: str(os.getppid())}) == Job(0, 2, 0, 2, "multicard")
    assert job_from_env({**ours, lifeline.LAUNCHER_PID: str(os.getpid())}) == Job()  # our parent did not start the job


@pytest.mark.slow
def test_multicard_train_inside_a_script_under_multicard_run_runs_on_its_own(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import subprocess, sys\nimport multicard\nmc = multicard.Multicard(timeout=300)\nmc.barrier()\n"
        "if mc.rank == 0:\n"
        "    subprocess.run([sys.executable, '-m', 'multicard', 'train', '--data', 'synthetic', '--synthetic-samples',"
        " '64', '--epochs', '1', '--quiet', '--timeout', '5', '--out', sys.argv[1]], check=True, timeout=60)\n"
        "mc.barrier()\n")
    out = run_cli("run", "--devices", "cpu:2", str(script), str(tmp_path / "out"), env=clean_env(), timeout=HUNG_S)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / "model.pt").is_file()


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
    monkeypatch.setattr(outcome, "KILLED_S", 0.2)
    for name in ("kill", "killpg"):  # the signals for a process that is not there
        monkeypatch.setattr(os, name, lambda pid, sig: None)
    start = time.monotonic()
    outcome.stop([FrozenCommand() if stop == "run" else Frozen()], grace_s=0.2)
    assert time.monotonic() - start < 60  # its 0.2 s graces, not forever (a busy machine may take seconds)
    assert "multicard: rank 0 (pid 999999) did not end on SIGKILL" in capsys.readouterr().err


def test_a_gz_whose_header_claims_more_than_memory_is_refused_before_reading(tmp_path, monkeypatch):
    path = tmp_path / "train-images-idx3-ubyte.gz"
    images = np.zeros((1000, 28, 28), np.uint8)
    path.write_bytes(gzip.compress((2051).to_bytes(4, "big") + b"".join(n.to_bytes(4, "big") for n in images.shape)
                                   + images.tobytes()))
    monkeypatch.setattr(idx, "available_memory", lambda: 1 << 20)
    read = []
    monkeypatch.setattr(np, "empty", lambda *a, **k: read.append(a) or np.zeros(*a, **k))
    with pytest.raises(UsageError, match=r"its header \(1000, 28, 28\) needs 0.00 GiB of memory once read, more than "
                                         r"the 0.00 GiB available"):
        idx.read_idx(path, idx.IMAGES_MAGIC)
    assert read == []  # refused before anything was allocated
    monkeypatch.setattr(idx, "available_memory", lambda: 1 << 30)
    assert idx.read_idx(path, idx.IMAGES_MAGIC).shape == (1000, 28, 28)


# -- a file multicard did not make ----------------------------------------------------------------------------
def test_a_progress_variable_naming_a_users_file_writes_nothing_into_it(tmp_path, monkeypatch, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious data, 32 bytes of it!!\n")
    monkeypatch.setenv(progress.PROGRESS, str(victim))
    monkeypatch.setattr(progress, "_slot", None)
    progress.progress()
    progress.failed(RuntimeError("Timed out waiting 5000ms"))
    assert victim.read_bytes() == b"precious data, 32 bytes of it!!\n"
    assert capsys.readouterr().err.splitlines() == [
        f"multicard: {progress.PROGRESS}={victim} is not a progress file a multicard launcher made; ignored"]


# -- orphans ---------------------------------------------------------------------------------------------------------
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
    monkeypatch.setattr(lifeline, "_parent", os.getppid())
    lifeline.end_if_orphaned(0)
    assert killed == []  # its launcher is there
    monkeypatch.setattr(lifeline, "_parent", os.getppid() + 1)  # as after the launcher died: another parent
    lifeline.end_if_orphaned(3)
    assert killed == [(os.getpid(), 9)]
    err = capsys.readouterr().err
    assert f"multicard: rank 3: its launcher (pid {os.getppid() + 1}) is gone; this rank ends" in err


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and fields[1] == str(pid):
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


# -- one line, not a traceback ---------------------------------------------------------------------------------
@pytest.mark.parametrize("env, words", [
    ({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "abc"}, "TORCHELASTIC_RESTART_COUNT='abc'"),
])
def test_a_bad_job_variable_is_one_line(env, words):
    with pytest.raises(UsageError, match=f"^{words}"):
        job_from_env(env)


def test_an_unreadable_slurm_node_list_is_one_line():
    with pytest.raises(UsageError, match=r"^SLURM_JOB_NODELIST='\[' in the environment: cannot read a host"):
        rendezvous_env({"SLURM_JOB_NODELIST": "[", "SLURM_JOB_ID": "1"})


@pytest.mark.parametrize("seconds", [1e14, 1e-6, 0.5, float("nan")])
def test_a_timeout_out_of_range_is_one_line(seconds):
    with pytest.raises(UsageError, match=r"^--timeout .*: must be from 1 to 1e\+06 seconds"):
        dist.check_timeout(seconds)
    dist.check_timeout(1)
    dist.check_timeout(1e6)


@pytest.mark.parametrize("spec", [":Net", "x.py:", "multicard.models:"])
def test_a_model_spec_without_its_module_or_class_is_one_line(spec):
    with pytest.raises(UsageError, match=f"^--model {spec}: name both the file"):
        models.build(spec)


@pytest.mark.parametrize("top", ["import sys\nsys.exit(0)\n",
                                 "import argparse\nargparse.ArgumentParser().parse_args()\n"])
def test_a_model_module_that_ends_the_program_at_import_is_one_line(tmp_path, monkeypatch, top):
    module = tmp_path / "ends_here.py"
    module.write_text(top + "import torch\n\n\ndef Net():\n    return torch.nn.Linear(2, 2)\n")
    monkeypatch.setattr(sys, "argv", ["multicard", "train", "--model", f"{module}:Net"])
    monkeypatch.syspath_prepend(str(tmp_path))
    if top.startswith("import argparse"):  # it sees no flags of ours: the model is built
        assert isinstance(models.build(f"{module}:Net"), torch.nn.Linear)
    else:
        with pytest.raises(UsageError, match=r"ends_here.py ended the program \(exit 0\); run its script part only"):
            models.build(f"{module}:Net")
    assert sys.argv == ["multicard", "train", "--model", f"{module}:Net"]
    sys.modules.pop("ends_here", None)


# -- the first failure, truly ----------------------------------------------------------------------------------
def test_a_rank_that_only_lost_another_is_not_named_first(tmp_path):
    folder = str(tmp_path)
    for rank in range(3):
        progress.new_slot(outcome.slot_path(folder, rank))
    with open(outcome.slot_path(folder, 0), "r+b") as f:
        f.write(progress.SLOT.pack(progress.MARK, 1.0, 5.0, progress.LOST_PEER))
    codes = {0: 1, 1: 3, 2: 0}
    order = [[0], [], [1], [2]]  # rank 0 is seen to end first (its gloo error), rank 1 (the cause) a moment later
    ended = lambda running, timeout: order.pop(0) if order else []  # noqa: E731
    assert outcome.first_to_fail(3, ended, codes.get, folder) == 1
    order[:] = [[0], [2]]  # no other failure within the grace: rank 0 is all there is to name
    assert outcome.first_to_fail(3, lambda running, timeout: order.pop(0) if order else [], codes.get, folder) == 0


SCRIPT = "import sys\nimport multicard\nmc = multicard.Multicard(timeout=20)\n"


def multicard_run(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT + body)
    return run_cli("run", "--devices", "cpu:2", str(script), env=clean_env(), timeout=HUNG_S)


@pytest.mark.slow
def test_under_multicard_run_the_rank_that_failed_is_named_with_its_code(tmp_path):
    out = multicard_run(tmp_path, "mc.barrier()\nif mc.rank == 1:\n    sys.exit(3)\nmc.all_reduce(1.0)\n")
    assert out.returncode == 3
    lines = out.stderr.splitlines()
    assert lines[-1] == "multicard: rank 1 failed with exit code 3 (its output is above); the other ranks were stopped"
    assert "Traceback" not in out.stderr  # rank 0's lost connection is one line, not gloo's traceback
    assert lines[0].startswith("multicard: running ")  # the job's start line
    assert lines[1:-1] == []  # rank 0 only lost rank 1: the launcher names rank 1 alone


@pytest.mark.slow
def test_under_multicard_run_a_bad_input_on_one_rank_is_the_one_line(tmp_path):
    out = multicard_run(tmp_path, "from multicard.errors import UsageError\nmc.barrier()\nif mc.rank == 1:\n"
                                  "    raise UsageError('rank 1 alone saw a bad input')\nmc.all_reduce(1.0)\n")
    started, *said = out.stderr.splitlines()  # rank 0, which lost rank 1, adds no line of its own
    assert out.returncode == 2 and said == ["multicard: error: rank 1 alone saw a bad input"], out.stderr


def test_under_multicard_run_a_bad_input_is_said_once(tmp_path):
    out = multicard_run(tmp_path, "mc.local_batch(7)\n")
    assert out.returncode == 2
    started, *said = out.stderr.splitlines()  # the job's start line, then the bad input once (not once per rank)
    assert started.startswith("multicard: running ") and said == [
        "multicard: error: batch size 7 does not split over 2 processes; use a multiple of 2 (e.g. 6 or 8)"]


def test_only_a_rank_stopped_on_purpose_is_meant(tmp_path):
    import pickle

    folder = str(tmp_path)
    for rank in range(2):
        progress.new_slot(outcome.slot_path(folder, rank))
    with open(os.path.join(folder, "error-1"), "wb") as f:
        pickle.dump(("said", "rank 1 was interrupted (SIGINT)"), f)
    meant = launcher._failure(1, [], folder)
    assert meant.meant and pickle.loads(pickle.dumps(meant)).meant
    with open(outcome.slot_path(folder, 0), "r+b") as f:  # rank 0 timed out waiting: for a frozen rank 1
        f.write(progress.SLOT.pack(progress.MARK, 1.0, 5.0, progress.TIMED_OUT_STATE))
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


def test_ctrl_c_while_the_command_line_is_read_is_one_line():
    code = ("from multicard import cli\n"
            "def parser():\n    raise KeyboardInterrupt\n"
            "cli.parser = parser\ncli.entry()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HUNG_S, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    assert (out.returncode, out.stderr) == (130, "multicard: interrupted\n")


def test_ranks_that_each_timed_out_waiting_for_the_other_called_different_collectives(tmp_path, monkeypatch):
    monkeypatch.setattr(outcome, "MISMATCH_S", 0.2)
    folder = str(tmp_path)
    now = time.monotonic()
    for rank in range(3):
        progress.new_slot(outcome.slot_path(folder, rank))

    def show(rank: int, last: float, state: float) -> None:
        with open(outcome.slot_path(folder, rank), "r+b") as f:
            f.write(progress.SLOT.pack(progress.MARK, last, 5.0, state))

    show(0, now - 6, progress.TIMED_OUT_STATE)
    show(1, now - 6, progress.TIMED_OUT_STATE)
    show(2, now - 5, progress.TIMED_OUT_STATE)
    assert outcome.blame(0, {}, folder, 3) == (0, "rank 0 timed out waiting for ranks 1 and 2 after 5 s, and ranks 1 "
                                                   "and 2 for it: the ranks called different collectives (or the "
                                                   "same ones in another order)")
    show(2, now - 9, 0.0)  # rank 2 did not wait: it stopped making progress
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        rank, why = outcome.blame(0, {2: sleeper.pid}, folder, 3)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert rank == 2 and why.startswith("rank 2 stopped making progress (no progress from it for 9 s")


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

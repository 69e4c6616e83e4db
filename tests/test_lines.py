"""Issue 33's tracebacks where a line was due, and its smaller items: a return value that cannot come back, Ctrl-C
while the ranks import torch, an optimizer fsdp cannot step, a launch without the `__main__` guard, an integer flag
past 64 bits, a long line relayed to a notebook, a thread fn leaves running, the folders of SIGKILLed launchers; and
issue 47's full disk and file-size limit where launch writes fn's arguments or rank 0 its return value.
Each job runs in a child process with a time limit, so a regression fails instead of hanging the suite."""

from __future__ import annotations

import builtins
import errno
import gzip
import io
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zipfile

import pytest
import torch
from torch import nn

import multicard
from conftest import HUNG_S, clean_env, ended, gone, left, run_cli, started
from multicard.errors import UsageError
from multicard.jobs import jobdir, progress, shipping, spawned, streams
from multicard.trainer.config import TrainConfig
from test_faults import PLAIN_OR_LAUNCHED, dispositions

CATCH = """
import sys
from multicard.errors import UsageError
from multicard.jobs.failures import Stopped
try:
    main()
except (UsageError, Stopped) as e:  # the line the launcher says, as a user's script would print it
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(2)
"""


def script(tmp_path, body: str, guarded: bool = True) -> list[str]:
    """A script file of `body` (defining main()) whose launch error or stop is printed as one line."""
    path = tmp_path / "job.py"
    catch = textwrap.indent(CATCH, "    ") if guarded else CATCH
    path.write_text(textwrap.dedent(body) + ('\nif __name__ == "__main__":' if guarded else "") + catch)
    return [sys.executable, str(path)]


def run(command: list[str], tmp_path, timeout: float = HUNG_S, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env={**clean_env(), "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}, **kw)


# -- a return value that cannot come back -------------------------------------------------------------------------
@pytest.mark.slow
def test_a_return_value_that_cannot_be_pickled_is_one_line_naming_it_and_the_work_is_kept(tmp_path):
    done = run(script(tmp_path, """
        import threading, multicard
        def job(mc):
            open(f"done-{mc.rank}", "w").close()
            return {"weights": [1.0, 2.0], "lock": threading.Lock()}
        def main():
            multicard.launch(job, devices="cpu:2")
    """), tmp_path)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "UsageError: fn's return value on rank 0 cannot come back from its process: its ['lock'] (a lock) cannot be "
        "pickled (cannot pickle '_thread.lock' object); return what it is made of instead (numbers, tensors, a "
        "state_dict); what fn did (its files) is kept"], done.stderr
    assert (tmp_path / "done-0").exists() and (tmp_path / "done-1").exists()


class Holder:
    def __init__(self):
        self.steps = [1, (i for i in range(3))]


def test_what_cannot_come_back_is_found_where_it_lies():
    assert shipping.unsendable({"a": 1, "b": [2.0, torch.ones(2)]}) is None
    where, part, _ = shipping.unsendable({"fine": 1, "model": Holder()})
    assert where == "['model'].steps[1]" and part.__class__.__name__ == "generator"
    looped = {"self": None, "gen": (i for i in range(2))}
    looped["self"] = looped
    assert shipping.unsendable(looped)[0] == "['gen']"
    assert "it (a generator) cannot be pickled" in shipping.return_refused(looped["gen"], TypeError("x"))


# -- Ctrl-C while the ranks import torch --------------------------------------------------------------------------
def ranks_of(pid: int) -> list[int]:
    """The processes multiprocessing's spawn started under `pid` (not its resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and spawned:
            found.append(int(entry))
    return found


def importing_torch(pid: int) -> bool:
    """Whether process `pid` has loaded torch's library: its import has begun, and goes on a second or more."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("how", ["script", pytest.param("stdin", marks=pytest.mark.slow)])
def test_ctrl_c_while_the_ranks_import_torch_is_one_line(tmp_path, how):
    """A script file: each rank imports torch as it runs the script's top level again; `python -`: as it unpickles
    fn. A Ctrl-C (SIGINT to the whole process group, as a terminal sends it) in those first seconds."""
    body = """
        import time
        import torch  # slow: a second or more, in every rank too
        import multicard
        def job(mc):
            time.sleep(60)
        def main():
            multicard.launch(job, devices="cpu:2")
    """
    command = script(tmp_path, body)
    if how == "stdin":
        command = [sys.executable, "-"]
    launcher = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=tmp_path, env={**clean_env(), "PYTHONUNBUFFERED": "1"},
                                start_new_session=True, preexec_fn=lambda: dispositions(False))  # hears Ctrl-C
    if how == "stdin":
        launcher.stdin.write((tmp_path / "job.py").read_text())
    launcher.stdin.close()
    deadline = time.monotonic() + 60
    while not any(map(importing_torch, ranks_of(launcher.pid))) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(launcher.pid, signal.SIGINT)
    try:
        err = launcher.stderr.read()
        assert launcher.wait(HUNG_S) == 2
    finally:
        launcher.kill()
    assert err.splitlines() == ["Stopped: SIGINT"], err


# -- an optimizer fsdp cannot step --------------------------------------------------------------------------------
def test_lbfgs_under_fsdp_is_refused_at_setup_and_at_its_first_step_in_one_line():
    with multicard.Multicard("fsdp", "cpu") as mc:
        model = mc.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        optimizer = torch.optim.LBFGS(model.parameters())
        with pytest.raises(UsageError, match=r"^fsdp cannot step LBFGS: it flattens every parameter into one vector"):
            mc.setup_optimizers(optimizer)

        def closure():
            optimizer.zero_grad()
            loss = model(torch.ones(2, 4)).sum()
            mc.backward(loss)
            return loss

        with pytest.raises(UsageError, match=r"^fsdp cannot step LBFGS: .*; use ddp \(it steps any torch optimizer\)"):
            optimizer.step(closure)  # never set up: refused as it steps, not with torch's DTensor error
        sgd = mc.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        closure()
        sgd.step()
    plain = nn.Linear(2, 1)  # an LBFGS over plain tensors in the same process steps as ever
    lbfgs = torch.optim.LBFGS(plain.parameters())
    lbfgs.step(lambda: plain(torch.ones(1, 2)).sum())


# -- a launch without the __main__ guard --------------------------------------------------------------------------
@pytest.mark.slow  # the same line through train (which launches): the test below, in the default suite
def test_a_launch_at_the_top_level_of_a_script_is_one_line_saying_what_to_add(tmp_path):
    done = run(script(tmp_path, """
        import multicard
        def job(mc):
            return mc.rank
        def main():
            print(multicard.launch(job, devices="cpu:2"))
    """, guarded=False), tmp_path)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "UsageError: job.py calls multicard.launch (or train) at its top level, which every process it starts runs "
        "again: put that call under `if __name__ == \"__main__\":`"], done.stderr


UNGUARDED = """
    import sys, torch, multicard
    from torch import nn
    from torch.utils.data import TensorDataset
    data = TensorDataset(torch.randn(8192, 16), torch.randint(0, 2, (8192,)))  # pickled, far more than a pipe holds
    try:
        multicard.train(nn.Linear(16, 2), data, None, out="out", devices="cpu:2", strategy="ddp", epochs=1,
                        batch_size=64, quiet=True)
    except multicard.UsageError as e:
        print(f"UsageError: {e}", file=sys.stderr)
        sys.exit(2)
"""


@pytest.mark.usefixtures("nothing_left")
def test_train_at_the_top_level_of_a_script_is_one_line_saying_what_to_add_not_a_hang(tmp_path):
    """Each rank runs the script's top level again and met train there: it ends at once, the launcher says why, and
    --out is as it was (no false "another run is writing there", no hang writing to a rank that is gone)."""
    job = started(tmp_path, UNGUARDED)
    code, _, err = ended(job, 120)
    assert code == 2 and err.splitlines() == [
        "UsageError: job.py calls multicard.launch (or train) at its top level, which every process it starts runs "
        "again: put that call under `if __name__ == \"__main__\":`"], err
    assert list((tmp_path / "out").iterdir()) == []
    assert gone(lambda: left(tmp_path), 10)


# -- integer flags past 64 bits -----------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [("train", "--seed"), ("train", "--eval-batch-size"), ("check", "--seed"),
                                     ("bench", "--seed"), ("bench", "--samples")])
def test_an_integer_flag_past_64_bits_is_one_line(command):
    big = "1" + "0" * 23
    done = run_cli(*command, big)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"multicard {command[0]}: {command[1]} {big}: out of range (from -9223372036854775808 to "
        f"9223372036854775807) (see multicard {command[0]} --help)"], done.stderr


def test_a_seed_past_64_bits_is_refused_by_the_library_too():
    with pytest.raises(UsageError, match=r"^--seed -100000000000000000000000: out of range"):
        TrainConfig(seed=-10**23).validate()
    TrainConfig(seed=2**63 - 1).validate()


# -- the relay of a rank's output to a notebook -------------------------------------------------------------------
def test_a_long_line_without_a_newline_is_relayed_in_linear_time():
    """16 MB in one line: a relay that looks through the whole line again with each 64 KB took 52 s (and the rank
    writing it waited on the full pipe meanwhile), 1,000 times what the same bytes take through a plain pipe; the
    bound here is 50 times that reference, run in this test (a busy machine slows both alike)."""
    line = b"x" * (16 << 20)

    def piped(read) -> float:
        reader, writer = os.pipe()

        def write() -> None:
            with open(writer, "wb") as f:
                f.write(line + b"\rend\n")

        threading.Thread(target=write, daemon=True).start()
        began = time.monotonic()
        read(open(reader, "rb", buffering=0))
        return time.monotonic() - began

    def plainly(reader) -> None:  # the reference: the same pipe, read and decoded with nothing looked for
        with reader:
            "".join(iter(lambda: os.read(reader.fileno(), 1 << 16).decode(), ""))

    relay, out = streams.Relay.__new__(streams.Relay), io.StringIO()
    relay.lock = threading.Lock()
    reference = piped(plainly)
    assert piped(lambda reader: relay._pump(reader, out)) < 50 * reference + 0.5
    assert out.getvalue() == line.decode() + "\rend\n"


# -- a thread fn leaves running -----------------------------------------------------------------------------------
THREADS = """
    import sys, threading, time, multicard
    from concurrent.futures import ThreadPoolExecutor
    from multicard.jobs.failures import RankFailed
    def job(mc, fail):
        if mc.rank == 1:
            threading.Thread(target=time.sleep, args=(600,), name="uploader").start()
            print("rank 1 printed this")  # a pipe buffers it: it must not be lost when the rank ends without the thread
            if fail:
                raise ValueError("after the thread started")
        ThreadPoolExecutor(2).submit(print, end="")  # idle, not shut down: it ends with its process, as ever
        return mc.rank + 41
    def main():
        if sys.argv[1] == "fail":
            try:
                multicard.launch(job, True, devices="cpu:2", timeout=900)
            except RankFailed as e:
                print(f"rank {e.rank} failed", file=sys.stderr)
        else:
            print(multicard.launch(job, False, devices="cpu:2", timeout=2))
"""


@pytest.mark.slow
def test_a_thread_fn_leaves_running_is_named_once_the_timeout_passed_and_the_launch_returns(tmp_path):
    done = run([*script(tmp_path, THREADS), "return"], tmp_path, env={"PYTHONUNBUFFERED": ""})  # stdout buffered
    assert done.returncode == 0 and done.stdout == "rank 1 printed this\n41\n", done.stderr
    assert done.stderr.splitlines() == [
        "multicard: rank 1: fn returned, but its thread 'uploader' still ran 2 s later (the job's timeout); this rank "
        "ended without it: join threads before fn returns, or start them with daemon=True"], done.stderr


@pytest.mark.slow
def test_a_rank_that_fails_with_a_thread_left_running_is_told_at_once(tmp_path):
    done = run([*script(tmp_path, THREADS), "fail"], tmp_path, timeout=450)  # well within the job's 900 s
    assert done.returncode == 0 and done.stderr.splitlines()[-1] == "rank 1 failed", done.stderr


# -- how a rank ends ------------------------------------------------------------------------------------------------
_HELD: list = []  # a file a rank leaves open in a module's global: only the end of its process can flush it


def _busy_in_torch() -> None:
    a = torch.randn(256, 256)
    while True:  # mostly inside torch's C++ code, the GIL let go
        a = torch.mm(a, a).clamp(-1, 1)


def leaves_torch_busy(mc, path: str) -> int:
    threading.Thread(target=_busy_in_torch, daemon=True).start()
    _HELD.append(open(f"{path}.{mc.rank}", "w"))
    _HELD[0].write(f"rank {mc.rank} wrote this\n")
    time.sleep(0.2)
    return mc.rank + 41


def test_a_rank_ends_cleanly_with_a_daemon_thread_in_torch_and_a_file_left_open(tmp_path):
    """The interpreter's own teardown aborted a rank whose daemon thread was in torch's C++ code (SIGABRT,
    "terminate called without an active exception": the thread takes the GIL back as the interpreter goes), as
    it rarely did when a gloo worker freed a finished collective's tensors; a rank now ends as a forked child
    does, and flushes the files still open first, as that teardown would have."""
    assert multicard.launch(leaves_torch_busy, str(tmp_path / "held"), devices="cpu:2") == 41
    assert [(tmp_path / f"held.{rank}").read_text() for rank in (0, 1)] == [f"rank {r} wrote this\n" for r in (0, 1)]


LEFT_OPEN = """
import gzip, os, sys, tempfile, zipfile
import multicard

KEPT = {}  # a script's module globals, left open when the work returns


def job(mc, where):
    rank = mc.rank if mc is not None else 0
    log = gzip.open(os.path.join(where, f"log-{rank}.gz"), "wt")
    log.write("a line of a log\\n" * 2000)
    archive = zipfile.ZipFile(os.path.join(where, f"outputs-{rank}.zip"), "w")
    archive.writestr("result.txt", "42\\n" * 2000)
    scratch = tempfile.NamedTemporaryFile(dir=where, prefix=f"scratch-{rank}-")
    scratch.write(b"scratch")
    KEPT.update(log=log, archive=archive, scratch=scratch)
""" + PLAIN_OR_LAUNCHED


@pytest.mark.parametrize("how", ["plain", "launch"])
def test_what_a_script_leaves_open_is_finished_as_its_plain_run_finishes_it(tmp_path, how):
    """A gzip log, a zip archive and a NamedTemporaryFile kept in a module global: plain python's teardown writes
    both archives whole and removes the temporary; each rank of a launch ends the same (it skips the
    interpreter's teardown, and finishes them itself)."""
    (tmp_path / "left_open.py").write_text(LEFT_OPEN)
    (tmp_path / "out").mkdir()
    done = run([sys.executable, "left_open.py", str(tmp_path / "out"), how], tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    ranks = (0,) if how == "plain" else (0, 1)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        name for r in ranks for name in (f"log-{r}.gz", f"outputs-{r}.zip"))  # no scratch file left
    for r in ranks:
        assert gzip.open(tmp_path / "out" / f"log-{r}.gz", "rt").read() == "a line of a log\n" * 2000
        assert zipfile.ZipFile(tmp_path / "out" / f"outputs-{r}.zip").read("result.txt") == b"42\n" * 2000


# -- the folders of SIGKILLed launchers ---------------------------------------------------------------------------
def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_only_a_dead_launchers_own_folders_are_cleaned(tmp_path):
    import fcntl

    root, victim, dead = tmp_path / "tmp", tmp_path / "victim", dead_pid()
    (victim / "kept").mkdir(parents=True)
    stale = root / f"multicard-job-{dead}-abc"
    (stale / "inner").mkdir(parents=True)
    (stale / "inner" / "link").symlink_to(victim)  # removed as a link, never followed
    alive = root / f"multicard-job-{os.getpid()}-abc"  # its launcher runs (this process)
    locked = root / f"multicard-job-{dead}-locked"  # its pid is gone, but someone holds its lock
    older = root / "multicard-job-abcd1234"  # an earlier version's: whose it was cannot be told
    for folder in (alive, locked, older):
        folder.mkdir()
    (root / f"multicard-job-{dead}-link").symlink_to(victim)
    (root / f"multicard-job-{dead}-file").write_text("")
    held = os.open(locked, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert jobdir.clean_stale(str(root)) == [str(stale)]
    finally:
        os.close(held)
    assert (victim / "kept").is_dir()
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [alive.name, locked.name, older.name, f"multicard-job-{dead}-link", f"multicard-job-{dead}-file"])


@pytest.mark.slow
def test_a_sigkilled_launchers_folder_is_removed_at_the_next_start(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    command = script(tmp_path, """
        import sys, time, multicard
        def job(mc, wait):
            time.sleep(wait)
        def main():
            multicard.launch(job, float(sys.argv[1]), devices="cpu:2")
    """)
    killed = subprocess.Popen([*command, "60"], cwd=tmp_path, env={**clean_env(), "TMPDIR": str(tmp)},
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(ranks_of(killed.pid)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    assert len(list(tmp.glob("multicard-job-*"))) == 1
    done = run([*command, "0"], tmp_path, env={"TMPDIR": str(tmp)})
    assert done.returncode == 0, done.stderr
    assert list(tmp.glob("multicard-job-*")) == []


# -- a full disk, the file-size limit -----------------------------------------------------------------------------
BIG = """
    import sys, multicard
    def takes(mc, big):
        return len(big)
    def gives(mc):
        return b"x" * 8_000_000
    def main():
        if sys.argv[1] == "argument":
            multicard.launch(takes, b"x" * 8_000_000, strategy="ddp", devices="cpu:2")
        else:
            multicard.launch(gives, strategy="ddp", devices="cpu:2")
"""
FSIZE = 4_000_000
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
NO_ROOM = "free space there, or set TMPDIR to a folder with room"
PAST_LIMIT = "File too large (the file-size limit, ulimit -f, is 4.0 MB); raise the limit (ulimit -f)"
ARGUMENT = ("UsageError: cannot start the job: fn and its arguments (8.0 MB pickled) could not be written into the "
            "job's folder in {tmp}: {why}, or pass less (large data: pass its path, and load it inside fn)")
RETURNED = ("UsageError: the job ran, but fn's return value on rank 0 could not be handed back: it (8.0 MB pickled) "
            "could not be written into the job's folder in {tmp}: {why}, or return less (save a large result to a "
            "file in fn, and return its path); what fn did (its files) is kept")


def file_size_limit() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE, FSIZE))


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB file system of its own (tmpfs), for TMPDIR; skipped where this test run cannot mount one (not root,
    a container that refuses mounts): there a write meeting ENOSPC is played below instead."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = shutil.which("mount")
    if os.geteuid() != 0 or not mount or subprocess.run([mount, "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                                                        capture_output=True).returncode:
        pytest.skip("no tmpfs can be mounted here")
    yield disk
    subprocess.run([shutil.which("umount") or "umount", "-l", str(disk)], capture_output=True)


@pytest.mark.parametrize("what", ["argument", "return value"])
@pytest.mark.parametrize("how", ["file-size limit", "full disk"])
def test_an_argument_or_a_return_value_that_cannot_be_written_is_one_line_and_nothing_is_left(tmp_path, how, what,
                                                                                               request):
    """An 8 MB argument (the launcher writes it into the job's folder), or fn's 8 MB return value (rank 0 writes it
    there), past a 4 MB file-size limit (ulimit -f) or on a 2 MB TMPDIR: one line, no traceback from any process,
    no rank left running, no job folder left."""
    if how == "full disk":
        tmp, why, limit = request.getfixturevalue("small_disk"), f"No space left on device; {NO_ROOM}", None
    else:
        tmp, why, limit = tmp_path / "tmp", PAST_LIMIT, file_size_limit
        tmp.mkdir()
    done = run([*script(tmp_path, BIG), what], tmp_path, env={"TMPDIR": str(tmp)}, preexec_fn=limit)
    line = (ARGUMENT if what == "argument" else RETURNED).format(tmp=tmp, why=why)
    assert done.returncode == 2 and done.stderr.splitlines() == [line], done.stderr
    assert list(tmp.iterdir()) == [] and left(tmp) == []


def full_at(name: str, written: int = 1000):
    """open() for a module whose writes of file `name` meet a full disk once `written` bytes are in (as a write
    that fills the disk leaves them)."""
    def opened(path, mode="r", *args, **kwargs):
        if os.path.basename(path) != name:
            return builtins.open(path, mode, *args, **kwargs)
        with builtins.open(path, mode) as f:
            f.write(b"x" * written)
        raise ENOSPC
    return opened


def test_a_full_disk_where_launch_writes_fn_and_its_arguments_is_one_line_and_no_folder_is_left(tmp_path,
                                                                                                monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(jobdir, "open", full_at(spawned.WORK), raising=False)
    with pytest.raises(UsageError) as refused:
        multicard.launch(len, b"x" * 8_000_000, strategy="ddp", devices="cpu:2")
    assert f"UsageError: {refused.value}" == ARGUMENT.format(tmp=tmp_path, why=f"No space left on device; {NO_ROOM}")
    assert list(tmp_path.iterdir()) == []


def test_a_return_value_a_full_disk_refuses_is_one_line_and_its_part_is_removed_for_the_ranks_word(tmp_path,
                                                                                                   monkeypatch):
    folder = tmp_path / "multicard-job-1-x"
    folder.mkdir()
    monkeypatch.setattr(jobdir, "open", full_at("result"), raising=False)
    with pytest.raises(UsageError) as refused:
        spawned._send(b"x" * 8_000_000, str(folder))
    assert f"UsageError: {refused.value}" == RETURNED.format(tmp=tmp_path, why=f"No space left on device; {NO_ROOM}")
    assert list(folder.iterdir()) == []


def test_a_job_folder_a_full_disk_refuses_is_one_line(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise ENOSPC

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(tempfile, "mkdtemp", full)
    with pytest.raises(UsageError) as refused, jobdir.job_folder():
        pass
    assert str(refused.value) == f"cannot start the job: its folder could not be made in {tmp_path}: No space " \
                                 f"left on device; {NO_ROOM}"
    monkeypatch.setattr(progress, "open", full_at("progress-0", 0), raising=False)
    (tmp_path / "multicard-job-1-x").mkdir()
    with pytest.raises(UsageError) as refused:
        progress.new_slot(str(tmp_path / "multicard-job-1-x" / "progress-0"))
    assert str(refused.value) == f"cannot start the job: its ranks' progress files could not be written into the " \
                                 f"job's folder in {tmp_path}: No space left on device; {NO_ROOM}"


def test_a_rank_whose_failure_a_full_disk_keeps_from_the_launcher_says_it_itself(tmp_path, monkeypatch, capsys):
    (tmp_path / "multicard-job-1-x").mkdir()
    monkeypatch.setenv(progress.PROGRESS, str(tmp_path / "multicard-job-1-x" / "progress-1"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(progress, "open", full_at("error-1", 10), raising=False)
    progress.tell_launcher("usage", "--data nowhere: no such folder")
    assert capsys.readouterr().err == "multicard: rank 1: --data nowhere: no such folder\n"
    assert list((tmp_path / "multicard-job-1-x").iterdir()) == []

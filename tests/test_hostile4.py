"""What the third hostile round (issue 26) left: a .gz bomb under a container's memory limit, ranks of a user's
loop that part ways (one leaves, one reads more, one sleeps), a rendezvous that does not add up, and the processes a
user's script starts. Everything that runs ranks runs in a child process with a time limit, so a regression fails
instead of hanging the suite."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import zlib

import pytest

from conftest import HUNG_S, ROOT, run_cli
from multicard.data import headroom, idx
from multicard.errors import UsageError
from multicard.jobs import dist, launcher
from test_faults import clean_env


# -- memory ----------------------------------------------------------------------------------------------------
def gz_bomb(path, items: int = idx.MAX_ITEMS, zeros: int = 64 << 20) -> None:
    """A few hundred KB that claim `items` images and expand to `zeros` bytes of zeros (and would go on)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    with open(path, "wb") as f:
        f.write(z.compress((2051).to_bytes(4, "big") + b"".join(n.to_bytes(4, "big") for n in (items, 28, 28))))
        for _ in range(zeros >> 20):
            f.write(z.compress(bytes(1 << 20)))
        f.write(z.flush())


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_gz_bomb_under_a_containers_memory_limit_is_one_line_before_reading(tmp_path, monkeypatch, version):
    """The machine has room for the header's 15 GB, the process's control group (a container, systemd-run -p
    MemoryMax=4G) has not: refused from the group's limit, not read into the out-of-memory killer."""
    path = tmp_path / "train-images-idx3-ubyte.gz"
    gz_bomb(path)
    cgroup, own = tmp_path / "cgroup", "system.slice/job.scope"
    sub, limit, used, line = (("", "memory.max", "memory.current", f"0::/{own}") if version == "v2" else
                              ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", f"4:memory:/{own}"))
    (cgroup / sub / own).mkdir(parents=True)
    (cgroup / sub / "system.slice" / limit).write_text(f"{4 << 30}\n")  # the limit is on a parent group
    (cgroup / sub / "system.slice" / used).write_text(f"{1 << 30}\n")
    (cgroup / sub / own / limit).write_text("max\n" if version == "v2" else f"{(1 << 63) - 4096}\n")
    (cgroup / sub / own / used).write_text(f"{1 << 29}\n")
    (tmp_path / "self").write_text(f"1:name=systemd:/\n{line}\n")
    monkeypatch.setattr(headroom, "CGROUP", cgroup)
    monkeypatch.setattr(headroom, "SELF", tmp_path / "self")
    monkeypatch.setattr(headroom, "machine", lambda: 64 << 30)
    assert headroom.available_memory() == 3 << 30
    with pytest.raises(UsageError, match=r"its header \(4000000, 28, 28\) needs 14.60 GiB of memory once read, "
                                         r"more than the 3.00 GiB available"):
        idx.read_idx(path, idx.IMAGES_MAGIC)


def test_a_gz_bomb_under_ulimit_v_is_one_line(tmp_path):
    """Under an address-space limit (ulimit -v) the header's need is weighed against what the limit leaves."""
    gz_bomb(tmp_path / "images.gz", items=1_000_000, zeros=8 << 20)
    code = textwrap.dedent("""
        import resource, sys
        from multicard.data import idx
        from multicard.errors import UsageError
        vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize:")).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
        try:
            idx.read_idx(sys.argv[1], idx.IMAGES_MAGIC)
        except UsageError as e:
            print(e)
    """)
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "images.gz")], capture_output=True, text=True,
                          timeout=HUNG_S, cwd=ROOT)
    assert re.fullmatch(r".*images.gz: its header \(1000000, 28, 28\) needs 3.65 GiB of memory once read, more than "
                        r"the [12]\.\d\d GiB available\n", done.stdout), done.stdout + done.stderr


# -- your loop: ranks that part ways -----------------------------------------------------------------------------
def run_job(tmp_path, body: str, timeout_s: float = 10) -> subprocess.CompletedProcess:
    """`multicard run --devices cpu:2` of a script made of `body`, its collectives waiting at most timeout_s."""
    script = tmp_path / "job.py"
    script.write_text("import sys, time\nimport torch\nimport multicard\n"
                      f"mc = multicard.Multicard(timeout={timeout_s})\n" + textwrap.dedent(body))
    return run_cli("run", "--devices", "cpu:2", str(script), env=clean_env(), timeout=HUNG_S)


def test_a_rank_that_leaves_inside_rank_zero_first_is_the_one_named(tmp_path):
    done = run_job(tmp_path, """
        with mc.rank_zero_first():
            if mc.rank == 0:
                sys.exit(0)  # rank 1 is left waiting at the barrier
    """)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith("multicard: rank 0 ended (exit code 0) while rank 1 still waited "
                                                   "for it in a collective"), done.stderr


@pytest.mark.slow
def test_an_iterable_dataset_serving_one_rank_more_batches_names_both_counts(tmp_path):
    done = run_job(tmp_path, """
        from torch.utils.data import DataLoader, IterableDataset

        class Stream(IterableDataset):
            def __iter__(self):
                for i in range(4 * (12 if mc.rank == 1 else 10)):
                    yield torch.full((3,), float(i))

        model = mc.setup(torch.nn.Linear(3, 1))
        for x in mc.setup_dataloader(DataLoader(Stream(), batch_size=4)):
            mc.backward(model(x).sum())
        print("total", mc.all_reduce(1.0))  # what a loop does after its pass: met by rank 1's gradients
    """)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "multicard: rank 1 read 11 batches, rank 0 read 10 and its loader ended there: a loader that every process "
        "reads whole (an IterableDataset, a batch sampler) must serve each process as many batches"), done.stderr


@pytest.mark.slow
def test_a_collective_timeout_the_user_catches_names_the_rank_that_stopped(tmp_path):
    done = run_job(tmp_path, """
        mc.barrier()
        if mc.rank == 1:
            time.sleep(60)
        try:
            mc.all_reduce(1.0)
        except RuntimeError:
            sys.exit(1)  # caught, and ended otherwise: no traceback reaches multicard
    """, timeout_s=3)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith("multicard: rank 1 stopped making progress"), done.stderr
    assert "rank 0 timed out waiting for it after 3 s" in done.stderr


# -- the rendezvous --------------------------------------------------------------------------------------------
JOIN = """
import sys
import multicard
from multicard.errors import UsageError
mc = multicard.Multicard(timeout=300)  # far above any start-up on a busy machine: "at once" is told from it
try:
    mc.barrier()
except UsageError as e:
    print(e)
    sys.exit(2)
print("joined")
"""


def rank(tmp_path, port: int, rank: int, world: int, **env: str) -> subprocess.Popen:
    """A process that joins the job at 127.0.0.1:port as RANK `rank` of WORLD_SIZE `world` (what a user's shell
    or a stale environment says), printing the one line it was refused with."""
    (tmp_path / "join.py").write_text(JOIN)
    return subprocess.Popen([sys.executable, str(tmp_path / "join.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=clean_env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=
                                                               "127.0.0.1", MASTER_PORT=str(port), **env))


@pytest.mark.slow
def test_ranks_told_different_world_sizes_are_one_line_each(tmp_path):
    port = launcher.free_port()
    zero, one = rank(tmp_path, port, 0, 2), rank(tmp_path, port, 1, 3)
    said = [p.communicate(timeout=HUNG_S) for p in (zero, one)]
    assert [p.returncode for p in (zero, one)] == [2, 2], said
    where = f"rendezvous at 127.0.0.1:{port}: "
    assert said[0] == (f"{where}rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2: every process of a job must be "
                       f"told the same; {dist._origin({'RANK': '0', 'WORLD_SIZE': '2'})}\n", "")
    assert said[1][0].startswith(f"{where}rank 0 has WORLD_SIZE=2 but rank 1 has WORLD_SIZE=3") and not said[1][1]


@pytest.mark.slow
def test_a_stale_rank_pointed_at_a_live_jobs_store_is_refused_at_once(tmp_path):
    """A shell that kept a job's RANK=1 and MASTER_PORT joins while that job runs: refused in one line at once
    (it waited out the timeout, then gloo's traceback), and the live job goes on untouched."""
    go = tmp_path / "go"
    (tmp_path / "live.py").write_text(textwrap.dedent(f"""
        import os, pathlib, time
        import multicard
        mc = multicard.Multicard(timeout=300)
        mc.barrier()
        if mc.rank == 0:
            pathlib.Path({str(tmp_path / "port")!r}).write_text(os.environ["MASTER_PORT"])
        while not os.path.exists({str(go)!r}):
            time.sleep(0.1)
        mc.barrier()
    """))
    live = subprocess.Popen([sys.executable, "-m", "multicard", "run", "--devices", "cpu:2", str(tmp_path / "live.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=clean_env())
    try:
        for _ in range(600):
            if (tmp_path / "port").exists() and (port := (tmp_path / "port").read_text()):
                break
            time.sleep(0.1)
        stale = rank(tmp_path, int(port), 1, 2)
        start = time.monotonic()
        out, err = stale.communicate(timeout=HUNG_S)
        assert time.monotonic() - start < 150  # half the timeout (300 s): refused at once, not after it
        assert (stale.returncode, err) == (2, "") and re.fullmatch(
            rf"rendezvous at 127.0.0.1:{port}: rank 1 of this job has joined already \(pid \d+ on .+\): this "
            r"process is a second rank 1; RANK/WORLD_SIZE.*\n", out), out
    finally:
        go.touch()
        live_out = live.communicate(timeout=HUNG_S)
    assert live.returncode == 0, live_out


@pytest.mark.slow
def test_a_master_addr_where_no_store_answers_shows_none_of_torchs_cpp_log():
    """Rank 1 told to meet at a loopback port where nothing listens (the tests send nothing off this machine):
    torch's client retries, each retry a C++ warning; the user sees one line, within the timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = textwrap.dedent("""
        import sys, time
        import torch.distributed
        from multicard.errors import UsageError
        from multicard.jobs import dist
        start = time.monotonic()  # torch imported: its seconds on a busy machine are not the rendezvous's
        try:
            dist.rendezvous(dist.Job(1, 2, launcher="torchrun"), 2)
        except UsageError as e:
            print(e)
        print(time.monotonic() - start, file=sys.stderr)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HUNG_S, cwd=ROOT,
                          env=clean_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    assert done.stdout.startswith(f"rendezvous at 127.0.0.1:{port}: rank 1 of 2 found no rank 0 there within 2 s")
    # the line is multicard's own wait for a listener (torch's client retries for twice the timeout, each retry a
    # C++ warning, and says other words): it waited the timeout out, and ends with it (timed inside the process,
    # whose start, importing torch, takes 10 s and more on a busy machine; the upper bound only catches a hang)
    assert done.stdout.count("\n") == 1 and 2 <= float(done.stderr) < 60, done.stderr


# -- what a rank starts itself ---------------------------------------------------------------------------------
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
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False

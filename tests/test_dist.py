"""Who am I in a job: read from our spawn, torchrun or SLURM variables, a bad one in one line (no processes started for
these); what our launcher and its ranks tell each other (jobs/protocol.py: the MULTICARD_ variables, the progress
slot); and the rendezvous: whatever listens at MASTER_PORT, ranks told different world sizes, a stale rank at a live
job's store, a MASTER_ADDR where no store answers: one line within the timeout, never a hang or torch's log."""

import http.server
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import HUNG_S, JOB_VARIABLES, ROOT, clean_env
from multicard import rules
from multicard.errors import UsageError
from multicard.jobs import dist, job_end, launcher, progress, protocol
from multicard.jobs.devices import Devices
from multicard.jobs.dist import Job, backend_for, first_host, job_from_env, rendezvous_env

SRC = Path(__file__).resolve().parents[1] / "src" / "multicard"


def test_no_launcher():
    assert job_from_env({}) == Job()


def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert job_from_env(env) == Job(5, 8, 1, 4, "torchrun")


def test_slurm_variables():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    assert job_from_env(env) == Job(3, 4, 1, 2, "slurm")


def test_slurm_batch_script_without_srun_is_not_a_job():
    assert not job_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).launched


def test_master_address_from_the_node_list():
    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("node3,node4") == "node3"
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "123"}
    assert rendezvous_env(env) == {"MASTER_ADDR": "n1", "MASTER_PORT": str(15000 + 123)}
    assert rendezvous_env({**env, "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == {}


def test_backend_follows_the_device():
    assert (backend_for(Devices("cuda", (0, 1))), backend_for(Devices("cpu", (0, 1)))) == ("nccl", "gloo")


def test_a_rank_failure_crosses_process_boundaries_intact():
    import pickle

    from multicard.jobs.failures import RankFailed

    again = pickle.loads(pickle.dumps(RankFailed(3, "Traceback ...\nValueError: x")))
    assert (again.rank, again.trace) == (3, "Traceback ...\nValueError: x")


def test_impossible_job_variables_are_one_line_each():
    job = {"RANK": "0", "WORLD_SIZE": "2"}
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
    for env, words in (({**job, "RANK": "5"}, "RANK=5 with WORLD_SIZE=2"), ({**job, "RANK": "-1"}, "RANK=-1"),
                       ({**job, "RANK": "x"}, "RANK='x'"), ({**job, "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
                       ({**job, "LOCAL_RANK": "one"}, "LOCAL_RANK='one'"),
                       ({**job, "LOCAL_WORLD_SIZE": ""}, "LOCAL_WORLD_SIZE=''"),
                       ({**job, "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2"),
                       ({**job, "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
                       ({**job, "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
                       ({**slurm, "SLURM_PROCID": "2"}, "SLURM_PROCID=2 with SLURM_NTASKS=2"),
                       ({**slurm, "SLURM_NTASKS": "2x"}, "SLURM_NTASKS='2x'"),
                       ({**slurm, "SLURM_LOCALID": "?"}, "SLURM_LOCALID='?'")):
        with pytest.raises(UsageError, match=f"^{re.escape(words)}") as error:
            job_from_env(env)
        assert "\n" not in str(error.value)
    with pytest.raises(UsageError, match="^SLURM_JOB_ID='x'"):
        rendezvous_env({"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "x"})


def test_the_protocol_is_named_in_one_place():
    """Every MULTICARD_ variable is named in jobs/protocol.py; one other module at most spells one (the all_reduce
    docstring a user reads in help())."""
    spelled = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "MULTICARD_" in p.read_text()}
    assert "jobs/protocol.py" in spelled and len(spelled) <= 2, spelled


def test_a_rank_reads_what_our_launcher_hands_it(tmp_path):
    env = launcher.job_env(1, 2, 1234, str(tmp_path))
    assert {k: v for k, v in env.items() if k.startswith("MULTICARD_")} == {
        "MULTICARD_LAUNCHER": "multicard", "MULTICARD_LAUNCHER_PID": str(os.getpid()),
        "MULTICARD_PROGRESS": job_end.slot_path(str(tmp_path), 1)}
    handed = protocol.from_env(env)
    assert handed.ours and protocol.to_env(handed) == {k: v for k, v in env.items() if k.startswith("MULTICARD_")}
    assert protocol.from_env({}) == protocol.Handed() and not protocol.Handed().ours
    assert protocol.to_env(protocol.Handed()) == {}
    chosen = protocol.Handed(strategy="ddp", devices="cpu:2")
    assert protocol.to_env(chosen) == {"MULTICARD_STRATEGY": "ddp", "MULTICARD_DEVICES": "cpu:2"}
    assert protocol.from_env(protocol.to_env(chosen)) == chosen
    # a rank is the launcher's child: the launcher's pid is its parent's; any other process inherited the variables
    assert job_from_env({**env, "MULTICARD_LAUNCHER_PID": str(os.getppid())}) == Job(1, 2, 1, 2, "multicard")
    assert job_from_env(env) == Job()


def test_the_progress_slot_round_trips_its_named_fields(tmp_path):
    path = job_end.slot_path(str(tmp_path), 0)
    progress.new_slot(path)
    assert protocol.read_slot(path).fields() == dict.fromkeys(protocol.FIELDS, 0.0)
    written = {"last": 12.5, "timeout": 30.0, "state": protocol.LOST_PEER, "batches": 7.0, "passes": 1.0}
    slot = protocol.mapped(path)  # as a rank writes it
    assert slot.mapped
    for name, value in written.items():
        setattr(slot, name, value)
    assert protocol.read_slot(path).fields() == written  # as the launcher reads it
    assert Path(path).read_bytes() == protocol.Slot(**written).packed()
    Path(path).write_bytes(protocol.Slot(**written).packed()[:protocol.SLOT.size])  # the loaders' counts cut off
    assert protocol.read_slot(path).fields() == {**written, "batches": 0.0, "passes": 0.0}
    assert protocol.mapped(path) is None  # not a whole slot: never written to
    assert protocol.read_slot(str(tmp_path / "none")).fields() == dict.fromkeys(protocol.FIELDS, 0.0)


def test_a_process_a_rank_started_is_no_rank_of_that_job():
    ours = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234",
            "MULTICARD_LAUNCHER": "multicard"}
    assert job_from_env({**ours, protocol.LAUNCHER_PID: str(os.getppid())}) == Job(0, 2, 0, 2, "multicard")
    assert job_from_env({**ours, protocol.LAUNCHER_PID: str(os.getpid())}) == Job()  # our parent did not start the job


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
        rules.timeout(seconds, f"--timeout {seconds:g}")
    rules.timeout(1, "--timeout 1")
    rules.timeout(1e6, "--timeout 1e6")


# -- the rendezvous ---------------------------------------------------------------------------------------------------
@pytest.fixture
def job_env(monkeypatch):
    """This process as rank 1 of 2 of a job met at a port (given later), its launcher's variables cleared."""
    for name in (*JOB_VARIABLES, protocol.LAUNCHER_PID):
        monkeypatch.delenv(name, raising=False)
    progress.progress_slot.cache_clear()  # this process's slot mapped afresh, as a new rank's
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

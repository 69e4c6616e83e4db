"""Who am I in a job: read from our spawn, torchrun or SLURM variables, and what our launcher and its ranks tell
each other (jobs/protocol.py: the MULTICARD_ variables, the progress slot); no processes started here."""

import os
import re
from pathlib import Path

from multicard.jobs import launcher, outcome, progress, protocol
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
    import pytest

    from multicard.errors import UsageError

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
        "MULTICARD_PROGRESS": outcome.slot_path(str(tmp_path), 1)}
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
    path = outcome.slot_path(str(tmp_path), 0)
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

"""Who am I in a job: read from our spawn, torchrun or SLURM variables (no processes started here)."""

import re

from multicard.jobs.devices import Devices
from multicard.jobs.dist import Job, backend_for, first_host, job_from_env, rendezvous_env


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

"""Process-group facts: who am I (from our own spawn, torchrun or SLURM), and setting the group up."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class Job:
    rank: int = 0  # this process among all of them
    world: int = 1  # processes in the whole job
    local_rank: int = 0  # this process among those on this machine: picks its card
    local_world: int = 1  # processes on this machine: shares its CPU cores
    launcher: str = "none"  # none, multicard, torchrun or slurm

    @property
    def launched(self) -> bool:
        return self.launcher != "none"


def job_from_env(env=os.environ) -> Job:
    """Read the job's shape from the environment: a process started by torchrun has RANK set (nanoGPT's
    test), one started by srun has SLURM_PROCID and a step id. No flag asks the user to say so."""
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        return Job(rank, world, int(env.get("LOCAL_RANK", rank)), int(env.get("LOCAL_WORLD_SIZE", world)),
                   env.get("MULTICARD_LAUNCHER", "torchrun"))
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", 1)) > 1:
        per_node = re.match(r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_NTASKS", "1")))
        return Job(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                   int(per_node.group()) if per_node else 1, "slurm")
    return Job()


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    m = re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", nodelist)
    if not m:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    return m.group(1) + (m.group(2) or "")


def rendezvous_env(env=os.environ) -> dict[str, str]:
    """MASTER_ADDR / MASTER_PORT for init_process_group, filled in from SLURM when srun did not set them."""
    out = {}
    if "MASTER_ADDR" not in env and "SLURM_JOB_NODELIST" in env:
        out["MASTER_ADDR"] = first_host(env.get("SLURM_STEP_NODELIST", env["SLURM_JOB_NODELIST"]))
    if "MASTER_PORT" not in env and "SLURM_JOB_ID" in env:
        out["MASTER_PORT"] = str(15000 + int(env["SLURM_JOB_ID"]) % 20000)  # the same in every task of a job
    return out


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"  # gloo for CPU tensors, NCCL for cards


def init(job: Job, device_type: str, timeout_s: float = 600) -> None:
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if not job.launched:  # one process on its own (ddp on one device): nobody to meet, so no port at all
        dist.init_process_group(backend_for(device_type), store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    os.environ.update(rendezvous_env())
    dist.init_process_group(backend_for(device_type), rank=job.rank, world_size=job.world, timeout=timeout)


def teardown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

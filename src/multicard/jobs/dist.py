"""Process-group facts: who am I (from our own spawn, torchrun or SLURM), meeting the others, and telling our
launcher how far this process got."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..errors import UsageError
from . import launcher_watch, protocol
from .cpp_log import cpp_log_hidden
from .devices import Devices
from .launcher_watch import inherited
from .progress import hook_failures, progress, progress_slot, slot_timed_out

JOINED = 0.05  # seconds between looks at the store while the rendezvous waits for the others


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
    test), one started by srun has SLURM_PROCID and a step id. No flag asks the user to say so. A value that
    cannot be right is one line now, not a rendezvous that waits for nobody. A process that a rank started (a
    `multicard train` inside a script under `multicard run`) inherits the job's variables but is none of its ranks:
    it runs on its own."""
    if inherited(env):
        return Job()
    if env is os.environ:
        hook_failures()
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _number(env, "RANK", 0), _number(env, "WORLD_SIZE", 1)
        local_rank, local_world = _number(env, "LOCAL_RANK", 0, rank), _number(env, "LOCAL_WORLD_SIZE", 1, world)
        _below(env, ("RANK", rank), ("WORLD_SIZE", world))
        if "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env:
            _below(env, ("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", local_world))
        _port(env)
        _number(env, "TORCHELASTIC_RESTART_COUNT", 0, 0)
        return Job(rank, world, local_rank, local_world, env.get(protocol.LAUNCHER, "torchrun"))
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and _number(env, "SLURM_NTASKS", 1, 1) > 1:
        rank, world = _number(env, "SLURM_PROCID", 0), _number(env, "SLURM_NTASKS", 1)
        _below(env, ("SLURM_PROCID", rank), ("SLURM_NTASKS", world))
        _port(env)
        per_node = re.match(r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_NTASKS", "1")))
        return Job(rank, world, _number(env, "SLURM_LOCALID", 0, 0), int(per_node.group()) if per_node else 1,
                   "slurm")
    return Job()


def _number(env, name: str, least: int, default: int | None = None) -> int:
    """The whole number `name` holds (`default` where it is missing): one line where it cannot be read."""
    if name not in env and default is not None:
        return default
    value = env[name]
    try:
        number = int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} in the environment is not a whole number; {_origin(env)}") from None
    if number < least:
        raise UsageError(f"{name}={value} in the environment: must be at least {least}; {_origin(env)}")
    return number


def _below(env, rank: tuple[str, int], world: tuple[str, int]) -> None:
    if rank[1] >= world[1]:
        raise UsageError(f"{rank[0]}={rank[1]} with {world[0]}={world[1]} in the environment: ranks run from 0 to "
                         f"{world[1] - 1}; {_origin(env)}")


def _port(env) -> int | None:
    """MASTER_PORT, read (None where it is not set)."""
    if "MASTER_PORT" not in env:
        return None
    port = _number(env, "MASTER_PORT", 1)
    if port > 65535:
        raise UsageError(f"MASTER_PORT={port} in the environment: a port runs from 1 to 65535; {_origin(env)}")
    return port


def _origin(env) -> str:
    """Where this process's job came from, and what to do when it is not the job the user meant."""
    if protocol.from_env(env).ours:
        return "the job was started by multicard"
    if "RANK" in env and "WORLD_SIZE" in env:
        return ("RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT came from the environment (torchrun, SLURM or your shell): "
                "a stale environment? unset RANK and WORLD_SIZE to run alone")
    return ("SLURM_PROCID/SLURM_NTASKS came from SLURM (srun): check that every task of the step started, or run "
            "outside srun to run alone")


def first_host(nodelist: str, name: str = "SLURM_JOB_NODELIST") -> str:
    """The first host of a SLURM node list (`name` holds it): 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    m = re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", nodelist)
    if not m:
        raise UsageError(f"{name}={nodelist!r} in the environment: cannot read a host from it; set "
                         f"MASTER_ADDR to the host of rank 0")
    return m.group(1) + (m.group(2) or "")


def rendezvous_env(env=os.environ) -> dict[str, str]:
    """MASTER_ADDR / MASTER_PORT for init_process_group, filled in from SLURM when srun did not set them."""
    out = {}
    if "MASTER_ADDR" not in env and "SLURM_JOB_NODELIST" in env:
        name = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
        out["MASTER_ADDR"] = first_host(env[name], name)
    if "MASTER_PORT" not in env and "SLURM_JOB_ID" in env:
        job_id = _number(env, "SLURM_JOB_ID", 0)
        out["MASTER_PORT"] = str(15000 + job_id % 20000)  # the same in every task of a job
    _port({**env, **out})
    return out


def backend_for(devices: Devices) -> str:
    """NCCL for cards, each driven by one process; gloo for CPU tensors, and for processes that share a card (NCCL
    refuses two ranks on one card; gloo reduces card tensors through the host)."""
    return "nccl" if devices.kind == "cuda" and not devices.shared else "gloo"


def init(job: Job, devices: Devices, timeout_s: float = 120) -> None:
    """Join the job's process group. Collectives, and the rendezvous, wait at most `timeout_s` for the others."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if not job.launched:  # one process on its own (ddp on one device): nobody to meet, so no port at all
        dist.init_process_group(backend_for(devices), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if job.launcher == "multicard" or os.environ.get("TORCHELASTIC_RUN_ID"):  # started by an agent that waits
        launcher_watch.watch_parent(job.rank)  # on it (a shell that started a rank by hand may end before it)
    progress_slot().timeout = timeout_s
    progress()
    hook_failures()
    store = rendezvous(job, timeout_s)
    dist.init_process_group(backend_for(devices), store=dist.PrefixStore("default_pg", store), rank=job.rank,
                            world_size=job.world, timeout=timeout)


def attempt() -> str:
    """The keys of this attempt at the job: torchrun's agent keeps its store across restarts, so keys of an
    earlier attempt (the addresses of processes gone) are still there; torch's own rendezvous does the same."""
    return f"multicard/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def rendezvous(job: Job, timeout_s: float):
    """Meet every other process of the job at MASTER_ADDR:MASTER_PORT and return the store there. Each one
    says it joined; one that does not come within the timeout is named, with where the job came from.
    The store is held by our launcher or torchrun's agent (TORCHELASTIC_USE_AGENT_STORE), else by rank 0."""
    from torch.distributed import DistError, PrefixStore, TCPStore

    env = {**os.environ, **rendezvous_env()}
    if not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
        raise UsageError(f"rank {job.rank} of {job.world}: MASTER_ADDR and MASTER_PORT must name where the job "
                         f"meets; {_origin(env)}")
    addr, port = env["MASTER_ADDR"], _port(env)
    where, origin = f"rendezvous at {addr}:{port}", _origin(env)
    deadline = time.monotonic() + timeout_s
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or job.rank != 0:
        holder = "the launcher's store" if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
        _wait_for_listener(addr, port, deadline, f"{where}: rank {job.rank} of {job.world} found no {holder} "
                                                 f"there within {timeout_s:g} s ({origin})")
        store = _client(addr, port, deadline, f"{where}: rank {job.rank} of {job.world}: something listens there "
                                              f"but does not answer as the job's store ({origin})")
    else:
        try:  # torch tries an address that does not answer twice over the timeout: it is held to it here
            store = _within(deadline, lambda: TCPStore(addr, port, job.world, is_master=True, wait_for_workers=False,
                                                       timeout=timedelta(seconds=timeout_s), multi_tenant=True))
        except DistError as e:
            reason = "the port is taken" if "EADDRINUSE" in str(e) else str(e).splitlines()[0]
            raise UsageError(f"{where}: rank 0 cannot hold the store there ({reason}); {origin}") from None
        if store is None:
            slot_timed_out()
            raise UsageError(f"{where}: rank 0 cannot hold the store there (no answer from {addr} within "
                             f"{timeout_s:g} s: is it this machine?); {origin}")
    store.set_timeout(timedelta(seconds=timeout_s))  # for what the process group asks of it later, in full
    store = PrefixStore(attempt(), store)
    joined = PrefixStore("joined/", store)
    ranks = [str(r) for r in range(job.world)]
    me = f"{job.world} {socket.gethostname()} {os.getpid()}"  # the world this process was told, and who it is
    try:
        there = joined.compare_set(str(job.rank), "", me).decode()  # taken by another process: left as it is
        if there != me:
            raise UsageError(f"{where}: rank {job.rank} of this job has joined already (pid {there.split()[-1]} "
                             f"on {there.split()[1]}): this process is a second rank {job.rank}; {origin}")
        while not joined.check(ranks):
            if job.rank and joined.check(["0"]):
                same_world(job, where, origin, {"0": joined.get("0").decode()})
            if time.monotonic() > deadline:
                missing = [r for r in ranks if not joined.check([r])]
                slot_timed_out()
                raise UsageError(f"{where}: {job.world - len(missing)} of {job.world} processes joined within "
                                 f"{timeout_s:g} s; missing rank{'s' * (len(missing) > 1)} {listed(missing)} "
                                 f"({origin})")
            time.sleep(JOINED)
        seen = ranks if job.rank == 0 else ["0"]  # rank 0 looks at every rank, the others at rank 0
        same_world(job, where, origin, {r: said.decode() for r, said in zip(seen, joined.multi_get(seen), strict=True)})
    except DistError as e:  # the store went away: its holder ended (it gave up, or failed)
        raise UsageError(f"{where}: rank {job.rank} lost the store ({str(e).splitlines()[0]}); {origin}") from None
    return store


def same_world(job: Job, where: str, origin: str, joined: dict[str, str]) -> None:
    """Every rank that joined (rank: what it said as it joined) was told the same WORLD_SIZE as this one."""
    for rank, said in joined.items():
        if said.split()[0] != str(job.world):
            raise UsageError(f"{where}: rank {rank} has WORLD_SIZE={said.split()[0]} but rank {job.rank} has "
                             f"WORLD_SIZE={job.world}: every process of a job must be told the same; {origin}")


def _client(addr: str, port: int, deadline: float, failure: str):
    """A client of the store at addr:port, made within the deadline (torch's client waits for the store's answer
    without a limit: something else listening there, a stale process or a web server, would hold it forever)."""
    from torch.distributed import DistError, TCPStore

    try:
        store = _within(deadline, lambda: TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=max(
            1.0, deadline - time.monotonic()))))
    except (DistError, RuntimeError, ValueError):
        store = None
    if store is None:
        slot_timed_out()
        raise UsageError(failure) from None
    return store


def _within(deadline: float, make: Callable[[], Any]) -> Any:
    """What make() returns (what it raises, raised here), made in a thread of its own that is left behind when
    the deadline passes (then None); torch's C++ log of its retries kept off the screen meanwhile."""
    made: list = []

    def run() -> None:
        try:
            made.append(make())
        except Exception as e:
            made.append(e)

    thread = threading.Thread(target=run, name="multicard store", daemon=True)
    with cpp_log_hidden():
        thread.start()
        thread.join(max(1.0, deadline - time.monotonic()))
    if made and isinstance(made[0], Exception):
        raise made[0]
    return made[0] if made else None


def _wait_for_listener(addr: str, port: int, deadline: float, failure: str) -> None:
    """Wait until something listens at addr:port (plain connects: the store's client would log a page of C++
    errors for each try)."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))).close()
            return
        except socket.gaierror:
            raise UsageError(f"MASTER_ADDR={addr}: no such host") from None
        except OSError:
            if time.monotonic() > deadline:
                slot_timed_out()
                raise UsageError(failure) from None
            time.sleep(0.2)


def listed(items: list[str], most: int = 8) -> str:
    shown = items[:most] + ([f"{len(items) - most} more"] if len(items) > most else [])
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


def teardown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

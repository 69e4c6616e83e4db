"""Parse --devices, and pin the chosen cards before CUDA starts (as one does by hand with CUDA_VISIBLE_DEVICES);
the cores a process may use, and how its threads wait for them.

Forms: auto | cpu | cpu:N | N (a count of cards) | 0,1 (card ids) | cuda | cuda:1 (one card by id). A card id named
twice (0,0 or cuda:0,cuda:0) is a rehearsal: one process per entry, those of a card sharing it, over gloo.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError


@dataclass(frozen=True)
class Devices:
    kind: str  # "cpu" or "cuda"
    ids: tuple[int, ...]  # card indices; for the CPU, one entry per process
    note: str = ""  # said to the user, e.g. "no CUDA card: using the CPU"

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def shared(self) -> bool:
        """A card named twice or more: processes share it (a rehearsal of more cards on fewer)."""
        return self.kind == "cuda" and len(set(self.ids)) < len(self.ids)

    @property
    def spec(self) -> str:
        """The --devices text that chooses these devices again in this process, or in a rank started with its
        environment: the card ids as this process sees them (after select, CUDA_VISIBLE_DEVICES shows only them);
        on the CPU the kind (a rank is one process)."""
        return f"cuda:{','.join(map(str, self.ids))}" if self.kind == "cuda" else self.kind


def rehearsal(devices: Devices) -> str:
    """The line a rehearsal starts with: what it is and what differs from as many real cards."""
    cards = len(set(devices.ids))
    on = "one card" if cards == 1 else f"{cards} cards"
    return (f"rehearsal: {devices.count} processes on {on}, over gloo (NCCL takes one process per card); they share "
            f"its memory and compute: this tests the job, not NCCL, the links between cards, memory per card or speed")


# Each CPU process is a whole Python + torch (a few hundred MB, and a gloo peer of every other one); past about 8
# per core they only queue for the cores, and cpu:100000000 would build 10^8 ids before any later check. A little
# oversubscribing stays allowed (the tests run cpu:3 on 2 cores), and 64 at least lets a small machine try many ranks.
CPU_PROCESSES_PER_CORE, CPU_PROCESSES_FLOOR = 8, 64

# A rehearsal's processes on one card (each holds a CUDA context, ~0.5 GB, and a share of the card's time): 16 rehearse
# two machines of 8 cards on one.
MAX_PER_CARD = 16

# The longest --devices read: ids 0..255 fit in 914 characters. Bounding the text first bounds all the work below
# (the id regex keeps some state per id; int() of 4300+ digits is a ValueError, not a UsageError).
MAX_TEXT = 1024

CGROUP = Path("/sys/fs/cgroup")  # where the control groups' CPU quotas are read (cpu_quota)
SELF_CGROUP = Path("/proc/self/cgroup")  # which group this process is in, per hierarchy
LOADAVG = Path("/proc/loadavg")  # its fourth field: runnable threads / all threads, now


def max_cpu_processes(cores: int) -> int:
    return max(CPU_PROCESSES_FLOOR, CPU_PROCESSES_PER_CORE * cores)


def parse(text: str, cards: int, cores: int | None = None) -> Devices:
    """Turn --devices into Devices, given how many CUDA cards are visible. Pure: no CUDA is touched.

    `cores` (default: those this process may use) bounds cpu:N. Every bound is checked before any ids are built.
    """
    if len(text) > MAX_TEXT:
        raise UsageError(f"--devices {text[:20]}...: {len(text)} characters, too long (at most {MAX_TEXT}); "
                         f"use auto, cpu, cpu:N, a count N, ids 0,1 or cuda:1")
    t = text.strip().lower().replace(" ", "")
    if t == "auto":
        if cards == 0:
            return Devices("cpu", (0,), note="no CUDA card found: training on the CPU")
        return Devices("cuda", tuple(range(cards)))
    if t == "cpu":
        return Devices("cpu", (0,))
    if m := re.fullmatch(r"cpu:(-?\d+)", t):
        n = int(m.group(1))
        if n < 1:
            raise UsageError(f"--devices {text}: the number of CPU processes must be at least 1")
        cores = cpu_cores() if cores is None else cores
        if n > max_cpu_processes(cores):
            raise UsageError(f"--devices {text}: {n} CPU processes is too many for {cores} cores; "
                             f"use at most {max_cpu_processes(cores)}")
        return Devices("cpu", tuple(range(n)))
    if t == "cuda":
        _need_cards(text, cards)
        return Devices("cuda", tuple(range(cards)))
    if re.fullmatch(r"-?\d+", t):
        n = int(t)
        _need_cards(text, cards)
        if n == 0:  # CUDA_VISIBLE_DEVICES=0 habit: the user most likely means the card with id 0
            raise UsageError(f"--devices {text}: a number here counts cards (at least 1); for the card with id 0 "
                             f"write cuda:0")
        if not 1 <= n <= cards:
            raise UsageError(f"--devices {text}: asks for {n} cards, this machine has {cards} (use 1..{cards})")
        return Devices("cuda", tuple(range(n)))
    if re.fullmatch(r"(?:cuda:)?-?\d+(?:,(?:cuda:)?-?\d+)*,?", t):
        ids = [int(i.removeprefix("cuda:")) for i in t.rstrip(",").split(",")]
        _need_cards(text, cards)
        bad = [i for i in ids if not 0 <= i < cards]
        if bad:
            raise UsageError(f"--devices {text}: no card with id {bad[0]} (this machine has ids 0..{cards - 1})")
        crowded = max(set(ids), key=ids.count)
        if ids.count(crowded) > MAX_PER_CARD:
            raise UsageError(f"--devices {text}: {ids.count(crowded)} processes on card {crowded}; a rehearsal puts "
                             f"at most {MAX_PER_CARD} on one card")
        return Devices("cuda", tuple(ids))
    raise UsageError(f"--devices {text}: not understood; use auto, cpu, cpu:N, a count N, ids 0,1 or cuda:1")


def _need_cards(text: str, cards: int) -> None:
    if cards == 0:
        raise UsageError(f"--devices {text}: this machine has no CUDA card; use --devices cpu or cpu:N")


def cpu_cores() -> int:
    """The cores this process may run on (a container or SLURM may allow fewer than the machine has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def group_folders(root: Path, controller: str, listing: Path) -> list[Path]:
    """The folders of this process's control group in the hierarchy of `controller` ("": cgroup v2) mounted at
    `root`: the root of the mount, then its own and each above it; `listing` (/proc/self/cgroup) says which group
    it is in."""
    try:
        lines = listing.read_text().splitlines()
    except OSError:
        lines = []
    own = next((parts[2] for parts in (line.split(":", 2) for line in lines)
                if len(parts) == 3 and controller in parts[1].split(",")), "/")
    folders, folder = [root], root / own.strip("/")
    while folder != root and root in folder.parents:
        folders.append(folder)
        folder = folder.parent
    return folders


def cpu_quota() -> float | None:
    """The cores the CPU quota of this process's control group, or of a group above it, allows (cgroup v2's
    cpu.max, v1's cfs_quota_us / cfs_period_us); None where there is none or it cannot be read."""
    quotas = []
    for controller in ("", "cpu"):
        for group in group_folders(CGROUP / controller, controller, SELF_CGROUP):
            try:
                quota, period = ((group / "cpu.max").read_text().split() if not controller else
                                 [(group / f"cpu.cfs_{f}_us").read_text().strip() for f in ("quota", "period")])
                if quota not in ("max", "-1"):  # each hierarchy's "no quota"
                    quotas.append(int(quota) / int(period))
            except (OSError, ValueError):  # no such file here (no quota, or a hierarchy not mounted)
                continue
    return min(quotas) if quotas else None


def usable_cores() -> int:
    """The cores this process can keep busy: those it may run on, and no more than its cgroup's quota allows (a
    container limited to 2 CPUs on a 64-core host would otherwise run torch's 32 threads on 2 CPUs' time)."""
    quota = cpu_quota()
    return max(1, min(cpu_cores(), int(quota))) if quota else cpu_cores()


def others_running() -> int:
    """Threads of other processes that want a core right now: the kernel's count of runnable threads
    (/proc/loadavg, the whole machine's; this process's own one not counted), the median of five reads 2 ms
    apart, so a command that only passes by is not counted. 0 where unknown."""
    counts = []
    for _ in range(5):
        try:
            counts.append(int(LOADAVG.read_text().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return 0
        time.sleep(0.002)
    return max(0, sorted(counts)[2])


# OpenMP's idle threads spin for a while before they sleep (libgomp: ~300,000 turns after each parallel region),
# and every region waits for its slowest thread. Where other work holds the cores, a spinning thread keeps from
# a core the very thread it waits for: the main job's epochs beside busy processes on 2 cores took 8x as long as
# with PASSIVE waiting, which sleeps at once and computes the same numbers (benchmarks/busy_machine.py). On an idle
# machine the spin is what makes back-to-back regions quick, so it is kept there. The OpenMP runtime reads the
# variable once, as torch loads it: it goes into the environment before `import torch` (the CLI's own process,
# and every process a launcher starts). A way of waiting the user set (any of WAITING) is kept.
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
WAITING = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def busy() -> bool:
    """Whether other work holds some of the cores this process's threads would use."""
    return others_running() > (os.cpu_count() or 1) - usable_cores()


def omp_threads(nprocs: int, env: dict[str, str]) -> dict[str, str]:
    """OMP_NUM_THREADS for each of `nprocs` processes a launcher starts on this machine, unless `env` has it. As
    torchrun sets it, but to the cores // nprocs a ddp process on the CPU takes anyway (torchrun's 1 leaves cores
    idle where the processes are fewer than the cores; its own warning says to tune it). One process: torch's
    default, untouched."""
    if nprocs < 2 or "OMP_NUM_THREADS" in env:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, usable_cores() // nprocs))}


def openmp_env(nprocs: int, env: dict[str, str]) -> dict[str, str]:
    """What each of `nprocs` processes started with environment `env` should find there besides: omp_threads'
    OMP_NUM_THREADS, and PASSIVE waiting where the machine is busy now (unless `env` says how to wait)."""
    waits = {} if any(name in env for name in WAITING) or not busy() else PASSIVE
    return {**omp_threads(nprocs, env), **waits}


def cpu_threads(local_world: int, current: int) -> int:
    """Intra-op threads for one of `local_world` processes on this machine's CPU, running `current` now.
    OMP_NUM_THREADS, where set (by the user, our launcher or torchrun), is kept, as torch keeps it. Else a share of
    the cores the process can keep busy: cores // local_world, or fewer where `current` is fewer (torch's own count,
    or the user's torch.set_num_threads). Never the machine's load: a count that followed it would change the
    numbers (a sum over threads adds in another order) from one run to the next; how the threads wait is the lever
    for a busy machine (PASSIVE)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return current
    return max(1, min(current, usable_cores() // local_world))


def machine() -> str:
    """This machine among a job's: its host name and this boot's id (two hosts that share a name differ in it;
    the processes of one machine share its cores whatever launcher started them)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def count_cards() -> tuple[int, bool]:
    """How many CUDA cards are visible, and whether CUDA is still unstarted (so visibility can be set).

    NVML counts without starting CUDA; torch.cuda.device_count() would start it and freeze the visible set.
    """
    import torch

    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # card ids as nvidia-smi shows them
    if not torch.backends.cuda.is_built():
        return 0, False
    if not torch.cuda.is_initialized():
        n = torch.cuda._device_count_nvml()
        if n >= 0:
            return n, True
    return torch.cuda.device_count(), False


def select(text: str) -> Devices:
    """Parse --devices for this machine; where CUDA has not started yet, show the process only those cards (each
    once: a card named twice is shared, its processes all see it under one id)."""
    cards, unstarted = count_cards()
    devices = parse(text, cards)
    if devices.kind == "cuda" and unstarted:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = shown.split(",") if shown else [str(i) for i in range(cards)]
        chosen = list(dict.fromkeys(devices.ids))
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical[i].strip() for i in chosen)
        devices = Devices("cuda", tuple(chosen.index(i) for i in devices.ids), devices.note)
    return devices


def to_device(batch, device):
    """Move the tensors in `batch` (a tensor, or any structure of them: trees.py) to `device` (a torch.device),
    the structure kept as its own type."""
    from .trees import map_tensors  # on use: the CLI reads this module before torch is needed

    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)

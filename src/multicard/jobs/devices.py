"""Parse --devices, and pin the chosen cards before CUDA starts (as the seeds do with CUDA_VISIBLE_DEVICES).

Forms: auto | cpu | cpu:N | N (a count of cards) | 0,1 (card ids) | cuda | cuda:1 (one card by id).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class Devices:
    kind: str  # "cpu" or "cuda"
    ids: tuple[int, ...]  # card indices; for the CPU, one entry per process
    note: str = ""  # said to the user, e.g. "no CUDA card: using the CPU"

    @property
    def count(self) -> int:
        return len(self.ids)


# Each CPU process is a whole Python + torch (a few hundred MB, and a gloo peer of every other one); past about 8
# per core they only queue for the cores, and cpu:100000000 would build 10^8 ids before any later check. A little
# oversubscribing stays allowed (the tests run cpu:3 on 2 cores), and 64 at least lets a small machine try many ranks.
CPU_PROCESSES_PER_CORE, CPU_PROCESSES_FLOOR = 8, 64

# The longest --devices read: ids 0..255 fit in 914 characters. Bounding the text first bounds all the work below
# (the id regex keeps some state per id; int() of 4300+ digits is a ValueError, not a UsageError).
MAX_TEXT = 1024


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
    if m := re.fullmatch(r"(?:cuda:)?(-?\d+(?:,-?\d+)*),?", t):
        ids = [int(i) for i in m.group(1).split(",")]
        _need_cards(text, cards)
        bad = [i for i in ids if not 0 <= i < cards]
        if bad:
            raise UsageError(f"--devices {text}: no card with id {bad[0]} (this machine has ids 0..{cards - 1})")
        if len(set(ids)) != len(ids):
            raise UsageError(f"--devices {text}: a card is named twice; name each card once")
        return Devices("cuda", tuple(ids))
    raise UsageError(f"--devices {text}: not understood; use auto, cpu, cpu:N, a count N, ids 0,1 or cuda:1")


def _need_cards(text: str, cards: int) -> None:
    if cards == 0:
        raise UsageError(f"--devices {text}: this machine has no CUDA card; use --devices cpu or cpu:N")


def cpu_cores() -> int:
    """The cores this process may run on (a container or SLURM may allow fewer than the machine has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def omp_threads(nprocs: int, env: dict[str, str]) -> dict[str, str]:
    """OMP_NUM_THREADS for each of `nprocs` processes a launcher starts on this machine, unless `env` has it. As
    torchrun sets it, but to the cores // nprocs a ddp process on the CPU takes anyway (torchrun's 1 leaves cores
    idle where the processes are fewer than the cores; its own warning says to tune it). One process: torch's
    default, untouched."""
    if nprocs < 2 or "OMP_NUM_THREADS" in env:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, cpu_cores() // nprocs))}


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
    """Parse --devices for this machine; where CUDA has not started yet, show the process only those cards."""
    cards, unstarted = count_cards()
    devices = parse(text, cards)
    if devices.kind == "cuda" and unstarted:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = shown.split(",") if shown else [str(i) for i in range(cards)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical[i].strip() for i in devices.ids)
        devices = Devices("cuda", tuple(range(devices.count)), devices.note)
    return devices


def to_device(batch, device):
    """Move a tensor, or any tuple / list / dict of them, to `device` (a torch.device)."""
    import torch  # on use: the CLI reads this module before torch is needed

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


"""How much memory this process may still take: the least of the machine's MemAvailable, what its control groups
(cgroup v2 or v1, the process's own and every parent) leave under their limits, and its address-space rlimit.

MemAvailable alone is the whole machine's: inside a container or a `systemd-run -p MemoryMax=4G`, a file whose
header fits the machine but not the group was read until the kernel's out-of-memory killer ended the run, without a
word. A limit that cannot be read is no limit (None where nothing is known)."""

from __future__ import annotations

import resource
from pathlib import Path

from ..jobs.devices import group_folders

CGROUP = Path("/sys/fs/cgroup")
SELF = Path("/proc/self/cgroup")  # which group this process is in, per hierarchy
# (folder under CGROUP, file holding the limit, file holding what is used): v2 first, then v1's memory controller
FILES = (("", "memory.max", "memory.current"), ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes"))


def available_memory() -> int | None:
    """Bytes of memory available to new allocations; None where unknown."""
    found = [n for n in (machine(), groups(), address_space()) if n is not None]
    return min(found) if found else None


def machine() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def groups() -> int | None:
    """The least room left under the memory limit of this process's control group or of any group above it."""
    room = []
    for sub, limit_file, used_file in FILES:
        for folder in group_folders(CGROUP / sub, sub, SELF):
            limit, used = number(folder / limit_file), number(folder / used_file)
            if limit is not None and used is not None and limit < 1 << 60:  # v1 says "no limit" as ~2**63
                room.append(max(0, limit - used))
    return min(room) if room else None


def number(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # "max" (v2's no limit), a missing file, a hierarchy not mounted
        return None


def address_space() -> int | None:
    """What RLIMIT_AS (ulimit -v) leaves above the address space already mapped."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(0, limit - int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return None

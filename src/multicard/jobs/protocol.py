"""What our launcher and its ranks tell each other, named once: every MULTICARD_ variable (those a launcher hands
a rank, and the settings a user types), and the fields of a rank's progress slot, the small file the launcher makes
for each rank, mapped into the rank's memory, where the rank shows how far it got and how it failed."""

from __future__ import annotations

import mmap
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass

# -- the environment ------------------------------------------------------------------------------------------------
# what our launcher hands each rank, besides torchrun's variables (job_env)
LAUNCHER = "MULTICARD_LAUNCHER"  # OURS in a rank our launcher started (torchrun's and srun's lack it)
LAUNCHER_PID = "MULTICARD_LAUNCHER_PID"  # our launcher names itself here: a process whose parent it is not is no rank
PROGRESS = "MULTICARD_PROGRESS"  # our launchers name here the file where a rank shows how far it got (its slot)
OURS = "multicard"  # what LAUNCHER holds
# what a launcher passes on of what was chosen (a relaunch; multicard run's flags)
STRATEGY = "MULTICARD_STRATEGY"  # the strategy's name
DEVICES = "MULTICARD_DEVICES"  # the devices as the ranks see them (the cards narrowed already)
DETERMINISTIC = "MULTICARD_DETERMINISTIC"  # how `multicard run --deterministic` tells the script's Multicard: 1 or 0
REPLICA_CHECK = "MULTICARD_REPLICA_CHECK"  # multicard run --replica-check: stop, warn or off
REPLICA_CHECK_EVERY = "MULTICARD_REPLICA_CHECK_EVERY"  # multicard run --replica-check-every: steps between checks
# settings a user types
CHECK_SHAPES = "MULTICARD_CHECK_SHAPES"  # 1: mc.all_reduce checks that every rank passed the same shapes
TRUST_DIR = "MULTICARD_TRUST_DIR"  # folders trusted, separated by os.pathsep (":"), as PATH separates its folders
CACHE = "MULTICARD_CACHE"  # where downloaded data sets are kept (else $XDG_CACHE_HOME or ~/.cache)
# what `multicard check script.py` hands each rank of the script it runs (tools/recorder.py)
CHECK_RECORDS = "MULTICARD_CHECK_RECORDS"  # the folder where rank 0 leaves the weights after each step
CHECK_STEPS = "MULTICARD_CHECK_STEPS"  # K: the script ends in every rank after its K-th optimizer step


@dataclass(frozen=True)
class Handed:
    """What a launcher hands a process in its environment (to_env, from_env); None for what it did not."""

    launcher: str | None = None  # LAUNCHER
    launcher_pid: str | None = None  # LAUNCHER_PID
    slot: str | None = None  # PROGRESS
    strategy: str | None = None  # STRATEGY
    devices: str | None = None  # DEVICES

    @property
    def ours(self) -> bool:
        """Whether our launcher started the job."""
        return self.launcher == OURS


NAMES = Handed(LAUNCHER, LAUNCHER_PID, PROGRESS, STRATEGY, DEVICES)  # each field's variable


def to_env(handed: Handed) -> dict[str, str]:
    """The variables that hand a process `handed` (only those given)."""
    return {getattr(NAMES, field): value for field, value in asdict(handed).items() if value is not None}


def from_env(env: Mapping[str, str] = os.environ) -> Handed:
    """What a launcher handed the process whose environment `env` is."""
    return Handed(**{field: env.get(name) for field, name in asdict(NAMES).items()})


# -- the progress slot ----------------------------------------------------------------------------------------------
# the file: a mark (only a file our launcher made is written to), then the fields (SLOT, READS), each a double
SLOT = struct.Struct("8s3d")  # the mark, last, timeout, state
READS = struct.Struct("2d")  # batches, passes
MARK = b"mcslot1\n"
SIZE = SLOT.size + READS.size
FIELDS = ("last", "timeout", "state", "batches", "passes")  # the doubles after the mark, in order
TIMED_OUT_STATE, LOST_PEER = 1.0, 2.0  # what `state` says of how a rank failed (0: it did not, or not so)


def _field(name: str, doc: str) -> property:
    at = FIELDS.index(name)

    def get(slot: Slot) -> float:
        return slot.numbers[at]

    def put(slot: Slot, value: float) -> None:
        slot.numbers[at] = value

    return property(get, put, doc=doc)


class Slot:
    """A rank's slot, read and written by field: mapped from its file (mapped()), or plain numbers (read_slot(), or
    read by nobody outside a job our launcher started)."""

    __slots__ = ("numbers",)
    last = _field("last", "time.monotonic() when the rank last made progress (0: none yet)")
    timeout = _field("timeout", "the rank's timeout in seconds (0: not joined yet)")
    state = _field("state", "how the rank failed: 0, TIMED_OUT_STATE or LOST_PEER")
    # what the rank read from loaders every process reads whole (a rank whose pass ended before another's is named
    # with both counts, rather than the rank left waiting)
    batches = _field("batches", "batches served")
    passes = _field("passes", "passes that ended")

    def __init__(self, numbers: memoryview | list[float] | None = None, **fields: float):
        self.numbers = [0.0] * len(FIELDS) if numbers is None else numbers
        for name, value in fields.items():
            setattr(self, name, value)

    @property
    def mapped(self) -> bool:
        """Whether writes reach a launcher (the slot is its file, mapped)."""
        return isinstance(self.numbers, memoryview)

    def fields(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in FIELDS}

    def packed(self) -> bytes:
        """The file holding this slot: the mark, then the fields."""
        return SLOT.pack(MARK, self.last, self.timeout, self.state) + READS.pack(self.batches, self.passes)


def mapped(path: str) -> Slot | None:
    """The slot in `path`, mapped: only a plain file of this user's, of the slot's size, that starts with the mark
    (no link followed); None for anything else."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != SIZE or info.st_uid != os.getuid() or \
                os.pread(fd, len(MARK), 0) != MARK:
            return None
        return Slot(memoryview(mmap.mmap(fd, SIZE))[len(MARK):].cast("d"))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def read_slot(path: str) -> Slot:
    """For the launcher: the slot in `path`, read now; zeros for a part that cannot be read (last, timeout and
    state; batches and passes)."""
    try:
        with open(path, "rb") as f:
            data = f.read(SIZE)
    except OSError:
        data = b""
    slot = Slot()
    if len(data) >= SLOT.size:
        _, slot.last, slot.timeout, slot.state = SLOT.unpack(data[:SLOT.size])
    if len(data) == SIZE:
        slot.batches, slot.passes = READS.unpack(data[SLOT.size:])
    return slot

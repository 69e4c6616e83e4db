"""Every rank's random streams into the one checkpoint file of an mc.save, and no save on any rank dropped.

Outside fsdp a save is no collective: `if mc.is_main: mc.save(...)` must not wait for ranks that never save, nor
`if mc.rank == 1: mc.save(...)` for rank 0. The ranks meet through the job's store, where a save is known by its
file's name and its moment: the optimizer steps this process took (the Multicard counts them) and how many saves
of that name came since. Ranks that save one file at one point of their loop share a moment, so a file never
carries streams taken at another save (a rank that saves a name more often than rank 0 pairs with nothing).

- Rank 0 says it saves that moment (a claim), takes the streams the other ranks handed over for it, says it is
  done, and writes the file. It waits for them FIRST_WAIT_S the first time it saves a name, unless no save ever
  had them (rank 0 saves alone: it waits no more); where they came last time, FIRST_WAIT_S or twice as long as
  they were ever late (at most half the job's timeout: a rank that saves where the other does not costs a short
  stall, never the job); where none came, not at all (unless one said since that it came late).
- Another rank hands over its streams and waits for rank 0's claim of that moment, by the same rules. Once rank 0
  claimed it, it waits until its streams are taken, or rank 0 is done without them (then it says so, and tells
  rank 0 to wait at its next save). Where no claim comes, it writes the file itself, with its own streams (a save
  on that rank alone, or a file per rank), and leaves its streams for a rank 0 that comes late (rank 0 then
  writes the file again, with everyone's); streams never taken are withdrawn at its next save of that name.
What a file lacks is said in one line, once, on saving and on loading. The waits poll the store: one that runs out
prints nothing (torch's own timed wait has C++ warn twice).
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import note

FIRST_WAIT_S = 3.0  # far longer than ranks that all save are apart; what one save under `if mc.is_main:` costs
OFFERED, TAKEN, GONE = b"offered", b"taken", b"gone"  # the states of streams handed over


def _store():
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore("multicard-streams", _get_default_store())


class Handover:
    """What this process knows of its saves to each name (kept by the job's state, yourloop/job_state.py)."""

    def __init__(self):
        self.at: dict[str, tuple[int, int]] = {}  # name: (optimizer steps, saves of it since them)
        self.along: dict[str, bool] = {}  # name: whether the others came along last time (rank 0's, the others')
        self.pending: dict[str, str] = {}  # name: the moment of the streams this rank last handed over
        self.claims: dict[str, str] = {}  # name: the moment rank 0 last claimed
        self.waited: dict[str, float] = {}  # name: how long the last save of it waited (and gave up after)
        self.late = 0.0  # the longest the other side was seen late to a save (s)
        self.told = False  # another rank: that its streams came after rank 0 was done was said

    def moment(self, name: str, steps: int) -> str:
        last, count = self.at.get(name, (steps, 0))
        self.at[name] = steps, count + 1 if last == steps else 1
        return f"{name}@{steps}.{self.at[name][1]}"

    def wait_s(self, name: str, most: float) -> float:
        along = self.along.get(name)
        if along is None:  # a new name: wait, unless the saves so far never had company
            wait = FIRST_WAIT_S if any(self.along.values()) or not self.along else 0.0
        else:
            wait = min(most, max(FIRST_WAIT_S, 2 * self.late)) if along else 0.0
        self.waited[name] = wait
        return wait

    def came_late(self, name: str) -> None:
        """The other side came to the last save of `name` after this process gave up waiting."""
        self.along[name] = True
        self.late = max(self.late, self.waited.get(name, 0.0))


def handed(strategy: Any, handover: Handover, steps: int, path: Path,
           streams: dict[str, Any] | None) -> tuple[bool, dict[int, Any]]:
    """Whether this process writes `path`, and on rank 0 {rank: its streams at this save} of the other ranks that
    handed theirs over. `handover`: this process's, for the job; `steps`: the job's optimizer steps so far.
    `streams`: this process's, or None for a plain state_dict (nothing to hand over, but the file is written by
    rank 0 where it saves too, else by this rank)."""
    if strategy.world == 1:
        return True, {}
    name, most = str(path), strategy.timeout_s / 2
    moment = handover.moment(name, steps)
    if strategy.is_main:
        return True, _collect(_store(), handover, name, moment, strategy.world, streams is not None, most)
    return _hand(_store(), handover, name, moment, strategy.rank, streams, most), {}


def _collect(store: Any, handover: Handover, name: str, moment: str, world: int, said: bool,
             most: float) -> dict[int, Any]:
    """Rank 0: claim the moment, then take the streams handed over for it. `said`: what the file lacks is said."""
    others, previous = range(1, world), handover.claims.get(name)
    store.set(f"c/{moment}", b"1")
    if previous is not None:
        store.delete_key(f"c/{previous}")
        store.delete_key(f"e/{previous}")
    late = [r for r in others if store.check([f"l/{name}/{r}"])]  # came after the last save of it was done
    for r in late:
        store.delete_key(f"l/{name}/{r}")
    if late:
        handover.came_late(name)
    handover.claims[name] = moment
    wait, before, states = handover.wait_s(name, most), handover.along.get(name), [f"s/{moment}/{r}" for r in others]
    waited = _until(lambda: all(store.check([state]) for state in states), wait)[1]
    got = {}
    for r, state in zip(others, states, strict=True):
        if store.check([state]) and store.compare_set(state, OFFERED, TAKEN) == TAKEN:
            packed = store.get(f"d/{moment}/{r}")
            store.delete_key(f"d/{moment}/{r}")
            store.delete_key(state)
            got[r] = torch.load(io.BytesIO(packed), weights_only=True) if said else None
    store.set(f"e/{moment}", b"1")
    handover.along[name] = bool(got)
    handover.late = max(handover.late, waited) if got else handover.late
    missing = [str(r) for r in others if r not in got]
    if said and before is None and not got and wait:  # said once where rank 0 saves alone
        note(f"{name}: no other rank saved it along with rank 0 within {wait:g} s (a save under `if mc.is_main:`, "
            f"or a file per rank?): it holds rank 0's random streams; a rank that loads it starts its own afresh")
    elif said and missing and before:
        who = f"rank{'s' * (len(missing) > 1)} {', '.join(missing)}"
        note(f"{name}: {who} did not hand over their random streams within {wait:g} s: on load they start afresh")
    return got


def _hand(store: Any, handover: Handover, name: str, moment: str, rank: int, streams: dict[str, Any] | None,
          most: float) -> bool:
    """Another rank: hand over `streams` for this moment and wait for rank 0's claim of it. True where none came
    (this rank writes the file itself)."""
    previous = handover.pending.pop(name, None)
    if previous is not None:  # streams left for a late rank 0: withdrawn, or taken (rank 0 does save this name)
        if not _withdrawn(store, previous, rank):
            handover.came_late(name)
    packed = io.BytesIO()
    if streams is not None:
        torch.save(streams, packed)
    state = f"s/{moment}/{rank}"
    store.set(f"d/{moment}/{rank}", packed.getvalue())
    store.set(state, OFFERED)
    claimed, waited = _until(lambda: store.check([f"c/{moment}"]), handover.wait_s(name, most))
    handover.along[name] = claimed
    if not claimed:
        handover.pending[name] = moment
        return True
    handover.late = max(handover.late, waited)
    _until(lambda: not store.check([state]) or store.check([f"e/{moment}"]), most)
    if _withdrawn(store, moment, rank):  # rank 0 was done before they came
        store.set(f"l/{name}/{rank}", b"1")
        if streams is not None and not handover.told:
            handover.told = True
            note(f"rank {rank}: {name}: rank 0 wrote it before this rank's random streams came: on load they "
                f"start afresh (rank 0 waits for them from its next save of it on)")
    return False


def _withdrawn(store: Any, moment: str, rank: int) -> bool:
    """Take back streams this rank handed over for `moment`, unless rank 0 took them: whether they were there."""
    state = f"s/{moment}/{rank}"
    if store.compare_set(state, OFFERED, GONE) != GONE:
        return False
    store.delete_key(f"d/{moment}/{rank}")
    store.delete_key(state)
    return True


def _until(test: Any, seconds: float) -> tuple[bool, float]:
    """Whether test() came true within `seconds` (tried at once, then every few ms), and the seconds it took."""
    start = time.monotonic()
    pause = 0.001
    while True:
        if test():
            return True, time.monotonic() - start
        left = start + seconds - time.monotonic()
        if left <= 0:
            return False, time.monotonic() - start
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.02)

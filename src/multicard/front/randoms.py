"""Every rank's random streams into the one checkpoint file rank 0 writes (mc.save), read back by each rank.

Outside fsdp a save is no collective: `if mc.is_main: mc.save(...)` must not wait for ranks that never save. So
the other ranks hand their streams (a few KB) to rank 0 through the job's store and go on at once, under the
file's name and how many times this process saved to it (a script may save `last.pt` on every rank and `best.pt`
on rank 0 alone: each name is its own story). Rank 0 waits FIRST_WAIT_S for them the first time it saves to a
name, unless no save has ever had them (rank 0 saves alone: it waits no more); where they came it waits for them
at every later save to that name (up to the job's timeout), and where none came it never waits for that name
again, taking only what is already there. A rank that was late once is waited for from the next save on.
Whatever a file lacks is said in one line, on saving and on loading.
"""

from __future__ import annotations

import contextlib
import io
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

FIRST_WAIT_S = 3.0  # far longer than ranks that all save are apart; what one save under `if mc.is_main:` costs


def _store():
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore("multicard-streams", _get_default_store())


def _key(name: str, save: int, rank: int) -> str:
    return f"{name}/{save}/{rank}"


def handed(mc: Any, path: Path, streams: dict[str, Any]) -> dict[int, Any]:
    """Rank 0: {rank: its streams at this save} for the other ranks that handed theirs over; the other ranks hand
    over `streams` and get {}."""
    if mc.world_size == 1:
        return {}
    store, name = _store(), str(path)
    counts = mc.__dict__.setdefault("_stream_saves", {})  # file name: saves to it by this process
    counts[name] = save = counts.get(name, 0) + 1
    if not mc.is_main:
        packed = io.BytesIO()
        torch.save(streams, packed)
        store.set(_key(name, save, mc.rank), packed.getvalue())
        return {}
    others, known = range(1, mc.world_size), mc.__dict__.setdefault("_together", {})  # name: whether they came
    late = [r for r in others if store.check([_key(name, save - 1, r)])]  # came after that save was written
    for r in late:
        store.delete_key(_key(name, save - 1, r))
    together = True if late else known.get(name)
    if together is None:  # a new name: wait, unless the others never saved along so far
        wait = FIRST_WAIT_S if any(known.values()) or not known else 0.0
    else:
        wait = mc._strategy.timeout_s if together else 0.0
    if wait:
        with contextlib.suppress(RuntimeError):  # a wait that ran out: the missing ranks are said below
            store.wait([_key(name, save, r) for r in others], timedelta(seconds=min(wait, mc._strategy.timeout_s)))
    got = {}
    for r in others:
        if store.check([_key(name, save, r)]):
            got[r] = torch.load(io.BytesIO(store.get(_key(name, save, r))), weights_only=True)
            store.delete_key(_key(name, save, r))
    missing = [str(r) for r in others if r not in got]
    if together is None and not got and (wait or not known):  # (said once where rank 0 always saves alone)
        say(f"{path}: the other ranks did not save {'within ' + format(wait, 'g') + ' s ' if wait else ''}(a save "
            f"under `if mc.is_main:`?): it keeps rank 0's random streams; on load the others' start afresh")
    elif missing and together is not False:
        who = f"rank{'s' * (len(missing) > 1)} {', '.join(missing)}"
        say(f"{path}: {who} did not hand over their random streams within {wait:g} s: on load they start afresh")
    known[name] = bool(got) or bool(together)
    return got


def say(line: str) -> None:
    print(f"multicard: {line}", file=sys.stderr, flush=True)

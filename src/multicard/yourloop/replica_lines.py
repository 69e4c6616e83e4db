"""What the replica check (replicas.py) says where the processes differ: the meeting before each check (every
rank at the same check, with the same optimizer steps taken), what is compared that is not built alike, and
what differs (each rank's setting, a tensor's largest difference from rank 0's). Every function takes the
strategy and is called on every rank alike; only the meeting goes beside the job (its store), no collective.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..errors import UsageError
from ..strategies import Strategy
from .collectives import layouts
from .fingerprints import stable

APART = ("every process must call mc.check_replicas() and mc.load at the same point of its loop (not under `if "
         "mc.is_main:`), and step alike (a step skipped or taken on some ranks only: an `if` around "
         "optimizer.step(), a GradScaler of your own whose scale differs between ranks)")
WAIT = 0.9  # a check waits for the other ranks this part of the job's timeout: its line comes before a collective's


class ReplicasParted(UsageError):
    """The processes' replicas differ: one line naming when, what, the ranks and the largest difference."""


def meet(strategy: Strategy, key: str, meeting: int, head: list) -> None:
    """Meeting `meeting` of the check under `key`: every rank posts its head ([kind, optimizer steps, when]);
    ranks whose kind or steps differ, or a rank that does not come within WAIT of the timeout (it went on into a
    collective of its own), are one line, raised on every rank that came."""
    if meeting > 1:  # the meeting before: every rank read it (its check's collectives came after)
        strategy.forget(f"{key}/{meeting - 1}")
    wait = WAIT * strategy.timeout_s
    said = strategy.exchange(f"{key}/{meeting}", json.dumps(head), wait)
    missing = [rank for rank, text in enumerate(said) if text is None]
    if missing:
        raise ReplicasParted(f"{head[2]}: rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} did not "
                             f"reach a replica check within {wait:g} s; {APART}")
    heads = [json.loads(text) for text in said]
    if any(other[:2] != heads[0][:2] for other in heads):
        alike = len({kind for kind, _, _ in heads}) == 1
        each = ", ".join(f"rank {r} {w}" + (f" ({n} optimizer steps taken)" if k != "periodic" else "")
                         for r, (k, n, w) in enumerate(heads))
        what = "reached this replica check after different numbers of optimizer steps" if alike else \
            "met at different replica checks"
        raise ReplicasParted(f"the processes {what}: {each}; {APART}")


def unlike(strategy: Strategy, when: str, found: list) -> str | None:
    """None where every rank compares the same names, shapes and dtypes; else the line naming the first that
    differs."""
    everyone = layouts(strategy, found)
    if everyone is None:
        return None
    where = next((i for i, row in enumerate(zip(*everyone, strict=False)) if len(set(row)) > 1), None)
    what = ", ".join(f"rank {r}: {len(part)} entries" if where is None else f"rank {r}: {' '.join(part[where])}"
                     for r, part in enumerate(everyone))
    return f"{when}: the processes' models or optimizers are not built alike ({what}); build them alike"


def explain(strategy: Strategy, label: str, value: Any, fingerprint: torch.Tensor) -> str:
    """What differs, from collectives every rank takes alike: each rank's fingerprint of it, then each rank's
    value of a setting, or a tensor's largest difference from rank 0's."""
    world = strategy.world
    values = each(strategy, fingerprint).tolist()
    others = [r for r in range(1, world) if values[r] != values[0]]
    if not isinstance(value, torch.Tensor):
        shown = strategy.gather(stable(value))
        return f"{label} is {', '.join(f'{shown[r]} on rank {r}' for r in [0, *others])}"
    value = value.to_dense() if value.layout != torch.strided else value  # a sparse buffer: its values
    value = value.dequantize() if value.is_quantized else value  # a quantized one: its values as floats
    value = torch.view_as_real(value) if value.is_complex() else value  # a complex one: both parts
    reference = value.detach().clone()
    strategy.broadcast_tensor(reference, 0)
    gap = (value.detach().double() - reference.double()).abs()
    largest = each(strategy, gap.max() if gap.numel() else gap.new_zeros(())).tolist()
    worst = max(others, key=lambda r: largest[r] if largest[r] == largest[r] else float("inf"))  # nan first
    size = f"by up to {largest[worst]:.4g}" if largest[worst] else "in its bits only (-0.0 against 0.0, or NaNs)"
    alike = len(others) > 1 and len({values[r] for r in others}) == 1  # then rank 0 may be the odd one out
    on = f"rank{'s' * (len(others) > 1)} {', '.join(map(str, others))}{' (alike)' * alike}"
    size += f" (on rank {worst})" if len(others) > 1 and not alike else ""
    agree = [r for r in range(1, world) if r not in others]
    same = f"; rank{'s' * (len(agree) > 1)} {', '.join(map(str, agree))} agree{'s' * (len(agree) == 1)} with " \
           f"rank 0" if agree else ""
    buffer = " (a buffer: under ddp each forward copies rank 0's buffers to the others, so their own updates " \
             "are lost; reduce it over the processes, or update it alike on every rank)" \
        if label.startswith("buffer") else ""
    return f"{label} differs on {on} from rank 0's {size}{same}{buffer}"


def each(strategy: Strategy, value: torch.Tensor) -> torch.Tensor:
    """Every rank's `value` (a number), in rank order, on every rank: one small sum-reduce."""
    slots = torch.zeros(strategy.world, dtype=value.dtype, device=strategy.device)
    slots[strategy.rank] = value
    return strategy.all_reduce(slots, "sum").cpu()

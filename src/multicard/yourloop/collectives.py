"""Between processes: reductions, gathers and broadcasts of any structure of tensors and numbers, rank 0 going
first, and splitting work (inference inputs, evaluation outputs) over the processes.

Every function takes the strategy (its all_reduce, gather, broadcast and barrier are the collectives; one process
answers them itself) and is called on every rank, in the same order.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..data.parts import bounds
from ..errors import UsageError
from ..jobs.progress import watched
from ..jobs.protocol import CHECK_SHAPES
from ..jobs.trees import children, leaves, rebuild, remake
from ..strategies import Strategy
from .fingerprints import shape

OPS = ("sum", "mean", "max", "min")
# The shape check costs a collective of its own: 1.3-1.7% of a LeNet-5 ddp step on 2 loaded CPU cores (see
# docs/your-loop.md), over the 1% an always-on check may cost; so it is a debugging switch (CHECK_SHAPES=1).


def layouts(strategy: Strategy, found: list[tuple[str, Any]]) -> list | None:
    """None where every rank's `found` has the same places, shapes and dtypes: one collective of two numbers, a
    checksum max-reduced with its negation (equal everywhere only if max == -min); else every rank's, gathered."""
    layout = [(where, shape(value)) for where, value in found]
    crc = zlib.crc32(repr(layout).encode())  # not hash(): str hashes differ between processes
    seen = strategy.all_reduce(torch.tensor([crc, -crc], dtype=torch.int64, device=strategy.device), "max")
    return None if seen.tolist() == [crc, -crc] else strategy.gather(layout)


def check_shapes(strategy: Strategy, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Where the values' shapes or dtypes differ between the processes (layouts), one line names the first."""
    everyone = layouts(strategy, tensors)
    for rank, theirs in enumerate(everyone or ()):
        if theirs != everyone[strategy.rank]:
            ours, other = dict(everyone[strategy.rank]), dict(theirs)
            where = next((w for w in dict.fromkeys([*ours, *other]) if ours.get(w) != other.get(w)), "")
            raise UsageError(f"all_reduce: the value{where} is {ours.get(where, 'missing')} on rank "
                             f"{strategy.rank} but {other.get(where, 'missing')} on rank {rank}: every process must "
                             f"pass the same structure, shapes and dtypes")


def all_reduce(strategy: Strategy, value: Any, op: str = "sum") -> Any:
    """Each tensor or number in `value` (or a dict / list / tuple of them, nested) combined over all processes:
    sum, mean, max or min. New tensors, on the device each value was on; the structure kept."""
    if op not in OPS:
        raise UsageError(f"all_reduce op {op!r}: choose one of {', '.join(OPS)}")
    found = list(leaves(value))
    for where, leaf in found:
        if not isinstance(leaf, (torch.Tensor, int, float, bool)):
            raise UsageError(f"all_reduce: value{where} is a {type(leaf).__name__}: only tensors and numbers "
                             f"(in dicts, lists and tuples) can be reduced; use gather for other objects")
    tensors = [(where, torch.as_tensor(leaf)) for where, leaf in found]
    if strategy.world > 1 and os.environ.get(CHECK_SHAPES, "0") == "1":
        check_shapes(strategy, tensors)
    out = []
    for _, tensor in tensors:
        if op == "mean" and not tensor.is_floating_point():
            tensor = tensor.double()
        reduced = strategy.all_reduce(tensor.to(strategy.device), "sum" if op == "mean" else op)
        out.append((reduced / strategy.world if op == "mean" else reduced).to(tensor.device))
    return rebuild(value, iter(out))


def broadcast(strategy: Strategy, obj: Any, src: int = 0) -> Any:
    """Process `src`'s `obj` on every process (anything picklable; tensors land on the device each process's
    own `obj` was on, or this process's device where its `obj` is not a tensor)."""
    if not 0 <= src < strategy.world:
        raise UsageError(f"broadcast src={src}: the job has ranks 0 to {strategy.world - 1}")
    if strategy.world == 1:
        return obj
    # src says first what it sends, and every rank follows that (not what it passed itself): a tensor on src and
    # a dict elsewhere still meet in the same collectives. A tensor goes as a tensor, after its shape and dtype.
    sending = isinstance(obj, torch.Tensor) and strategy.rank == src
    head = strategy.broadcast(("tensor", tuple(obj.shape), obj.dtype) if sending else ("object", obj), src)
    if head[0] == "object":
        return head[1]
    device = obj.device if isinstance(obj, torch.Tensor) else strategy.device
    buffer = obj.to(strategy.device) if sending else torch.empty(head[1], dtype=head[2], device=strategy.device)
    return strategy.broadcast_tensor(buffer.clone(), src).to(device)


@contextlib.contextmanager
def rank_zero_first(strategy: Strategy, local: bool = False) -> Iterator[None]:
    """Rank 0 (local=True: each machine's local rank 0) runs the body while the others wait; then they run it
    (reading what it downloaded or cached). Every process must enter it."""
    first = (strategy.job.local_rank if local else strategy.rank) == 0
    if not first:
        with watched():
            strategy.barrier()
    yield
    if first:
        with watched():
            strategy.barrier()


def split(strategy: Strategy, inputs: Any) -> Any:
    """This process's contiguous part of `inputs` (a list, tuple, tensor or other sliceable sequence, or a dict
    of them): parts differ by at most one item, rank 0's first; concatenated in rank order they are `inputs`.
    Inference over a list, kept contiguous for that; a training batch is cut by mc.local (data/parts.py)."""
    if isinstance(inputs, Mapping):
        return remake(inputs, [split(strategy, v) for v in inputs.values()])
    if not hasattr(inputs, "__getitem__") or not hasattr(inputs, "__len__"):
        raise UsageError(f"split takes a list, tuple, tensor or dict of them, not {type(inputs).__name__}")
    start, stop = bounds(len(inputs), strategy.rank, strategy.world)
    return inputs[start:stop]


def gather_in_order(strategy: Strategy, outputs: Any, total: int | None = None) -> Any:
    """Per-sample outputs from every process, back in order: rank r holds rows r, r+N, r+2N, ... (a pass of a
    train=False loader, or one batch of it, every process holding the same number of batches; one batch cut by
    mc.local or a loader read whole; a DistributedSampler without shuffle), so the parts are interleaved.
    `outputs`: this process's per-sample results in its order: a tensor (one row per sample), a list of
    per-sample values, or a dict / tuple / namedtuple / dataclass of these, each its own type again (predictions
    and labels together stay paired; another value beside them, a string, is rank 0's). `total` (the
    dataset's size) drops what is beyond it: the padding a DistributedSampler repeats. Every process gets the
    whole result."""
    parts = strategy.gather(_to_cpu(outputs))
    for rank, part in enumerate(parts[1:], 1):
        if structure(part) != structure(parts[0]):
            raise UsageError(f"gather_in_order: rank 0 passed {structure(parts[0])}, rank {rank} "
                             f"{structure(part)}: every process must pass the same structure")
    merged = _interleave(parts, total)
    return _move(merged, outputs)


def structure(obj: Any) -> str:
    """What gather_in_order needs to agree across ranks, in words: dicts' keys, tuples' lengths (namedtuples' and
    dataclasses' fields), and at the leaves a tensor (with its trailing shape) or a list."""
    found = None if isinstance(obj, list) else children(obj)
    if isinstance(obj, Mapping):
        return "{" + ", ".join(f"{k!r}: {structure(v)}" for k, v in obj.items()) + "}"
    if found is not None:
        return f"{'' if type(obj) is tuple else type(obj).__name__}({', '.join(structure(v) for v in found)})"
    if isinstance(obj, torch.Tensor):
        return f"a tensor of rows {tuple(obj.shape[1:])}"
    return "a list" if isinstance(obj, list) else f"a {type(obj).__name__}"


def _interleave(parts: list, total: int | None) -> Any:
    first = parts[0]
    found = None if isinstance(first, list) else children(first)
    if found is not None:  # a structure: each of its places interleaved, its type kept
        each = [children(p) for p in parts]
        return remake(first, [_interleave([c[i] for c in each], total) for i in range(len(found))])
    if not isinstance(first, (torch.Tensor, list)):  # not per-sample (a string, a number beside them): rank 0's
        return first
    lengths = [len(p) for p in parts]
    if lengths != sorted(lengths, reverse=True) or lengths[0] - lengths[-1] > 1:
        raise UsageError(f"gather_in_order: the processes hold {lengths} samples; round-robin shards differ by at "
                         f"most one, the first ranks holding more (pass per-sample outputs of an evaluation loader)")
    world, starts = len(parts), [sum(lengths[:r]) for r in range(len(parts))]
    size = min(sum(lengths), total) if total is not None else sum(lengths)
    where = [starts[i % world] + i // world for i in range(size)]  # sample i sits at row i // N of rank i % N
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)[torch.tensor(where, dtype=torch.long)]
    flat = [item for part in parts for item in part]
    return [flat[i] for i in where]


def _to_cpu(obj: Any) -> Any:
    return rebuild(obj, (t.cpu() if isinstance(t, torch.Tensor) else t for _, t in leaves(obj)))


def _move(merged: Any, like: Any) -> Any:
    """Tensors back onto the device of the outputs passed in (the gather went through the CPU)."""
    device = next((t.device for _, t in leaves(like) if isinstance(t, torch.Tensor)), None)
    if device is None:
        return merged
    return rebuild(merged, (t.to(device) if isinstance(t, torch.Tensor) else t for _, t in leaves(merged)))

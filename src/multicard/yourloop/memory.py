"""Memory: per card from torch.cuda's own statistics, or per process (peak RSS) on the CPU; and, where NVML can be
read, what the driver says is in use on each card."""

from __future__ import annotations

import resource
import sys

import torch

from ..jobs.trees import values

MB = 2**20


def reset(cards: list[int]) -> None:
    for card in cards:
        torch.cuda.reset_peak_memory_stats(card)


def peak_mb(cards: list[int]) -> list[float]:
    """Peak bytes allocated by tensors on each card; with no cards, this process's peak resident memory."""
    if cards:
        return [round(torch.cuda.max_memory_allocated(card) / MB, 1) for card in cards]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return [round(rss / (MB if sys.platform == "darwin" else 1024), 1)]


def card_used_mb(cards: list[int]) -> list[float]:
    """Memory in use on each card now, as NVML (nvidia-smi's source) reports it: tensors, the caching allocator's
    reserve and the CUDA context, and whatever other processes hold on that card. It is read once, at the end of a
    run: not a peak (NVML keeps none). It is usually above torch's peak allocated, by the context and the reserve,
    but can be below it where the allocator gave memory back during the run (measured on an H100: ResNet-8 at
    batch 16,384 peaked at 26,115 MB allocated, and NVML read 20,933 MB at the end). [] where NVML cannot be read
    (no nvidia-ml-py, no driver, no cards): it is an extra, never a reason to fail a run."""
    try:
        return [round(torch.cuda.device_memory_used(card) / MB, 1) for card in cards]
    except Exception:  # ModuleNotFoundError, NVMLError, RuntimeError, ...: all mean "not available here"
        return []


def shard_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this process holds of the model's parameters, of their gradients and of the optimizer's state:
    {"params": ..., "grads": ..., "optimizer": ...}. Of a DTensor (fsdp's sharded parameters, their gradients and
    the optimizer's moments) only the local shard counts. Every byte of a storage counts once in each entry: a
    parameter shared between modules (tied weights), and views of one storage that overlap, are not counted
    twice; a storage's bytes that no tensor looks at (padding) are not counted. Computed from the tensors'
    shapes, so exact on any device (CPU, card, meta) and not disturbed by the allocator or other processes."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [] if optimizer is None else [t for t in values(optimizer.state) if isinstance(t, torch.Tensor)]
    return {"params": _held(params), "grads": _held(grads), "optimizer": _held(state)}


def _held(tensors: list[torch.Tensor]) -> int:
    """Bytes covered by these tensors (DTensors: their local shard), each byte of each storage once."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without torch.distributed: there are no DTensors then
        DTensor = ()

    spans: dict[object, list[tuple[int, int]]] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.numel() == 0:
            continue
        size = t.element_size()
        start = t.storage_offset() * size
        # from its first element to past its last one (numel() elements where it is contiguous)
        end = start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * size
        # the storage's address on its device; meta tensors have none (each its own, shared ones are one object)
        key = id(t) if t.is_meta else (t.device, t.untyped_storage().data_ptr())
        spans.setdefault(key, []).append((start, end))
    total = 0
    for ranges in spans.values():  # the union of each storage's byte ranges
        reach = -1
        for start, end in sorted(ranges):
            total += max(0, end - max(start, reach))
            reach = max(reach, end)
    return total


class Memory:
    """Methods of Multicard (uses its cards)."""

    def peak_memory_mb(self) -> list[float]:
        """This process's peak: torch's peak allocated on each of its cards, or its peak resident memory."""
        return peak_mb(self.cards)

    def card_used_mb(self) -> list[float]:
        """What NVML says is in use on each of this process's cards now ([] where it cannot be read)."""
        return card_used_mb(self.cards)

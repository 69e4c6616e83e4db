"""Memory: per card from torch.cuda's own statistics, or per process (peak RSS) on the CPU; and, where NVML can be
read, what the driver says is in use on each card."""

from __future__ import annotations

import resource
import sys

import torch

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

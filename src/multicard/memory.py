"""Peak memory: per card from torch.cuda's own statistics, or per process (peak RSS) on the CPU."""

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

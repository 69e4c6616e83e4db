"""What the replica check (replicas.py) compares, and the fingerprint of it that the processes exchange.

What must be equal on every rank: each set-up model's parameters (not fsdp's shards: each element lives in one
process) and buffers (not normalization layers' running statistics, which differ per process on purpose), and each
set-up optimizer's settings. A fingerprint is exact: a tensor's bits read as integers and summed by position
modulo a prime, two numbers per tensor (the plain sum and the sum weighted by position). Integer sums (wrapping
around) do not depend on the order of a reduction, so equal tensors give equal numbers on any device and thread
count, and a flipped bit, a sign, or two values swapped (unless a multiple of the prime apart) change them.
"""

from __future__ import annotations

import dataclasses
import re
import struct
import zlib
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

PRIME = 4093  # positions are weighed modulo this
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # in a repr: an object's address, which differs between processes


def entries(models: list[tuple[str, nn.Module]], params: bool, optimizers: list) -> list[tuple[str, Any]]:
    """(label, tensor or setting) of what must be equal on every rank: each model's parameters (unless sharded)
    and buffers (not normalization layers' running statistics, which differ on purpose), each optimizer's
    settings (lr, betas, ...)."""
    found: list[tuple[str, Any]] = []
    for name, model in models:
        of = f" of {name}" if len(models) > 1 else ""
        if params:
            found += [(f"parameter {key}{of}", p) for key, p in model.named_parameters()]
        for path, module in model.named_modules():
            if not isinstance(module, _NormBase):
                found += [(f"buffer {path + '.' if path else ''}{key}{of}", b)
                          for key, b in module.named_buffers(recurse=False)]
    for i, optimizer in enumerate(optimizers):
        whose = "the optimizer's" if len(optimizers) == 1 else f"optimizer {i}'s"
        for g, group in enumerate(optimizer.param_groups):
            for key in sorted(k for k in group if k != "params"):
                found.append((f"{whose} {key} (param group {g})", group[key]))
    return found


def shape(value: Any) -> str:
    """What must agree before values are compared: a tensor's shape and dtype (a setting's value is compared)."""
    if isinstance(value, torch.Tensor):
        layout = "" if value.layout == torch.strided else f" {str(value.layout).removeprefix('torch.')}"
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}{layout}"
    return "(a setting)"


def fingerprints(found: list, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """One int64 vector on `device`: one number per setting, then two per tensor (their sum, and their sum
    weighted by position); and for each place in it, the entry of `found` it belongs to."""
    numbers = [(i, number(v)) for i, (_, v) in enumerate(found) if not isinstance(v, torch.Tensor)]
    tensors = [(i, v) for i, (_, v) in enumerate(found) if isinstance(v, torch.Tensor)]
    parts = [torch.tensor([n for _, n in numbers], dtype=torch.int64, device=device)]
    if tensors:
        sums = torch.stack([column_sums(v).to(device) for _, v in tensors])
        weights = torch.arange(1, PRIME + 1, dtype=torch.int64, device=device)
        parts.append(torch.stack([sums.sum(1), (sums * weights).sum(1)], 1).flatten())
    return torch.cat(parts), [i for i, _ in numbers] + [i for i, _ in tensors for _ in range(2)]


def column_sums(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as 32-bit integers, summed by position modulo PRIME: PRIME int64 numbers. The sums wrap
    around at 2**32: still exact and order-free, and ~25x faster on the CPU than sums that widen each element."""
    if tensor.layout != torch.strided:  # sparse (a buffer ddp leaves alone): its indices, then its values
        coo = tensor.detach().to_sparse_coo().coalesce()
        return column_sums(coo.indices()) + column_sums(coo.values())
    if tensor.is_quantized:  # its values as floats (the scale and zero point count); its own bits cannot be viewed
        tensor = tensor.detach().dequantize()
    flat = torch.view_as_real(tensor.detach()) if tensor.is_complex() else tensor.detach()
    flat = flat.reshape(-1)  # a copy only of a tensor that is not contiguous
    size = flat.element_size()
    whole = size >= 4 or (flat.numel() * size % 4 == 0 and flat.storage_offset() * size % 4 == 0)
    bits = flat.view(torch.int32 if whole else torch.int16 if size == 2 else torch.uint8)
    rows = bits.numel() // PRIME
    sums = bits[:rows * PRIME].view(rows, PRIME).sum(0, dtype=torch.int32)
    left = bits[rows * PRIME:]  # the last, short row
    sums[:left.numel()] += left
    return sums.long()


def number(value: Any) -> int:
    """A setting as an int64: a number's float64 bits, else a checksum of its stable text (the same in every
    process that holds the same value: stable())."""
    if isinstance(value, (bool, int, float)):
        return struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return zlib.crc32(stable(value).encode())


def stable(value: Any, blind: list[str] | None = None) -> str:
    """A setting's text, the same in every process that holds the same value: a set's items sorted (their order
    follows each process's string hashes), and an object whose repr names its address (`<Thing object at 0x...>`,
    a function) by its type alone, as `<Thing>` (its address differs between processes, its value is not shown);
    the names of such types are appended to `blind`."""
    if isinstance(value, (set, frozenset)):
        items = "{" + ", ".join(sorted(stable(v, blind) for v in value)) + "}"
        return items if type(value) is set else f"{type(value).__name__}({items})"
    if type(value) in (list, tuple):
        items = ", ".join(stable(v, blind) for v in value)
        return f"[{items}]" if type(value) is list else f"({items}{',' * (len(value) == 1)})"
    if type(value) is dict:
        return "{" + ", ".join(f"{stable(k, blind)}: {stable(v, blind)}" for k, v in value.items()) + "}"
    fields = value._asdict() if isinstance(value, tuple) and hasattr(value, "_asdict") else \
        {f.name: getattr(value, f.name) for f in dataclasses.fields(value)} \
        if dataclasses.is_dataclass(value) and not isinstance(value, type) else None
    if fields is not None:  # a namedtuple's or dataclass's fields, each by value
        return f"{type(value).__qualname__}({', '.join(f'{k}={stable(v, blind)}' for k, v in fields.items())})"
    text = repr(value)
    if not ADDRESS.search(text):
        return text
    if blind is not None:
        blind.append(type(value).__qualname__)
    return f"<{type(value).__qualname__}>"

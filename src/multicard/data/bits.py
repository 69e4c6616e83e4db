"""A batch's fingerprint, compared between the processes where each must hold the same batch (mc.local's global
batch, a set-up model's first inputs, a loader every process reads whole): exact and readable for any batch.

Each tensor's bits are read as integers of its element's width (a float's, a bool's, a complex number's, an 8-bit
float's alike; a quantized tensor by its values), so equal tensors give equal numbers on every process, NaNs
included, and integer sums (wrapping) do not depend on the order of a reduction. Only the first values of each
tensor are read: a bounded cost whatever the batch's size. A tensor with no values (zero rows, a zero-size
dimension) is read by its shape and dtype alone.
"""

from __future__ import annotations

import math
import zlib

import torch

FIRST = 4096  # values of a tensor its fingerprint reads
INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # the integers of each element width


def fingerprint(tensors: list[torch.Tensor], device: torch.device, first: int = FIRST) -> torch.Tensor:
    """Three int64 numbers on `device`: a checksum of the tensors' shapes and dtypes, and the sum and
    position-weighted sum of each one's first `first` values read as integers, weighted by the tensor's place."""
    total = torch.zeros(3, dtype=torch.int64, device=device)
    for k, tensor in enumerate(tensors, 1):
        values = head(tensor, first).long()
        place = torch.arange(1, len(values) + 1, dtype=torch.int64, device=values.device)
        kind = zlib.crc32(f"{tuple(tensor.shape)} {tensor.dtype} {tensor.layout}".encode())
        numbers = torch.stack([values.new_tensor(kind), values.sum(), (values * place).sum()])
        total += numbers.to(device) * k
    return total


def head(tensor: torch.Tensor, first: int = FIRST) -> torch.Tensor:
    """The bits of the first `first` values of `tensor` (in its own order), as a flat tensor of integers of the
    element's width; no copy of a whole batch that is not contiguous."""
    t = tensor.detach()
    if t.layout != torch.strided:  # sparse: its indices, then its values
        t = t.to_sparse_coo().coalesce() if t.layout != torch.sparse_coo else t.coalesce()
        return torch.cat([head(t.indices(), first).long(), head(t.values(), first).long()])[:first]
    if t.is_quantized:  # its values as floats: the scale and zero point count
        t = t.dequantize()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dim() and t.shape[0]:  # the rows that hold the first values
        t = t[:max(1, -(-first // max(1, math.prod(t.shape[1:]))))]
    flat = t.reshape(-1)[:first]
    return flat.view(INTS[flat.element_size()]) if flat.dtype not in INTS.values() else flat

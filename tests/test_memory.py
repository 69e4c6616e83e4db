"""memory.shard_bytes: the bytes a process holds of parameters, gradients and optimizer state, counted from the
tensors themselves: a plain model, tied weights counted once, and fully_shard's DTensors counted by their local
shard (2 gloo processes); and the wide-mlp model that the fsdp benchmark uses."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from multicard import models
from multicard.jobs.launcher import free_port
from multicard.models.wide_mlp import WideMLP
from multicard.yourloop.memory import shard_bytes


def nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_plain_model_params_grads_and_adam_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))
    optimizer = torch.optim.Adam(model.parameters())
    full = nbytes(model)
    assert full == (10 * 20 + 20 + 20 * 3 + 3) * 4
    assert shard_bytes(model, optimizer) == {"params": full, "grads": 0, "optimizer": 0}
    model(torch.randn(4, 10)).sum().backward()
    assert shard_bytes(model) == {"params": full, "grads": full, "optimizer": 0}
    optimizer.step()
    steps = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
    assert 0 < steps <= 4 * 8  # one small step tensor per parameter (4 of them)
    assert shard_bytes(model, optimizer)["optimizer"] == 2 * full + steps  # exp_avg and exp_avg_sq
    model.half()
    assert shard_bytes(model)["params"] == full // 2


def test_tied_weights_and_shared_storage_count_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.out = nn.Linear(8, 50, bias=False)
            self.out.weight = self.embed.weight  # one parameter, two modules

    model = Tied()
    assert shard_bytes(model)["params"] == 50 * 8 * 4
    flat = torch.zeros(100)  # two parameters viewing one storage (as a flat buffer would), plus a full alias
    holder = nn.Module()
    holder.a, holder.b = nn.Parameter(flat[:60]), nn.Parameter(flat[40:])
    holder.c = nn.Parameter(flat)
    assert shard_bytes(holder)["params"] == 100 * 4
    holder.c = nn.Parameter(torch.zeros(7, dtype=torch.float64))
    assert shard_bytes(holder)["params"] == 100 * 4 + 7 * 8


def _sharded(rank: int, world: int, port: int, out) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 33), nn.ReLU(), nn.Linear(33, 5))
        full = nbytes(model)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        held = shard_bytes(model, optimizer)
        # a row of each parameter (dim 0 is split over the processes), the most rounding can move one share
        row = sum(p.numel() * p.element_size() // p.shape[0] for p in model.parameters())
        out.put((rank, full, row, held))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dtensor_shards_count_their_local_part():
    world = 2
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_sharded, args=(world, free_port(), out), nprocs=world, start_method="spawn")
    results = sorted(out.get() for _ in range(world))
    full = results[0][1]
    assert sum(held["params"] for _, _, _, held in results) == full  # the shards add up to the model
    for _, _, row, held in results:
        assert abs(held["params"] - full / world) <= row
        assert held["grads"] == held["params"]
        assert 2 * held["params"] <= held["optimizer"] <= 2 * held["params"] + 5 * 8  # moments + step tensors


def test_wide_mlp_is_registered_and_its_size():
    assert models.MODELS["wide-mlp"] is WideMLP and WideMLP.input_shape == (1, 28, 28)
    small = WideMLP(width=32, depth=3)
    blocks = 3 * (2 * 32 + 32 * 32 + 32)
    assert sum(p.numel() for p in small.parameters()) == 784 * 32 + 32 + blocks + 2 * 32 + 32 * 10 + 10
    assert isinstance(small.blocks, nn.ModuleList) and len({type(b) for b in small.blocks}) == 1
    torch.manual_seed(0)
    a = WideMLP(width=32, depth=3)
    torch.manual_seed(0)
    b = WideMLP(width=32, depth=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert a(torch.randn(5, 1, 28, 28)).shape == (5, 10)


def test_wide_mlp_default_size_without_allocating():
    with torch.device("meta"):
        model = WideMLP()
    assert sum(p.numel() for p in model.parameters()) == 104_001_546
    assert shard_bytes(model)["params"] == 104_001_546 * 4


def test_wide_mlp_learns():
    torch.manual_seed(0)
    model = WideMLP(width=64, depth=2)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(20):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


if __name__ == "__main__":
    pytest.main([__file__])

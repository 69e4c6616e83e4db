"""Parameters outside the set-up models, kept where multicard owns the step (yourloop/outside_params.py): a set-up
optimizer's parameters that no set-up model holds are averaged when it steps, as its param groups stand then
(unfrozen later, swapped in, added, used on some ranks only, sparse); saves are paired by the job's steps, which
an optimizer of one rank's own does not move; mc.local_optimizer says an optimizer is this process's own, and the
replica check goes on for everything else. Each case on 2 processes (3 where ranks differ) against one process's
steps, replayed beside the job on a plain model."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

import multicard
from multicard.errors import UsageError

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 4, generator=G), torch.randn(48, 1, generator=G)
STEPS = 8
CASES = ("frozen", "swapped", "some_ranks", "sparse")


def built(extra: int = 1, sparse: bool = False):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    ts = [nn.Parameter(torch.ones(())) for _ in range(extra)]
    table = nn.Embedding(6, 1, sparse=True) if sparse else None
    return model, ts, table


def train(mc, model, ts, optimizer, table=None, case="frozen", plain=False):
    """STEPS steps over the global batches; each process takes its part (the plain replay: all of it)."""
    for step in range(STEPS):
        batch = slice(6 * step, 6 * step + 6)
        x, y = (X[batch], Y[batch]) if plain else (mc.local(X[batch]), mc.local(Y[batch]))
        if case == "frozen" and step == 5:  # unfrozen at step 5 (frozen at setup)
            ts[0].requires_grad_(True)
        if case == "swapped" and step == 3:  # a fresh temperature in its place
            fresh = nn.Parameter(ts[0].detach().clone() + 0.5)
            optimizer.param_groups[0]["params"][-1] = fresh
            ts[0] = fresh
        optimizer.zero_grad()
        out = model(x)
        if case == "some_ranks":  # the temperature used for the rows of process 0 only: one process uses it for
            k = len(range(0, 6, mc.world_size))  # those rows too (the global batch's rows 0, N, 2N, ...)
            if plain:
                mine = torch.zeros(6, 1, dtype=torch.bool)
                mine[::mc.world_size] = True
                out = torch.where(mine, out * ts[0], out)
            elif mc.rank == 0:
                out = torch.cat([out[:k] * ts[0], out[k:]])
        else:
            out = out * ts[0]
        if table is not None:
            index = torch.arange(6) if plain else mc.local(torch.arange(6))
            out = out + table(index)
        nn.functional.mse_loss(out, y).backward()
        optimizer.step()


def cases_job(mc) -> dict:
    """Every case, each on a Multicard of its own in the job's processes (the group shared)."""
    found = {}
    for case in CASES:
        with multicard.Multicard("ddp", f"cpu:{mc.world_size}") as run:
            found[case] = case_job(run, case)
    return found


def case_job(mc, case: str) -> dict:
    model, ts, table = built(sparse=case == "sparse")
    if case == "frozen":
        ts[0].requires_grad_(False)
    groups = [{"params": [*model.parameters(), *ts]}] + ([{"params": table.parameters(), "lr": 0.5}] if table else [])
    optimizer = torch.optim.SGD(groups, lr=0.1)
    model, optimizer = mc.setup(model, optimizer)
    train(mc, model, ts, optimizer, table, case)
    alone, alone_ts, alone_table = built(sparse=case == "sparse")
    if case == "frozen":
        alone_ts[0].requires_grad_(False)
    alone_groups = [{"params": [*alone.parameters(), *alone_ts]}] + (
        [{"params": alone_table.parameters(), "lr": 0.5}] if alone_table else [])
    alone_optimizer = mc.local_optimizer(torch.optim.SGD(alone_groups, lr=0.1))
    train(mc, alone, alone_ts, alone_optimizer, alone_table, case, plain=True)
    mine = [ts[0].item(), *model.weight.flatten().tolist()] + (table.weight.flatten().tolist() if table else [])
    plain = [alone_ts[0].item(), *alone.weight.flatten().tolist()] + (
        alone_table.weight.flatten().tolist() if alone_table else [])
    return {"ranks": mc.gather(mine), "plain": plain, "check": mc.check_replicas()}


@pytest.fixture(scope="module")
def cases() -> dict:
    return multicard.launch(cases_job, strategy="ddp", devices="cpu:2")


@pytest.mark.parametrize("case", CASES)
def test_a_set_up_optimizers_outside_parameters_take_one_process_steps_as_they_stand_at_each_step(cases, case):
    found = cases[case]
    ranks, plain = found["ranks"], found["plain"]
    assert ranks[0] == ranks[1], ranks  # the processes agree to the bit
    assert max(abs(a - b) for a, b in zip(ranks[0], plain, strict=True)) < 1e-5, (ranks[0], plain)
    assert found["check"] is True


def probe_job(mc, folder: str) -> dict:
    """A probe trained on rank 0 alone, its optimizer the process's own, between the job's steps; then a save on
    every rank and a load: rank 1's streams come back (the saves paired by the job's steps)."""
    model, _, _ = built(0)
    model, optimizer = mc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    probe = nn.Linear(4, 1)
    probe_optimizer = mc.local_optimizer(torch.optim.SGD(probe.parameters(), lr=0.1))
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(mc.local(X[:6])), mc.local(Y[:6])).backward()
        optimizer.step()
        if mc.is_main:  # the probe: rank 0 alone, twice a step
            for _twice in range(2):
                probe_optimizer.zero_grad()
                probe(X[:6]).sum().backward()
                probe_optimizer.step()
    torch.manual_seed(40 + mc.rank)
    streams = torch.get_rng_state()
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        mc.save(f"{folder}/ckpt.pt", {"model": model})
        mc.barrier()  # rank 0 wrote it (a save is no collective outside fsdp)
        torch.manual_seed(999)
        mc.load(f"{folder}/ckpt.pt", {"model": model})
    back = torch.equal(torch.get_rng_state(), streams)
    with torch.no_grad():  # the replica check goes on for what the job set up
        model.weight.add_(0.25 if mc.rank == 1 else 0.0)
    try:
        mc.check_replicas()
        parted = None
    except UsageError as e:
        parted = str(e)
    return {"back": mc.gather(back), "said": mc.gather(said.getvalue()), "steps": mc.gather(mc._job_state.steps),
            "parted": mc.gather(parted)}


def test_an_optimizer_of_one_ranks_own_moves_neither_the_pairing_of_saves_nor_the_replica_check(tmp_path):
    found = multicard.launch(probe_job, str(tmp_path), strategy="ddp", devices="cpu:2")
    assert found["steps"] == [3, 3]  # the job's steps: the probe's six on rank 0 are its own
    assert found["back"] == [True, True], found["said"]  # every rank's streams came back from the one file
    assert found["said"] == ["", ""]
    assert all(p is not None and "the replicas parted" in p for p in found["parted"]), found["parted"]


def stray_job(mc) -> str | None:
    """A plain optimizer over a model nobody set up, with no mc.local_optimizer: its first step is one line."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(mc.local(X[:6])).sum().backward()
    try:
        optimizer.step()
    except UsageError as e:
        return str(e)
    return None


def test_a_stray_optimizer_is_told_of_the_narrow_opt_out():
    line = multicard.launch(stray_job, strategy="ddp", devices="cpu:2")
    assert line is not None and line.endswith("where each process should train its own, "
                                              "mc.local_optimizer(optimizer)"), line

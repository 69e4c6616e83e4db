"""Random draws that cannot part silently (yourloop/inputs_alike.py): mc.randn_local and mc.rand_local draw what the
plain script draws (one process's global batch, each process keeping its rows); a draw on some ranks only (an
EMA's sample under `if mc.is_main:`) parts the processes' random states, and the next step the job takes says
so in one line, naming the steps between which they parted and how to keep such a draw off the shared stream,
never blaming a seed that is there. Seeded apart from the start, the line says to seed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multicard
from multicard.errors import UsageError

STEPS = 8


def draws_job(mc, how: str) -> dict:
    torch.manual_seed(0 if how != "unseeded" else mc.rank)
    model = nn.Linear(4, 1)
    model, optimizer = mc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    drawn, line = [], None
    try:
        for step in range(1, STEPS + 1):
            noise = mc.randn_local(6, 4) if step % 2 else mc.rand_local(6, 4)
            drawn.append(noise)
            optimizer.zero_grad()
            model(noise).pow(2).mean().backward()
            optimizer.step()
            if step == 5 and mc.is_main:  # after step 5: an EMA's sample, on rank 0 alone
                with torch.random.fork_rng() if how == "forked" else torch.enable_grad():
                    torch.randn(3)
    except UsageError as e:
        line = str(e)
    return {"drawn": mc.gather(drawn), "line": mc.gather(line)}


def every_case(mc) -> dict:
    """Each way of drawing on a Multicard of its own, in the job's processes (the group shared)."""
    found = {}
    for how in ("forked", "rank_0_draws", "unseeded"):
        with multicard.Multicard("ddp", f"cpu:{mc.world_size}") as run:
            found[how] = draws_job(run, how)
    return found


@pytest.fixture(scope="module")
def two() -> dict:
    return multicard.launch(every_case, strategy="ddp", devices="cpu:2")


def plain_draws() -> list[torch.Tensor]:
    """The plain script's draws on one process: the same seed, the model built, then each step's global batch."""
    torch.manual_seed(0)
    nn.Linear(4, 1)
    return [torch.randn(6, 4) if step % 2 else torch.rand(6, 4) for step in range(1, STEPS + 1)]


def test_a_draw_kept_off_the_shared_stream_leaves_the_processes_drawing_one_process_batches(two):
    found = two["forked"]
    assert found["line"] == [None, None]
    for step, whole in enumerate(plain_draws()):
        for rank in (0, 1):
            assert torch.equal(found["drawn"][rank][step], whole[rank::2])


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_draw_on_one_rank_only_is_one_line_at_the_next_step_naming_where_the_streams_parted(world, request):
    found = request.getfixturevalue("two")["rank_0_draws"] if world == 2 else \
        multicard.launch(draws_job, "rank_0_draws", strategy="ddp", devices=f"cpu:{world}")
    assert len(found["drawn"][0]) == 8  # compared after 1, 2, 4, 8 forwards with draws: caught at the 8th
    line = found["line"][0]
    assert found["line"] == [line] * world
    assert line.startswith("a draw of mc.randn_local or rand_local, between optimizer steps 4 and 8: the processes' "
                           "random states parted there (alike before): a draw on some ranks only, such as a sample "
                           "under `if mc.is_main:`"), line
    assert "with torch.random.fork_rng():" in line and "manual_seed" not in line


def test_processes_seeded_apart_are_told_to_seed_alike(two):
    found = two["unseeded"]
    line = found["line"][0]
    assert len(found["drawn"][0]) == 1 and found["line"] == [line, line]
    assert line.startswith("a draw of mc.randn_local or rand_local, before optimizer step 1: the processes passed "
                           "different global batches"), line
    assert "torch.manual_seed(0) at the top of the script" in line and "fork_rng" not in line


def test_one_process_draws_the_plain_scripts_numbers():
    found = multicard.launch(draws_job, "rank_0_draws", strategy="single", devices="cpu")
    assert found["line"] == [None]
    # rank 0's own draw after step 5 moved the one stream: the plain script draws past it too
    torch.manual_seed(0)
    nn.Linear(4, 1)
    plain = []
    for step in range(1, STEPS + 1):
        plain.append(torch.randn(6, 4) if step % 2 else torch.rand(6, 4))
        if step == 5:
            torch.randn(3)
    assert all(torch.equal(a, b) for a, b in zip(found["drawn"][0], plain, strict=True))

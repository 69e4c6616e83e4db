"""Issue 40, items 1-4, and issue 39, item 6's second half: the seams, where a script does what multicard never set
up. On 2+ processes an optimizer step over parameters no set-up model holds stops with one line; a set-up
optimizer's parameter outside the model (a temperature) is averaged and in the replica check; mc.local on batches
the processes drew apart stops with one line that says to seed; a set-up model fed every batch in every process is
said once; a save on any rank is written, its random streams those of the save they were taken at. On one process
none of it applies. Correct loops (a set-up loader, an IterableDataset, mc.local seeded alike, a script's own
sharding, evaluation alone, a DDP the script built itself) stay silent. 2 processes here, 1 and 3 in the slow
suite; the docs' loops and the trainer are held silent in test_docs.py and test_ddp.py (SEAMS)."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import multicard
from conftest import ROOT
from multicard.checkpoints import files as checkpoint
from multicard.errors import UsageError
from multicard.yourloop.inputs_alike import Inputs
from multicard.yourloop.multicard import Multicard

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 4, generator=G), torch.randn(48, 1, generator=G)  # the same in every process
SEAMS = ("first training batch is the same", "mc.local (call", "that no set-up model holds",
         "no other rank saved it along", "rank 0 wrote it before")  # the lines of this file's checks


def fresh(mc: Multicard) -> None:
    """Each case below is a script of its own: its first training forward is the job's first again."""
    job = mc._job_state
    job.inputs = Inputs(job)
    job.warned.clear()


def outcome(fn) -> tuple[str | None, str]:
    """(the one line fn stopped with, or None; what it printed on stderr)."""
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        try:
            fn()
        except UsageError as e:
            return str(e), said.getvalue()
    return None, said.getvalue()


def loop(model, optimizer, batches, t: torch.Tensor | None = None) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        out = model(x) * t if t is not None else model(x)
        nn.functional.mse_loss(out, y).backward()
        optimizer.step()


def batches(size: int = 12) -> DataLoader:
    return DataLoader(TensorDataset(X, Y), batch_size=size)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(zip(X, Y, strict=True))


def model_and_optimizer(mc: Multicard | None = None, extra: list | None = None):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD([*model.parameters(), *(extra or [])], lr=0.1)
    return (model, optimizer) if mc is None else mc.setup(model, optimizer)


# -- item 1: a model or optimizer never set up; a loader never set up --------------------------------------------------
def unset_case(mc: Multicard) -> None:
    model, optimizer = model_and_optimizer()
    loop(model, optimizer, mc.setup_dataloader(batches()))


def outside_case(mc: Multicard) -> None:
    t = nn.Parameter(torch.ones(()))
    model = mc.setup(nn.Linear(4, 1))
    loop(model, torch.optim.SGD([*model.parameters(), t], lr=0.1), mc.setup_dataloader(batches()), t)


def in_mode(mc: Multicard, mode: str, case, **options) -> tuple[str | None, str]:
    """`case` under a second Multicard of the job (its replica check mode and K are the newest)."""
    second = Multicard("ddp", f"cpu:{mc.world_size}", replica_check=mode, **options)
    try:
        return outcome(lambda: case(second))
    finally:
        second.close()


def every_batch_case(mc: Multicard) -> None:
    model, optimizer = model_and_optimizer(mc)
    loop(model, optimizer, batches())  # the plain loader: every process reads every batch


def silent_cases(mc: Multicard) -> dict[str, tuple[str | None, str]]:
    """Correct loops, each the process's first training forward."""
    rank, world = mc.rank, mc.world_size

    def loader() -> None:
        model, optimizer = model_and_optimizer(mc)
        loop(model, optimizer, mc.setup_dataloader(batches()))
        loop(model, optimizer, mc.setup_dataloader(DataLoader(Stream(), batch_size=12)))

    def local() -> None:
        model, optimizer = model_and_optimizer(mc)
        torch.manual_seed(5)  # alike in every process
        order = torch.randperm(len(X))
        loop(model, optimizer, [(mc.local(X[order[i:i + 12]]), mc.local(Y[order[i:i + 12]])) for i in (0, 12)])

    def own_sharding() -> None:  # a GPT-2 trainer's hand-written shards, or a DistributedSampler of its own
        model, optimizer = model_and_optimizer(mc)
        loop(model, optimizer, [(X[rank::world][i:i + 6], Y[rank::world][i:i + 6]) for i in (0, 6)])

    def evaluation() -> None:
        model = mc.setup(nn.Linear(4, 1))
        with torch.no_grad():
            [model(x) for x, _ in batches()]

    def own_ddp() -> None:
        model = DistributedDataParallel(nn.Linear(4, 1)) if world > 1 else nn.Linear(4, 1)
        loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [(X[rank::world], Y[rank::world])])

    found = {}
    for name, case in [("loader", loader), ("local", local), ("own_sharding", own_sharding),
                       ("evaluation", evaluation), ("own_ddp", own_ddp)]:
        fresh(mc)
        found[name] = outcome(case)
    return found


# -- item 2: a learnable parameter outside the model ------------------------------------------------------------------
def temperature_case(mc: Multicard) -> dict:
    """A temperature in the set-up optimizer: the steps of one process, then caught by the replica check where
    one rank changes it."""
    t = nn.Parameter(torch.ones(()))
    model, optimizer = model_and_optimizer(mc, [t])
    loop(model, optimizer, mc.setup_dataloader(batches()), t)
    alone_t = nn.Parameter(torch.ones(()))
    alone, alone_optimizer = model_and_optimizer(extra=[alone_t])
    mc.local_optimizer(alone_optimizer)  # this process's own: the replay is neither averaged nor judged
    loop(alone, alone_optimizer, batches(), alone_t)  # one process over the same global batches
    found = {"gap": max(abs(t.item() - alone_t.item()), (model.weight - alone.weight).abs().max().item()),
             "t": mc.gather(t.item())}
    t2 = nn.Parameter(torch.ones(()))  # one more, added to the set-up optimizer later: averaged from its first step
    optimizer.add_param_group({"params": [t2]})
    for rows in (slice(0, 12), slice(12, 24)):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(mc.local(X[rows])) * t * t2, mc.local(Y[rows])).backward()
        optimizer.step()
    found["t2"] = mc.gather(t2.item())
    planted = 0.5 if mc.rank == mc.world_size - 1 else 0.0
    with torch.no_grad():
        t.add_(planted)
        found["check"] = outcome(mc.check_replicas)
        t.sub_(planted)
    return found


# -- item 3: mc.local on batches each process drew itself --------------------------------------------------------------
def drawn_case(mc: Multicard, apart_from: int = 1, calls: int = 6) -> None:
    """mc.local on batches drawn alike up to call `apart_from`, then by each process's own stream."""
    model, optimizer = model_and_optimizer(mc)
    for call in range(1, calls + 1):
        g = torch.Generator().manual_seed(call + (100 * mc.rank if call >= apart_from else 0))
        rows = torch.randperm(len(X), generator=g)[:12]
        loop(model, optimizer, [(mc.local(X[rows]), mc.local(Y[rows]))])


def items_job(mc: Multicard) -> dict:
    found = {}
    fresh(mc)
    found["unset"] = outcome(lambda: unset_case(mc))
    found["outside"] = outcome(lambda: outside_case(mc))
    found["unset_off"] = in_mode(mc, "off", unset_case)
    found["unset_warn"] = in_mode(mc, "warn", lambda second: [unset_case(second), unset_case(second)])
    fresh(mc)
    found["every_batch"] = outcome(lambda: every_batch_case(mc))
    found["silent"] = silent_cases(mc)
    fresh(mc)
    found["temperature"] = temperature_case(mc)
    fresh(mc)
    found["unseeded"] = outcome(lambda: drawn_case(mc))
    fresh(mc)
    found["parted_later"] = in_mode(mc, "stop", lambda second: drawn_case(second, apart_from=3),
                                    replica_check_every=2)
    fresh(mc)
    found["unseeded_warn"] = in_mode(mc, "warn", drawn_case)
    return found


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("multicard:")]


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)])
def test_the_seams_of_a_loop_are_one_line_each_and_correct_loops_stay_silent(world):
    found = multicard.launch(items_job, strategy="ddp", devices=f"cpu:{world}")
    t = found["temperature"]
    assert t["gap"] < 1e-5 and len(set(t["t"])) == 1  # the temperature averaged: one process's steps
    assert len(set(t["t2"])) == 1 and t["t2"][0] != 1.0
    for name, (line, said) in found["silent"].items():
        assert (line, lines(said)) == (None, []), name
    if world == 1:  # nothing to part: every case trains as written, silently
        assert all(found[k] == (None, "") for k in ("unset", "outside", "unset_off", "unset_warn", "every_batch",
                                                    "unseeded", "parted_later", "unseeded_warn")), found
        assert t["check"] == (None, "")
        return
    fix = (f", and this optimizer was not set up: nothing averages their gradients, so the {world} processes train "
           f"apart; set them up, model, optimizer = mc.setup(model, optimizer) (for an optimizer built after setup, "
           f"mc.setup_optimizers(optimizer)); where each process should train its own, "
           f"mc.local_optimizer(optimizer)")
    assert found["unset"] == ("SGD.step() changes 2 parameters (5 values) that no set-up model holds" + fix, "")
    assert found["outside"] == ("SGD.step() changes 1 parameter (1 value) that no set-up model holds" + fix, "")
    assert found["unset_off"] == (None, "")
    assert found["unset_warn"] == (None, f"multicard: warning: {found['unset'][0]}\n")  # once, on rank 0
    said = lines(found["every_batch"][1])
    assert found["every_batch"][0] is None and said == [
        f"multicard: warning: the set-up model's first training batch is the same in every process, and no set-up "
        f"loader or mc.local cut it: each process reads every batch ({world} processes take one process's steps at "
        f"{world} times its work); pass the loader through mc.setup_dataloader(loader), or cut a batch you build with "
        f"mc.local(batch)"]
    line, said = t["check"]
    assert re.match(r"at mc\.check_replicas\(\): the replicas parted: optimizer \d+'s parameter 2 of param group 0 "
                    rf"\(outside the set-up models\) differs on rank {world - 1} from rank 0's by up to 0\.5",
                    line), line
    seed = (f"the processes passed different global batches: each cut its rows from a batch it drew itself (a "
            f"shuffle, crop or flip drawn unseeded), so the {world} processes do not take one process's step; seed "
            f"every process alike before drawing the batch (torch.manual_seed(0) at the top of the script, and "
            f"random.seed / numpy's where the batch uses them), or let mc.setup_dataloader(loader) deal it")
    assert found["unseeded"] == (f"mc.local (call 1): {seed}", "")
    # two calls a step (x, y), compared at forwards 1, 2, then every 2nd (K = 2): from the third step on the batches
    # part; the fourth step's (calls 7, 8) are compared, and judged before that step is taken
    assert found["parted_later"] == (f"mc.local (calls 7-8), before optimizer step 4: {seed}", "")
    assert found["unseeded_warn"] == (None, f"multicard: warning: mc.local (call 1): {seed}\n")


# -- item 4 and issue 39.6: a save on any rank -------------------------------------------------------------------------
WAIT_S = 0.5  # what a save waits for the other ranks the first time (3 s): this job's checks hold for any wait
def back(mc: Multicard, path: Path, saved: dict[int, torch.Tensor]) -> tuple[object, str]:
    """Load `path` on every rank: which of `saved` ({step: this rank's streams then}) came back (None: none),
    the file's step, and what this rank said."""
    torch.manual_seed(12345)  # the streams moved on
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        step = mc.load(path, {"model": nn.Linear(2, 2)}).get("step")
    now = torch.get_rng_state()
    came = next((s for s, streams in saved.items() if torch.equal(streams, now)), None)
    return (came, step), said.getvalue()


def saves_job(mc: Multicard, folder: str) -> dict:
    from multicard.checkpoints import randoms

    randoms.FIRST_WAIT_S = WAIT_S
    folder, rank, last = Path(folder), mc.rank, mc.world_size - 1
    model = mc.setup(nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    found, said = {}, io.StringIO()
    with contextlib.redirect_stderr(said):  # 39.6: rank 0 alone, a new name each time
        for i in range(3):
            if mc.is_main:
                mc.save(folder / f"best{i}.pt", {"model": model})
    found["alone_said"] = mc.gather(said.getvalue())
    mc.barrier()
    torch.manual_seed(7 + rank)
    mine = {0: torch.get_rng_state()}
    if rank == last:  # rank 1 (the last rank) alone: its file, with its streams
        mc.save(folder / "last-rank.pt", {"model": model, "step": 0})
        mc.save(folder / "last-rank-files.pt", model.state_dict())
    mc.barrier()
    found["last_rank"] = mc.gather(back(mc, folder / "last-rank.pt", mine))
    found["plain_there"] = (folder / "last-rank-files.pt").exists()
    torch.manual_seed(17 + rank)
    mine = {0: torch.get_rng_state()}
    mc.save(folder / f"ckpt.r{rank}", {"model": model, "step": 0})  # a file per rank
    mc.barrier()
    found["per_rank"] = mc.gather(back(mc, folder / f"ckpt.r{rank}", mine))
    mine = {}
    for step in range(4):  # rank 0 saves last.pt every other step, the others at every step
        torch.manual_seed(100 * step + rank)
        mine[step] = torch.get_rng_state()
        if rank or step % 2:
            mc.save(folder / "every.pt", {"model": model, "step": step})
        optimizer.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    mc.barrier()
    found["more_often"] = mc.gather(back(mc, folder / "every.pt", mine))
    found["files"] = sorted(p.name for p in folder.iterdir())
    return found


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_save_on_any_rank_is_written_with_the_streams_of_that_save(world, tmp_path, capfd):
    found = multicard.launch(saves_job, str(tmp_path), strategy="ddp", devices=f"cpu:{world}", timeout=30)
    assert found["files"] == sorted(["best0.pt", "best1.pt", "best2.pt", "last-rank.pt", "last-rank-files.pt",
                                     "every.pt", *(f"ckpt.r{r}" for r in range(world))])
    err = capfd.readouterr().err
    assert "socket.cpp" not in err and "[W" not in err  # no C++ warning of a store wait that ran out
    alone = [lines(s) for s in found["alone_said"]]  # one line, once, for three new names
    assert alone == ([[]] if world == 1 else [[
        f"multicard: {tmp_path / 'best0.pt'}: no other rank saved it along with rank 0 within {WAIT_S:g} s (a save "
        f"under `if mc.is_main:`, or a file per rank?): it holds rank 0's random streams; a rank that loads it starts "
        f"its own afresh"]] + [[]] * (world - 1))
    assert found["plain_there"]
    for rank, ((came, step), said) in enumerate(found["last_rank"]):
        assert step == 0
        if rank == world - 1:  # the rank that saved gets its streams back
            assert (came, said) == (0, "")
        else:
            assert came is None and said == (f"multicard: rank {rank}: {tmp_path / 'last-rank.pt'} holds no random "
                                             f"streams of this rank (rank {world - 1} saved without them): they "
                                             f"start afresh\n")
    assert [came for (came, _), _ in found["per_rank"]] == [0] * world  # each rank's own file, its own streams
    for rank, ((came, step), said) in enumerate(found["more_often"]):
        # the file is the last save's (step 3, which every rank took); its streams are that save's, or none
        assert step == 3 and (came == 3 or came is None and "start afresh" in said), (rank, came, said)


@pytest.mark.slow
def test_a_script_that_sets_up_only_its_loader_stops_with_one_line(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, TensorDataset\nimport multicard\n"
        "mc = multicard.Multicard()\ntorch.manual_seed(0)\nmodel = nn.Linear(4, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))\n"
        "for x, y in mc.setup_dataloader(DataLoader(data, batch_size=8, shuffle=True)):\n"
        "    optimizer.zero_grad()\n    nn.functional.mse_loss(model(x), y).backward()\n    optimizer.step()\n")
    result = subprocess.run([sys.executable, "-m", "multicard", "run", "--quiet", "--devices", "cpu:2", str(script)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert lines(result.stderr) == [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines(result.stderr)) == 1 and "that no set-up model holds" in result.stderr, result.stderr


def test_one_process_steps_any_optimizer_and_saves_as_it_is(tmp_path):
    """single: nothing is watched (no hook, no store), a save is written at once."""
    with Multicard("single", "cpu") as mc:
        model, optimizer = model_and_optimizer()
        loop(model, optimizer, mc.setup_dataloader(batches()))
        mc.save(tmp_path / "a.pt", {"model": model})
        mc.save(tmp_path / "b.pt", model.state_dict())
        assert checkpoint.read(tmp_path / "a.pt")["multicard"]["ranks"] == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "b.pt"]

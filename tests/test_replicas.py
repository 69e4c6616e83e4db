"""The replica check (issue 32): each cause that parts the replicas, planted on 2 and 3 gloo processes, stops every
rank with one line naming when, what, the ranks and the difference; correct loops never trip it; what the user
controls (off, warn, K, by hand) from the constructor, `multicard run` and `multicard train`."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multicard
from conftest import run_cli, tiny_images
from multicard.cli import main
from multicard.errors import UsageError
from multicard.jobs.devices import Devices
from multicard.models import LeNet5
from multicard.strategies import Strategy
from multicard.yourloop import replicas
from multicard.yourloop.fingerprints import fingerprints
from multicard.yourloop.multicard import Multicard
from multicard.yourloop.replicas import ReplicasParted

X = torch.randn(12, 4, generator=torch.Generator().manual_seed(1))  # a global batch: each rank takes its rows


class Tiny(nn.Module):
    """Two layers; `track`: a buffer it updates itself from its own rows in each forward (as a VQ-VAE's EMA
    codebook does)."""

    def __init__(self, track: bool = False):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(4, 8), nn.Linear(8, 2)
        self.track = track
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        if self.track and self.training:
            self.seen.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
        return self.lin2(torch.tanh(self.lin1(x)))


def step(mc: Multicard, model, optimizer) -> None:
    optimizer.zero_grad()
    mc.backward(model(mc.local(X)).pow(2).mean())
    optimizer.step()


def planted(mc: Multicard, cause: str, mode: str = "stop") -> dict:
    """Six steps of a small loop, checked every 2, with `cause` planted (mostly on the last rank); the line it
    stopped with (or "not caught"), what it printed on stderr, and the steps it took."""
    last, said, steps = mc.world_size - 1, io.StringIO(), 0
    run = Multicard("ddp", "cpu", replica_check=mode, replica_check_every=2)
    torch.manual_seed(0)
    model = Tiny(track=cause == "buffer")
    lr = 0.2 if cause == "start" and mc.rank == last else 0.1
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    try:
        with contextlib.redirect_stderr(said):
            model, optimizer = run.setup(model, optimizer)
            for steps in range(1, 7):
                step(run, model, optimizer)
                if steps == 3:  # after the check after step 2 (at the 3rd forward): caught by the one after step 4
                    plant(run, cause, model, optimizer, last)
        line = "not caught"
    except ReplicasParted as e:
        line = str(e)
    finally:
        run.close()
    return {"line": line, "said": said.getvalue(), "steps": steps}


def plant(mc: Multicard, cause: str, model, optimizer, last: int) -> None:
    params = list(model.module.parameters())
    with torch.no_grad():
        if cause == "lr" and mc.rank == 0:  # rank 0 alone changes its rate
            optimizer.param_groups[0]["lr"] = 0.05
        elif cause == "state" and mc.rank == 0:  # an optimizer state loaded on one rank only
            state = optimizer.state_dict()
            for entry in state["state"].values():
                entry["momentum_buffer"] = entry["momentum_buffer"] * 2
            optimizer.load_state_dict(state)
        elif mc.rank == last:
            if cause == "clip":  # weight clipping outside backward
                for p in params:
                    p.clamp_(-0.1, 0.1)
            elif cause == "ema":  # an EMA written back
                for p in params:
                    p.mul_(0.5)
            elif cause == "noise":  # a non-deterministic kernel
                params[0].add_(torch.randn_like(params[0]) * 1e-6)
            elif cause == "bitflip":
                params[0].view(-1).view(torch.int32)[5] ^= 1


CAUSES = ["lr", "buffer", "state", "clip", "ema", "noise", "bitflip", "start"]


def causes_job(mc: Multicard) -> dict:
    found = {cause: planted(mc, cause) for cause in CAUSES}
    found["warn"], found["off"] = planted(mc, "lr", "warn"), planted(mc, "lr", "off")
    run = Multicard("ddp", "cpu", replica_check="off")  # off: by hand it still compares, and stops
    model = run.setup(Tiny())
    with torch.no_grad():
        model.module.lin2.bias.add_(mc.rank)
    try:
        run.check_replicas()
    except ReplicasParted as e:
        found["by hand"] = {"line": str(e)}
    run.close()
    return mc.gather(found)


def parted_on(world: int) -> str:
    return "rank 1" if world == 2 else "ranks 1, 2"


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_each_cause_stops_every_rank_with_one_line(world):
    ranks = multicard.launch(causes_job, devices=f"cpu:{world}")
    for cause in [*CAUSES, "by hand"]:
        lines = {r[cause]["line"] for r in ranks}
        assert len(lines) == 1, (cause, lines)  # every rank stopped, with the same line
    found = {cause: ranks[0][cause]["line"] for cause in [*CAUSES, "by hand"]}
    causes = "usual causes: rank-dependent code"
    assert all("\n" not in line and causes in line for line in found.values()), found
    others = ", ".join(f"0.1 on rank {r}" for r in range(1, world))
    assert found["lr"].startswith(f"after optimizer step 4: the replicas parted: the optimizer's lr (param group 0) "
                                  f"is 0.05 on rank 0, {others} (and "), found["lr"]
    assert found["start"].startswith(f"after mc.setup: the replicas parted: the optimizer's lr (param group 0) is "
                                     f"0.1 on rank 0, 0.2 on rank {world - 1}; ")
    assert found["buffer"].startswith(f"after optimizer step 2: the replicas parted: buffer seen differs on "
                                      f"{parted_on(world)} from rank 0's by up to ")
    assert "a buffer: under ddp each forward copies rank 0's buffers" in found["buffer"]
    # rank 0's state was the odd one: the others agree with each other
    assert found["state"].startswith(f"after optimizer step 4: the replicas parted: parameter lin1.weight differs on "
                                     f"{parted_on(world)}{' (alike)' if world > 2 else ''} from rank 0's by up to ")
    alike = "; rank 1 agrees with rank 0" if world == 3 else ""
    for cause in ("clip", "ema", "noise", "bitflip"):
        assert found[cause].startswith(f"after optimizer step 4: the replicas parted: parameter lin1.weight differs "
                                       f"on rank {world - 1} from rank 0's by up to "), (cause, found[cause])
        assert alike in found[cause], found[cause]
    assert float(re.search(r"by up to ([^ ;]+)", found["bitflip"])[1]) < 1e-7  # a flipped low bit of one weight
    assert found["by hand"].startswith(f"at mc.check_replicas(): the replicas parted: parameter lin2.bias differs on "
                                       f"{parted_on(world)} from rank 0's by up to {world - 1}")
    # warn: rank 0 says it once and the loop goes on; off: nothing is compared on its own
    warned = [r["warn"] for r in ranks]
    assert [w["steps"] for w in warned] == [6] * world and [w["line"] for w in warned] == ["not caught"] * world
    assert warned[0]["said"] == f"multicard: warning: {found['lr']}\n" and not any(w["said"] for w in warned[1:])
    assert all(r["off"] == {"line": "not caught", "said": "", "steps": 6} for r in ranks)


class Norm(nn.Module):
    """BatchNorm without sync: its running statistics differ between processes on purpose."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.lin(x))


def correct_job(mc: Multicard, checkpoint: str) -> dict:
    """Correct loops, checked after every optimizer step: each returns the steps counted (each one checked)."""
    counted = {}

    def fresh(**options) -> Multicard:
        return Multicard("ddp", "cpu", replica_check_every=1, **options)

    # the README's loop
    run, data = fresh(), TensorDataset(torch.randn(200, 4), torch.randint(0, 2, (200,)))
    torch.manual_seed(0)
    model = Tiny()
    model, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = run.setup_dataloader(DataLoader(data, batch_size=64, shuffle=True))  # 200 rows: an uneven last batch
    for x, y in loader:
        optimizer.zero_grad()
        run.backward(F.cross_entropy(model(x), y))
        optimizer.step()
    counted["readme, uneven"] = run._replicas.steps
    run.close()
    # weights seeded apart (ddp copies rank 0's at setup), an optimizer that never went through multicard
    run = fresh()
    torch.manual_seed(mc.rank)
    model = run.setup(Tiny())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        step(run, model, optimizer)
    counted["unseeded, optimizer not set up"] = run._replicas.steps
    run.close()
    # accumulation, fp16 (skipped steps count too), BatchNorm without sync
    run = fresh(precision="fp16")
    torch.manual_seed(0)
    model = run.setup(Norm())
    optimizer = run.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    loader = run.setup_dataloader(DataLoader(data, batch_size=40, shuffle=True), accumulate=2)
    for x, _ in loader:
        with run.no_backward_sync(model, enabled=not loader.step_ends):
            run.backward(model(x).pow(2).mean() * loader.share)
        if loader.step_ends:
            optimizer.step()
            optimizer.zero_grad()
    counted["accumulate, fp16, batchnorm"] = run._replicas.steps
    run.close()
    # a closure optimizer on an uneven batch (5 rows over the processes)
    run = fresh()
    torch.manual_seed(0)
    model = run.setup(Tiny())
    optimizer = run.setup_optimizers(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5))

    def closure():
        optimizer.zero_grad()
        loss = model(run.local(X[:5])).pow(2).mean()
        loss.backward()
        return loss

    for _ in range(3):
        optimizer.step(closure)
    counted["lbfgs"] = run._replicas.steps
    run.close()
    # resume onto another world size: a checkpoint one process wrote, loaded (and checked) by every rank
    run = fresh()
    model = run.setup(Tiny())
    optimizer = run.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    run.load(checkpoint, {"model": model, "optimizer": optimizer})
    for _ in range(3):
        step(run, model, optimizer)
    counted["resume"] = run._replicas.steps
    run.close()
    return counted


def test_correct_loops_never_trip_it(tmp_path):
    one = Multicard("single", "cpu")
    torch.manual_seed(0)
    model = one.setup(Tiny())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step(one, model, optimizer)
    one.save(tmp_path / "one.pt", {"model": model, "optimizer": optimizer})
    counted = multicard.launch(correct_job, str(tmp_path / "one.pt"), devices="cpu:2")
    assert counted == {"readme, uneven": 4, "unseeded, optimizer not set up": 3, "accumulate, fp16, batchnorm": 5,
                       "lbfgs": 3, "resume": 3}


def fsdp_job(mc: Multicard, cause: str) -> str:
    run = Multicard("fsdp", "cpu", replica_check_every=1)
    torch.manual_seed(mc.rank if cause == "start" else 0)
    try:
        model = run.setup(Tiny())
        optimizer = run.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(3):
            step(run, model, optimizer)
            if cause == "lr" and mc.rank == 0:
                optimizer.param_groups[0]["lr"] = 0.05
    except ReplicasParted as e:
        return str(e)
    finally:
        run.close()
    return f"not caught after {run._replicas.steps} steps"


@pytest.mark.slow
def test_under_fsdp_the_whole_model_is_compared_before_sharding_then_buffers_and_settings():
    assert multicard.launch(fsdp_job, "none", devices="cpu:2") == "not caught after 3 steps"
    assert multicard.launch(fsdp_job, "start", devices="cpu:2").startswith(
        "at mc.setup, before fsdp shards the model (it copies no weights between processes: build the model alike "
        "on every rank, e.g. after torch.manual_seed, or load it on every rank): the replicas parted: parameter "
        "lin1.weight differs on rank 1 from rank 0's by up to ")
    assert multicard.launch(fsdp_job, "lr", devices="cpu:2").startswith(  # changed after step 1, before the check
        "after optimizer step 1: the replicas parted: the optimizer's lr (param group 0) is 0.05 on rank 0, 0.1 on "
        "rank 1; ")  # that runs at the next forward


# -- what the user controls -------------------------------------------------------------------------------------
SCRIPT = """
import torch
import multicard

mc = multicard.Multicard()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
model, optimizer = mc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(4):
    optimizer.zero_grad()
    mc.backward(model(mc.local(torch.ones(4, 4))).pow(2).mean())
    optimizer.step()
    if mc.rank == 0:
        optimizer.param_groups[0]["lr"] = 0.05
print("done", mc.rank, flush=True)
"""


@pytest.mark.slow
def test_multicard_run_passes_its_flags_to_the_scripts_multicard(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    out = run_cli("run", "--devices", "cpu:2", "--replica-check-every", "3", str(tmp_path / "job.py"))
    assert out.returncode == 2 and "done" not in out.stdout and "Traceback" not in out.stderr, out.stderr
    started, *said = out.stderr.splitlines()  # the job's start line, then one line
    assert started.startswith("multicard: running ") and len(said) == 1, out.stderr
    assert said[0].startswith("multicard: error: after optimizer step 3: the replicas parted: the optimizer's lr "
                              "(param group 0) is 0.05 on rank 0, 0.1 on rank 1 (and 2 more"), out.stderr


@pytest.mark.slow
def test_multicard_run_can_make_it_warn(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    out = run_cli("run", "--devices", "cpu:2", "--replica-check", "warn", "--replica-check-every", "2",
                  str(tmp_path / "job.py"))
    assert out.returncode == 0 and out.stdout.count("done") == 2, out.stderr
    assert out.stderr.count("multicard: warning: after optimizer step 2: the replicas parted") == 1, out.stderr


@pytest.mark.parametrize("argv, said", [
    (["train", "--replica-check", "maybe"], "--replica-check maybe: choose one of stop, warn, off"),
    (["train", "--replica-check-every", "0"], "--replica-check-every 0: must be at least 1"),
    (["run", "--replica-check-every", "0", __file__], "--replica-check-every 0: must be at least 1"),
])
def test_a_bad_flag_is_one_line(argv, said, capsys):
    with contextlib.suppress(SystemExit):
        assert main(argv) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("options, env, said", [
    ({"replica_check": "maybe"}, {}, "replica_check='maybe': choose one of stop, warn, off"),
    ({"replica_check_every": 0}, {}, "replica_check_every=0: must be at least 1"),
    ({"replica_check_every": True}, {}, "replica_check_every=True: not a whole number"),
    ({}, {replicas.MODE_VAR: "no"}, "MULTICARD_REPLICA_CHECK=no (multicard run --replica-check): choose one of stop"),
    ({}, {replicas.EVERY_VAR: "0"}, "MULTICARD_REPLICA_CHECK_EVERY=0 (multicard run --replica-check-every): must be "
                                    "at least 1"),
    ({}, {replicas.EVERY_VAR: "x"}, "MULTICARD_REPLICA_CHECK_EVERY=x (multicard run --replica-check-every): not a"),
])
def test_a_bad_setting_is_one_line(options, env, said, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=r"^" + re.escape(said)):
        Multicard("single", "cpu", **options)


def test_one_process_has_nothing_to_compare_and_pays_nothing():
    mc = Multicard("single", "cpu")
    model = mc.setup(Tiny())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = optimizer.step
    mc.setup_optimizers(optimizer)
    assert optimizer.step == plain and mc._job_state._hook is None  # no wrapper, no hook: no cost
    assert mc.check_replicas() is True


def fingerprint(tensor: torch.Tensor) -> list[int]:
    return fingerprints([("t", tensor)], torch.device("cpu"))[0].tolist()


def test_the_fingerprint_is_exact_and_sees_flips_swaps_and_signs():
    torch.manual_seed(0)
    w = torch.randn(64, 100)
    same = fingerprint(w)
    flipped, swapped, signed = w.clone(), w.clone(), w.clone()
    flipped.view(-1).view(torch.int32)[1234] ^= 1
    swapped[[3, 40]] = swapped[[40, 3]]  # two rows swapped: their sum stays
    signed[7, 7] = -signed[7, 7]
    assert all(fingerprint(t) != same for t in (flipped, swapped, signed))
    assert fingerprint(torch.tensor([0.0])) != fingerprint(torch.tensor([-0.0]))
    assert fingerprint(w.contiguous(memory_format=torch.contiguous_format)) == same
    conv = torch.randn(8, 3, 5, 5)
    assert fingerprint(conv.to(memory_format=torch.channels_last)) == fingerprint(conv)
    threads = torch.get_num_threads()
    try:  # integer sums: the order of a reduction cannot change them
        big = torch.randn(3_000_000)
        torch.set_num_threads(1)
        one = fingerprint(big)
        torch.set_num_threads(2)
        assert fingerprint(big) == one
    finally:
        torch.set_num_threads(threads)
    for t in (torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.bool),
              torch.arange(3), torch.ones(2, dtype=torch.complex64), torch.zeros(0)):
        assert len(fingerprint(t)) == 2


@contextlib.contextmanager
def syncs_refused():
    """A host sync on the card is an error in here."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class Agreeing(Strategy):
    """Two processes whose every collective finds the other rank holding the same: the check's own work, alone."""

    world = 2

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return tensor.clone()


ON_A_CARD = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA card")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_A_CARD)])
def test_between_checks_nothing_waits_for_the_device(device):
    """The fingerprint is the same on a card as on the CPU, and on a card only the check's own steps sync."""
    torch.manual_seed(0)
    w = torch.randn(300, 77)
    assert fingerprint(w.to(device)) == fingerprint(w)
    check = replicas.ReplicaCheck(Agreeing(Devices(device, (0,))), "stop", 4)
    model = Tiny().to(device)
    check.set_up(model, "Tiny")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    check.watch(optimizer)
    x = X.to(device)
    for i in range(1, 9):
        with contextlib.nullcontext() if device == "cpu" or i % 4 == 0 else syncs_refused():
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
    assert check.steps == 8
    check.close()


def trainer_model() -> nn.Module:
    torch.manual_seed(0)
    return LeNet5()


@pytest.mark.slow
def test_the_trainer_checks_every_step_and_a_correct_run_passes(tmp_path):
    train, test = tiny_images(96, 0), tiny_images(50, 1)
    summary = multicard.train(trainer_model(), train, test, strategy="ddp", devices="cpu:2", epochs=2,
                              batch_size=32, replica_check_every=1, out=str(tmp_path / "run"), quiet=True)
    assert summary["optimizer_steps"] == 6 and summary["config"]["replica_check"] == "stop"


class Drifting(LeNet5):
    """A model that updates a buffer of its own from its rows in each forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("level", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.level += x.detach().mean()
        return super().forward(x)


@pytest.mark.slow
def test_the_trainer_stops_where_the_replicas_part(tmp_path):
    torch.manual_seed(0)
    with pytest.raises(UsageError, match=r"^after optimizer step 2: the replicas parted: buffer level differs on "
                                         r"rank 1 from rank 0's by up to "):
        multicard.train(Drifting(), tiny_images(96, 0), None, strategy="ddp", devices="cpu:2", epochs=1,
                        batch_size=32, replica_check_every=2, out=str(tmp_path / "run"), quiet=True)

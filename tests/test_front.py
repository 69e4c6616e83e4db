"""The front object (multicard.Multicard) in a user's own loop: single in this process, ddp over 2 and 3 gloo processes,
dp and dp-balanced with CPU stand-ins; the loader contract; checkpoints; multicard.launch; the front object pickled (to
a DataLoader worker)."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import multicard
from conftest import assert_same, cpu_and_card, rehearsal, sharded, tiny_images
from multicard.cli import main
from multicard.errors import UsageError
from multicard.jobs.devices import Devices
from multicard.strategies.dp import DP
from multicard.strategies.single import Single
from multicard.yourloop.multicard import Multicard
from multicard.yourloop.precision import DTYPES
from multicard.yourloop.prepared import Prepared
from test_dp import CPUBalanced

STEPS, BATCH = 20, 48  # 48 splits over 1, 2 and 3 processes


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 32), nn.Tanh(), nn.Linear(32, 10))


class Placed(TorchFunctionMode):
    """Follows which tensors were put on a device: a .to(device), a factory given device=, or anything computed
    from such a tensor. On the CPU every tensor is on the device already, so a tensor a job forgot to move shows
    only where it meets a model on a card; under this mode a module's forward refuses it on the CPU too."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = tree_leaves((args, kwargs))
        moved = "device" in kwargs or (func in (torch.Tensor.to, torch.Tensor.cuda) and any(
            isinstance(a, (torch.device, str)) for a in inputs))
        if moved or any(getattr(t, "placed", False) for t in inputs if isinstance(t, torch.Tensor)):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    t.placed = True
        return out


def only_placed_inputs(module: nn.Module, inputs: tuple) -> None:
    """A forward pre-hook: every tensor the module gets was put on the device (under Placed)."""
    for x in inputs:
        assert not isinstance(x, torch.Tensor) or getattr(x, "placed", False), "an input never moved to mc.device"


def sgd_job(mc: Multicard, folder: str) -> dict:
    """A user's loop: plain SGD (no momentum, so every gradient error shows in the weights) for STEPS steps of a
    global batch of BATCH, then the collectives, no_backward_sync and a checkpoint from rank 0 only. The same
    body runs on the CPU and on a card: under Placed, an input left off the device fails on the CPU as well."""
    with Placed():
        return sgd_steps(mc, folder)


def sgd_steps(mc: Multicard, folder: str) -> dict:
    model = mlp()
    model.register_forward_pre_hook(only_placed_inputs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = mc.setup(model, optimizer)
    criterion = mc.setup_criterion(nn.CrossEntropyLoss())
    loader = mc.setup_dataloader(DataLoader(tiny_images(STEPS * BATCH), BATCH, shuffle=True))
    assert len(loader) == STEPS and loader.local_batch_size == BATCH // mc.world_size
    for x, y in loader:
        optimizer.zero_grad()
        mc.backward(criterion(model(x), y))
        optimizer.step()
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    x, y = (t.to(mc.device) for t in tiny_images(8, seed=10 + mc.rank)[:])  # different data on every rank
    optimizer.zero_grad()
    with mc.no_backward_sync(model):
        criterion(model(x), y).backward()
    local = mc.gather(model.module[1].weight.grad.clone())
    model.zero_grad()
    criterion(model(x), y).backward()
    synced = mc.gather(model.module[1].weight.grad.clone())

    mc.save(f"{folder}/ckpt.pt", {"model": model, "optimizer": optimizer, "step": STEPS})  # one file, rank 0's
    mc.barrier()  # (a save on rank 0 alone, Lightning Fabric's deadlock: test_one_file.py)
    fresh = mlp()
    rest = mc.load(f"{folder}/ckpt.pt", {"model": fresh})
    for key, value in weights.items():  # the model on mc.device, the fresh one on the CPU
        assert_same(fresh.state_dict()[key], value, what=key)
    return {"weights": weights, "rest": rest, "local": local, "synced": synced,
            "sum": mc.all_reduce(torch.tensor([mc.rank + 1.0])).item(), "max": mc.all_reduce(mc.rank, "max").item(),
            "mean": mc.all_reduce(mc.rank + 1, "mean").item(), "gather": mc.gather(mc.rank)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same loop on n processes (ddp on gloo for 2 and 3), each n run once for the module, when first asked."""
    folder, done = tmp_path_factory.mktemp("front"), {}

    def run(n: int) -> dict:
        if n not in done:
            done[n] = multicard.launch(sgd_job, str(folder / str(n)), strategy="ddp" if n > 1 else "single",
                                       devices=f"cpu:{n}")
        return done[n]
    return run


THREE = pytest.param(3, marks=pytest.mark.slow)  # the 2-process job runs the same code path


@pytest.mark.parametrize("n", [2, THREE])
def test_n_processes_end_with_the_weights_of_one(runs, n):
    one, many = runs(1)["weights"], runs(n)["weights"]
    for key in one:
        assert (one[key] - many[key]).abs().max().item() <= 1e-5, key


@pytest.mark.parametrize("n", [1, 2, THREE])
def test_collectives(runs, n):
    r = runs(n)
    assert r["sum"] == n * (n + 1) / 2 and r["max"] == n - 1 and r["mean"] == (n + 1) / 2
    assert r["gather"] == list(range(n))


@pytest.mark.parametrize("n", [2, THREE])
def test_no_backward_sync_leaves_gradients_local_until_the_next_backward(runs, n):
    local, synced = runs(n)["local"], runs(n)["synced"]
    assert not torch.allclose(local[0], local[1])
    assert all(torch.allclose(g, synced[0]) for g in synced)
    torch.testing.assert_close(synced[0], sum(local) / n)  # the average of what each rank had alone


@pytest.mark.parametrize("n", [1, 2])
def test_save_from_rank_0_only_loads_everywhere(runs, n, tmp_path):
    assert runs(n)["rest"] == {"optimizer": runs(n)["rest"]["optimizer"], "step": STEPS}


# -- one process: the set-up model, the checkpoint, the errors ----------------------------------------------------

def test_the_set_up_model_reads_as_the_users_own():
    mc = Multicard(devices="cpu")
    model = mlp()
    model.note = "mine"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, same = mc.setup(model, optimizer)
    assert isinstance(prepared, Prepared) and same is optimizer and prepared.module is model
    assert list(prepared.state_dict()) == list(model.state_dict())  # no wrapper prefix
    assert prepared.note == "mine" and mc.unwrap(prepared) is model  # attributes pass through
    assert [p is q for p, q in zip(prepared.parameters(), model.parameters(), strict=True)] == [True] * 4
    with pytest.raises(UsageError, match="set up already"):
        mc.setup(prepared)
    with pytest.raises(UsageError, match="all_reduce op 'avg'"):
        mc.all_reduce(1, "avg")
    mc.close()
    with pytest.raises(UsageError, match="closed"):
        mc.setup(mlp())


def test_bf16_runs_the_forward_under_autocast_and_hands_back_fp32():
    mc = Multicard(devices="cpu", precision="bf16")
    model = mc.setup(mlp())
    seen = []
    model.module[1].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = model(tiny_images(4)[:][0])
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert DTYPES == {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("keyword, value, said", [
    ("strategy", "x", "choose one of auto, single, ddp, dp, dp-balanced, fsdp"),
    ("precision", "fp8", "choose one of fp32, bf16, fp16"),
    ("replica_check", "maybe", "choose one of stop, warn, off"),
    ("replica_check_every", 0, "must be at least 1"),
    ("replica_check_every", 2.5, "not a whole number"),
    ("timeout", 0.5, "must be from 1 to 1e+06 seconds"),
])
def test_a_bad_keyword_is_named_as_typed_with_the_rest_its_flag_says(keyword, value, said, capsys):
    with pytest.raises(UsageError) as called:
        Multicard(devices="cpu", **{keyword: value})
    assert str(called.value) == f"{keyword}={value!r}: {said}"
    flag = f"--{keyword.replace('_', '-')} {value}"
    with contextlib.suppress(SystemExit):
        assert main(["train", *flag.split()]) == 2
    assert f"{flag}: {said}" in capsys.readouterr().err


def test_checkpoint_round_trip_and_its_errors(tmp_path):
    mc = Multicard(devices="cpu")
    model = mc.setup(mlp())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    x, y = tiny_images(8)[:]
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    scheduler.step()
    mc.save(tmp_path / "c.pt", {"model": model, "optimizer": optimizer, "scheduler": scheduler, "epoch": 3})
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    assert list(raw["model"]) == list(mlp().state_dict())  # unwrapped, loadable by plain torch

    model2 = mlp()
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    scheduler2 = torch.optim.lr_scheduler.StepLR(optimizer2, 1, 0.5)
    state = {"model": model2, "optimizer": optimizer2, "scheduler": scheduler2, "epoch": 0}
    assert mc.load(tmp_path / "c.pt", state) == {"epoch": 3} and state["epoch"] == 3
    assert optimizer2.param_groups[0]["lr"] == 0.005 and optimizer2.state_dict()["state"][0]["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model2.state_dict().values(), model.state_dict().values(),
                                                 strict=True))
    multicard.save(model, tmp_path / "model.pt")  # a plain model.pt loads into the one model named
    assert mc.load(tmp_path / "model.pt", {"model": mlp()}) == {}
    with pytest.raises(UsageError, match="has no 'scaler'"):
        mc.load(tmp_path / "c.pt", {"scaler": torch.amp.GradScaler("cpu")})
    with pytest.raises(UsageError, match="'model': does not fit the model"):
        mc.load(tmp_path / "c.pt", {"model": nn.Linear(3, 2)})
    with pytest.raises(UsageError, match="no such file"):
        mc.load(tmp_path / "nothing.pt", {"model": model2})


# -- the loader contract ------------------------------------------------------------------------------------------

def test_an_unshuffled_training_loader_keeps_its_order_dealt_out():
    parts = [[y.tolist() for _, y in sharded(TensorDataset(torch.arange(12), torch.arange(12)), 6, rank=r,
                                             world=2, shuffle=False)] for r in range(2)]
    assert parts == [[[0, 2, 4], [6, 8, 10]], [[1, 3, 5], [7, 9, 11]]]


def test_drop_last_drops_the_short_global_step():
    data = TensorDataset(torch.arange(10), torch.arange(10))
    parts = [multicard.data.loaders.shard(DataLoader(data, 4, shuffle=True, drop_last=True,
                                                     generator=torch.Generator().manual_seed(0)),
                                          train=True, rank=r, world=2, device=torch.device("cpu"),
                                          local_batch=lambda b, k=1: b // (2 * k)) for r in range(2)]
    steps = [sorted(a.tolist() + b.tolist()) for (_, a), (_, b) in zip(*parts, strict=True)]
    assert len(steps) == 2 and all(len(s) == 4 for s in steps) and len(set(sum(steps, []))) == 8


def test_global_batch_false_keeps_the_batch_per_process():
    loader = sharded(tiny_images(40), 8, rank=0, world=2, global_batch=False)
    assert loader.local_batch_size == 8 and len(loader) == 3 and loader.batch_size == 8


def test_a_distributed_sampler_is_not_applied_twice_and_its_epoch_advances():
    data = TensorDataset(torch.arange(20), torch.arange(20))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, seed=3)
    mc = Multicard(devices="cpu")
    loader = mc.setup_dataloader(DataLoader(data, 5, sampler=sampler))
    passes = [torch.cat([y for _, y in loader]).tolist() for _ in range(2)]
    for epoch, seen in enumerate(passes):
        sampler.set_epoch(epoch)
        assert seen == list(sampler)  # its own shard of 10, in its epoch's order: not cut again
    assert passes[0] != passes[1]


class Pairs(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i)]), "y": i % 2}


def test_a_map_style_dataset_keeps_its_collate_fn_and_workers():
    def collate(items):
        return torch.stack([d["x"] for d in items]), torch.tensor([d["y"] for d in items])

    mc = Multicard(devices="cpu")
    loader = mc.setup_dataloader(DataLoader(Pairs(), 4, collate_fn=collate, num_workers=1, shuffle=True))
    assert loader.inner.num_workers == 1 and loader.inner.collate_fn is collate
    assert sorted(torch.cat([x for x, _ in loader]).flatten().tolist()) == [float(i) for i in range(10)]


@pytest.mark.parametrize("make, words", [
    (lambda d: DataLoader(d, 5), "does not split over 2 processes; use a multiple of 2 (e.g. 4 or 6), or "
                                 "setup_dataloader(loader, global_batch=False)"),
    (lambda d: DataLoader(d, batch_size=None), "serves one sample at a time"),  # a weighted sampler: read whole
    (lambda d: [1, 2, 3], "takes a torch.utils.data.DataLoader, not list"),
])
def test_loaders_that_cannot_be_dealt_out_are_one_clear_error(make, words):
    data = TensorDataset(torch.arange(12), torch.arange(12))
    with pytest.raises(UsageError) as error:
        multicard.data.loaders.shard(make(data), train=True, rank=0, world=2, device=torch.device("cpu"),
                                     local_batch=Multicard(devices="cpu:2")._loader_batch)
    assert words in str(error.value)


# -- dp and dp-balanced, with CPU stand-ins -----------------------------------------------------------------------

class CPUDP(DP):
    """dp's wrapper over no cards: torch's DataParallel on a machine without CUDA calls the module itself."""

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return nn.DataParallel(model)


@pytest.mark.parametrize("strategy", [CPUDP, CPUBalanced])
def test_dp_and_dp_balanced_in_a_users_loop(strategy):
    results = []
    for mc in (Multicard(Single(Devices("cpu", (0,)))), Multicard(strategy(Devices("cpu", (0,))))):
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer = mc.setup(model, optimizer)
        criterion = mc.setup_criterion(nn.CrossEntropyLoss())
        for x, y in mc.setup_dataloader(DataLoader(tiny_images(50), 10, shuffle=True)):
            optimizer.zero_grad()
            mc.backward(criterion(model(x), y))
            optimizer.step()
        model.eval()
        with torch.no_grad():  # a test function's own code: plain outputs, whatever the strategy
            x, y = tiny_images(20, 1)[:]
            correct = (model(x).argmax(1) == y).sum().item()
        assert list(model.state_dict()) == list(mlp().state_dict())
        results.append((model.state_dict(), correct))
    (w1, c1), (w2, c2) = results
    assert c1 == c2
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=1e-5, atol=1e-6)


# -- on the CPU and on a card ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", cpu_and_card())
@pytest.mark.parametrize("strategy, precision", [("single", "fp32"), ("single", "bf16"), ("ddp", "fp32")])
def test_users_loop_on_one_device(device, strategy, precision, tmp_path):
    result = multicard.launch(sgd_job, str(tmp_path), strategy=strategy, devices=device, precision=precision)
    reference = multicard.launch(sgd_job, str(tmp_path), strategy="single", devices="cpu")
    for key, value in reference["weights"].items():
        assert_same(result["weights"][key], value, atol=1e-4 if precision == "fp32" else 5e-2, what=key)


@rehearsal
def test_users_loop_rehearsed_on_one_card(tmp_path):
    """2 processes on card 0 (over gloo; on 2 cards, one each) take one process's steps: the loop, its collectives,
    no_backward_sync and the checkpoint, as on 2 cards."""
    devices = "0,1" if torch.cuda.device_count() > 1 else "0,0"
    many = multicard.launch(sgd_job, str(tmp_path / "many"), strategy="ddp", devices=devices)
    one = multicard.launch(sgd_job, str(tmp_path / "one"), strategy="single", devices="cpu")
    for key, value in one["weights"].items():
        assert_same(many["weights"][key], value, atol=1e-4, what=key)
    assert (many["sum"], many["max"], many["gather"]) == (3.0, 1, [0, 1])
    assert_same(many["synced"][0], sum(many["local"]) / 2, atol=1e-6, what="the reduced gradient")


# -- mc.stop_requested: a stop every rank agrees on (issue 48, item 5) -------------------------------------------------

def stop_reads(mc: Multicard, at: int, signum: int) -> list:
    """Reads of mc.stop_requested, as a loop reads it once per step, until it says True (64 at most); the last
    rank sends `signum` to itself alone just before read `at` (0-based). Every rank's reads and mc.stop_signal, in
    rank order."""
    seen = []
    while len(seen) < 64 and not (seen and seen[-1]):
        if len(seen) == at and mc.rank == mc.world_size - 1:
            os.kill(os.getpid(), signum)
        seen.append(mc.stop_requested)
    return mc.gather((seen, mc.stop_signal))


def test_stop_requested_installs_at_the_first_read_records_and_puts_the_handlers_back():
    def theirs(signum, frame):
        raise AssertionError("multicard's handler must take the signal")

    before = signal.signal(signal.SIGUSR1, theirs), signal.getsignal(signal.SIGTERM)
    try:
        mc = Multicard("single", "cpu")
        mc.rank  # noqa: B018  (joined, set up: the handlers stay as they were until the first read)
        assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == (theirs, before[1])
        assert mc.stop_signal is None
        other = Multicard("single", "cpu")  # a second object reading it learns of the same signal
        assert not other.stop_requested
        assert stop_reads(mc, 2, signal.SIGUSR1) == [([False, False, True], "SIGUSR1")]  # one process: at once
        assert other.stop_requested and other.stop_signal == "SIGUSR1"
        mc.close()  # the first closed first: the second's close puts back what was there before either
        other.close()
        assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == (theirs, before[1])
    finally:
        signal.signal(signal.SIGUSR1, before[0])


def test_stop_requested_is_read_first_in_the_main_thread():
    mc, errors = Multicard("single", "cpu"), []

    def read():
        try:
            mc.stop_requested  # noqa: B018
        except UsageError as e:
            errors.append(str(e))

    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]
    mc.close()


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_read():
    """Rank 1 alone gets SIGTERM (its own os.kill) before its third read: both ranks say True at the same read,
    the next at which they meet (reads 1, 2, 4, 8, ... meet while a second's worth of reads is more: here the 4th),
    and name the same signal."""
    seen = multicard.launch(stop_reads, 2, signal.SIGTERM, strategy="ddp", devices="cpu:2")
    assert seen[0] == seen[1] and seen[0][1] == "SIGTERM"
    assert seen[0][0][-1] and not any(seen[0][0][:-1]) and len(seen[0][0]) >= 3


# -- the front object pickles -----------------------------------------------------------------------------------------
class Seen(torch.utils.data.Dataset):
    """A dataset holding the Multicard, as a user hands it to the DataLoader's workers."""

    def __init__(self, mc):
        self.mc = mc

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        self.mc.print(f"a worker of rank {self.mc.rank}")  # rank 0's worker prints, the others do not
        return torch.tensor([self.mc.rank, self.mc.world_size, self.mc.device.type == "cpu"])


def pickled_job(mc, workers: int) -> list:
    model = mc.setup(nn.Linear(2, 1))
    sgd = mc.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(4, 2)).sum().backward()
    sgd.step()
    data = pickle.dumps(mc)
    copy = pickle.loads(data)
    loader = torch.utils.data.DataLoader(Seen(mc), batch_size=2, num_workers=workers,
                                         multiprocessing_context="spawn" if workers else None)
    return mc.gather((copy.rank, copy.world_size, copy.device.type, len(data), next(iter(loader)).tolist()))


def test_the_front_object_pickles_without_its_models_and_a_copy_tells_its_rank(capfd):
    mc = multicard.Multicard(devices="cpu")
    [(rank, world, device, size, seen)] = mc.launch(pickled_job, 0)
    assert (rank, world, device) == (0, 1, "cpu") and seen == [[0, 1, 1]] * 2
    assert size < 4096  # the set-up model and optimizer stay behind: a copy compares nothing
    assert capfd.readouterr().out == "a worker of rank 0\n" * 2


@pytest.mark.slow  # each rank spawns a worker that imports torch: the pickling itself is the test above
def test_a_spawned_dataloader_worker_gets_the_front_object_of_its_rank(capfd):
    processes = 3
    said = multicard.launch(pickled_job, 1, devices=f"cpu:{processes}")
    assert [row[:3] for row in said] == [(r, processes, "cpu") for r in range(processes)]
    assert [row[4] for row in said] == [[[r, processes, 1]] * 2 for r in range(processes)]
    assert capfd.readouterr().out == "a worker of rank 0\n" * 2

"""N processes take one process's steps where the step is uneven, data-dependent or random inside the dataset
(issue 29): a batch that does not split evenly (mc.local, the set-up loader's short last batch, a loader read
whole), optimizer.step(closure) (LBFGS), random draws in a Dataset's __getitem__ (seed_per_sample), and the
threads `multicard run` gives each rank. Each on 1, 2 and 3 gloo processes, against the plain one-process
script computed here."""

from __future__ import annotations

import dataclasses
import pickle
import random
import re

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

import multicard
from conftest import run_cli
from multicard.data.keyed import Seeded
from multicard.data.loaders import shard
from multicard.errors import UsageError
from multicard.jobs import devices
from multicard.yourloop.multicard import Multicard

# (samples, global batch, accumulate): a short last step of 5 rows ([3, 2] over 2, [2, 2, 1] over 3); one of 1
# row (the other processes take a repeat, weighted 0); and a last micro-batch of 1 row under accumulation
LOADERS = [(29, 12, 1), (25, 12, 1), (31, 12, 2)]
BATCHES = [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]  # a batch sampler of the user's: read whole


def data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(n)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


class Rows(Dataset):
    """Not a TensorDataset: the per-sample DataLoader path."""

    def __init__(self, dataset: TensorDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.dataset[i]


class Draws(Dataset):
    """Each sample draws from Python's random, torch's and numpy's global streams (a siamese pair, an
    augmentation): (index, three draws)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, random.random(), torch.rand(()).item(), numpy.random.rand()], dtype=torch.float64)


def train(model: nn.Module, optimizer, batches, shares=None) -> dict:
    """The plain loop (with the set-up loader's accumulation where `shares` is given)."""
    for inputs, targets in batches:
        share = shares.share if shares is not None else 1.0
        (F.mse_loss(model(inputs), targets) * share).backward()
        if shares is None or shares.step_ends:
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def lbfgs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cut=lambda t: t, setup=lambda o: o) -> tuple[dict, int]:
    """The one-card LBFGS script: 3 steps, each calling the closure as often as LBFGS decides."""
    optimizer = setup(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=15, history_size=5))
    calls = [0]

    def closure():
        optimizer.zero_grad()
        loss = F.mse_loss(model(cut(x)), cut(y))
        loss.backward()
        calls[0] += 1
        return loss

    for _ in range(3):
        optimizer.step(closure)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, calls[0]


def passes(loader, epochs: int = 2) -> list[torch.Tensor]:
    return [torch.cat(list(loader)) for _ in range(epochs)]


def steps_job(mc: Multicard, workers: int) -> list[dict]:
    out: dict = {}
    # 1. mc.local on a global batch of n rows, loss.backward() and mc.backward alike: the gradient of one process
    for n in (3, 5, 7):
        for how in ("plain", "mc"):
            model = mc.setup(nn.Linear(1, 1))
            with torch.no_grad():
                model.module.weight.fill_(1.0)
                model.module.bias.zero_()
            loss = model(mc.local(torch.arange(float(n)).view(n, 1))).mean()
            loss.backward() if how == "plain" else mc.backward(loss)
            out[f"local{n}{how}"] = model.module.weight.grad.item()
    # the set-up loader's short last step, over a TensorDataset and over a dataset of the user's
    for size, batch, k in LOADERS:
        for kind in (TensorDataset, Rows):
            dataset = data(size) if kind is TensorDataset else Rows(data(size))
            model = mc.setup(linear())
            loader = mc.setup_dataloader(DataLoader(dataset, batch, shuffle=True,
                                                    generator=torch.Generator().manual_seed(1)), accumulate=k)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                weights = train(model, optimizer, loader, loader)
            out[f"loader{size},{k},{kind.__name__}"] = weights
    # a batch sampler of the user's, read whole by every process
    model = mc.setup(linear())
    loader = mc.setup_dataloader(DataLoader(data(15), batch_sampler=BATCHES))
    out["whole"] = train(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    # 2. LBFGS with its closure, on an even (6 rows) and an uneven (5 rows) batch
    for n in (5, 6):
        out[f"lbfgs{n}"] = lbfgs(mc.setup(linear()), *data(n).tensors, mc.local, mc.setup_optimizers)
    # 3. draws inside __getitem__, keyed by (seed, epoch, index); processes seeded apart. Workers forked (spawned
    # ones import torch afresh: seconds each), kept over the passes: the epoch travels with each index
    torch.manual_seed(7 + mc.rank)
    forked = {"num_workers": workers, "multiprocessing_context": "fork", "persistent_workers": True} if workers else {}
    loader = mc.setup_dataloader(DataLoader(Draws(), 6, shuffle=True, generator=torch.Generator().manual_seed(2),
                                            **forked), seed_per_sample=True)
    out["draws"] = passes(loader)
    out["seed"] = torch.initial_seed()
    # a dataset with __getitems__ of its own (Subset, so every random_split): each sample keyed all the same
    loader = mc.setup_dataloader(DataLoader(Subset(Draws(), range(12)), 6, shuffle=True,
                                            generator=torch.Generator().manual_seed(2), **forked), seed_per_sample=True)
    out["subset"] = passes(loader)
    # after a pass whose last step was uneven: a batch this process makes itself is weighted by nothing
    out["after_pass"] = mc._job_state.share.weight
    # a model that returns a dataclass, on an uneven cut
    model = mc.setup(Recorded())
    mc.backward(model(mc.local(torch.arange(3.0).view(3, 1))).value.mean())
    out["dataclass"] = model.module.linear.weight.grad.item()
    return mc.gather(out)


@dataclasses.dataclass
class Output:
    value: torch.Tensor


class Recorded(nn.Module):
    """A model whose output is a dataclass (as many libraries' models return)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(1, 1)
        with torch.no_grad():
            self.linear.weight.fill_(1.0)
            self.linear.bias.zero_()

    def forward(self, x: torch.Tensor) -> Output:
        return Output(self.linear(x))


@pytest.fixture(scope="module", params=[1, 2, pytest.param(3, marks=pytest.mark.slow)])
def ranks(request) -> list[dict]:
    workers = 2 if request.param > 1 else 0  # DataLoader workers in every process of the jobs of several
    return multicard.launch(steps_job, workers, strategy="ddp", devices=f"cpu:{request.param}")


def test_a_batch_cut_by_mc_local_gives_one_process_gradient(ranks):
    for n in (3, 5, 7):  # d mean(w * x) / dw = mean(x) = (n - 1) / 2, whatever the cut
        for r in ranks:
            assert r[f"local{n}plain"] == pytest.approx((n - 1) / 2, rel=1e-6)
            assert r[f"local{n}mc"] == pytest.approx((n - 1) / 2, rel=1e-6)


@pytest.mark.parametrize("size, batch, accumulate", LOADERS)
def test_the_set_up_loaders_short_last_step_gives_one_process_weights(ranks, size, batch, accumulate):
    model = linear()
    plain = DataLoader(data(size), batch, shuffle=True, generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        expected = train(model, optimizer, plain)
    for r in ranks:
        for kind in ("TensorDataset", "Rows"):
            for name, value in r[f"loader{size},{accumulate},{kind}"].items():
                torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)


def test_a_loader_read_whole_weights_its_uneven_parts(ranks):
    model = linear()
    expected = train(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data(15), batch_sampler=BATCHES))
    for r in ranks:
        for name, value in r["whole"].items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [5, 6])
def test_lbfgs_with_its_closure_takes_one_process_steps(ranks, rows):
    x, y = data(rows).tensors
    expected, calls = lbfgs(linear(), x, y)
    assert len({r[f"lbfgs{rows}"][1] for r in ranks}) == 1  # every process called the closure alike: no hang
    for r in ranks:
        weights, _ = r[f"lbfgs{rows}"]
        for name, value in weights.items():  # 45 closure calls on 5 or 6 rows for 5 parameters (ill-conditioned)
            # amplify where a row sits in the sums (the cut) to ~4e-4; a process on its own path would be O(1)
            torch.testing.assert_close(value, expected[name], rtol=1e-3, atol=1e-5)


def test_draws_inside_getitem_are_one_process_draws(ranks):
    """Every sample of each epoch gets the draws it gets on one process (with the keying, on any number of
    processes and workers), keyed by rank 0's initial seed; epochs and samples draw differently."""
    one = shard(DataLoader(Draws(), 6, shuffle=True, generator=torch.Generator().manual_seed(2)), train=True,
                rank=0, world=1, device=torch.device("cpu"), local_batch=lambda b, k=1: b,
                seed_per_sample=ranks[0]["seed"])
    expected = [dict(sorted((int(row[0]), row[1:].tolist()) for row in rows)) for rows in passes(one)]
    for epoch in range(2):
        served = {int(row[0]): row[1:].tolist() for r in ranks for row in r["draws"][epoch]}
        assert served == expected[epoch]
    assert expected[0][0] != expected[1][0] and expected[0][0] != expected[0][1]
    for epoch in range(2):  # through Subset's own __getitems__, the same draws
        assert {int(row[0]): row[1:].tolist() for r in ranks for row in r["subset"][epoch]} == expected[epoch]


def test_an_uneven_weight_ends_with_its_pass_and_reaches_a_dataclass_output(ranks):
    for r in ranks:
        assert r["after_pass"] == 1.0
        assert r["dataclass"] == pytest.approx(1.0, rel=1e-6)  # d mean(w * [0, 1, 2]) / dw, whatever the cut


def test_seed_per_sample_leaves_the_programs_random_streams_where_they_were():
    def after(dataset: Dataset) -> list[float]:
        torch.manual_seed(3), random.seed(3), numpy.random.seed(3)
        loader = shard(DataLoader(dataset, 4, shuffle=True), train=True, rank=0, world=1, device=torch.device("cpu"),
                       local_batch=lambda b, k=1: b, seed_per_sample=5)
        list(loader)
        return [random.random(), torch.rand(()).item(), numpy.random.rand()]

    assert after(Draws()) == after(TensorDataset(torch.zeros(12)))  # the draws inside moved nothing outside
    seeded = Seeded(Draws(), 5)  # as a spawned worker receives it
    assert torch.equal(pickle.loads(pickle.dumps(seeded))[(1, 3)], seeded[(1, 3)]) and len(seeded) == 12
    with pytest.raises(UsageError, match="seed_per_sample"):
        shard(DataLoader(Draws(), batch_sampler=[[0, 1]]), train=True, rank=0, world=1, device=torch.device("cpu"),
              local_batch=lambda b, k=1: b, seed_per_sample=True)


# 4. threads: `multicard run` gives each of N ranks OMP_NUM_THREADS as a ddp process takes them, unless set
SCRIPT = ("import os, torch, multicard\nmc = multicard.Multicard()\nmc.barrier()\n"
          "line = f\"threads {os.environ['RANK']} {os.environ.get('OMP_NUM_THREADS')} {torch.get_num_threads()}\\n\"\n"
          "os.write(1, line.encode())\n")  # one write: the ranks' lines never interleave


def test_the_threads_each_rank_gets(monkeypatch):
    monkeypatch.setattr(devices, "cpu_cores", lambda: 16)
    assert devices.omp_threads(1, {}) == {}  # one process: torch's default, as torchrun leaves it
    assert devices.omp_threads(3, {}) == {"OMP_NUM_THREADS": "5"}
    assert devices.omp_threads(2, {"OMP_NUM_THREADS": "3"}) == {}
    monkeypatch.setattr(devices, "cpu_cores", lambda: 2)
    assert devices.omp_threads(3, {}) == {"OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("nprocs, given", [pytest.param(1, None, marks=pytest.mark.slow), (2, None),
                                           pytest.param(3, "2", marks=pytest.mark.slow)])  # a given one: above
def test_multicard_run_sets_omp_num_threads_for_each_rank(tmp_path, monkeypatch, nprocs, given):
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    result = run_cli("run", "--devices", f"cpu:{nprocs}", str(script), env={"OMP_NUM_THREADS": given} if given else {})
    assert result.returncode == 0, result.stderr
    seen = re.findall(r"threads (\d) (\S+) (\d+)", result.stdout)
    expected = given or devices.omp_threads(nprocs, {}).get("OMP_NUM_THREADS", "None")
    assert sorted(rank for rank, _, _ in seen) == [str(r) for r in range(nprocs)]
    for _, omp, count in seen:
        assert omp == expected
        if omp != "None":
            assert count == omp  # torch took it


def test_a_batch_with_fewer_rows_than_processes_is_one_error_not_a_nan_step():
    from multicard.data.uneven import Share

    with pytest.raises(UsageError, match="a batch of 1 row over 2 processes leaves some process none"):
        Share().local(torch.zeros(1, 3), 1, 2)
    assert Share().local(torch.arange(4.0).view(2, 2), 1, 2).tolist() == [[2.0, 3.0]]  # one row each is fine

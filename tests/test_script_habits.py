"""N processes take one process's steps through the habits of common scripts (issue 36): a collective per
evaluation batch, random draws cut as the loader deals, a summed loss, a stale uneven weight, a sampler's own draws
read whole, a shape by the global batch, an EMA of the set-up model, and a resumed loader skipped twice. Each on 1, 2
and 3 gloo processes (one job a world size, all the habits in it), against the plain one-process script computed
here."""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import types

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

import multicard
from conftest import run_cli
from multicard.data.habits import Habits
from multicard.data.loaders import shard
from multicard.errors import UsageError
from multicard.trainer.loop import evaluate
from multicard.yourloop.multicard import Multicard


def data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def weights(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Ids(Dataset):
    """Sample i is {"x": [i], "id": i} (per-sample collation, a dict batch, as a tokenized dataset's)."""

    def __len__(self) -> int:
        return 13

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.tensor([float(i)]), "id": i}


class Buffered(nn.Module):
    """A model with a buffer: ddp broadcasts buffers from rank 0 in every forward."""

    def __init__(self):
        super().__init__()
        self.linear = linear()
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


class ByBatchArgument(nn.Module):
    """A forward that shapes by the script's batch argument (the global batch), as pytorch/examples' vae does."""

    def __init__(self, batch: int):
        super().__init__()
        self.linear, self.batch = nn.Linear(4, 4), batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).view(self.batch, 2, 2)


def sgd(model, optimizer, batches, reduction: str = "mean", backward=None) -> dict:
    for x, y in batches:
        loss = F.mse_loss(model(x), y, reduction=reduction)
        backward(loss) if backward else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return weights(model)


def evaluation(mc: Multicard, out: dict) -> None:
    """1. every process the same number of evaluation batches: a gather per batch sees each sample once."""
    batch = 4 * mc.world_size  # one sample over a global batch: the old shards gave rank 0 one batch more
    for name, dataset in (("tensor", TensorDataset(torch.arange(batch + 1.0).view(-1, 1))), ("dict", Ids())):
        loader = mc.setup_dataloader(DataLoader(dataset, batch, shuffle=True), train=False)
        out[f"counts_{name}"] = counts = mc.gather((len(loader), len(list(loader))))
        if len(set(counts)) == 1:  # else a per-batch collective would wait for a partner forever
            seen = []
            for served in loader:  # the Hugging Face habit: gather each batch's predictions, add them to a metric
                rows = served[0] if name == "tensor" else served["x"]
                seen.append((mc.gather_in_order(rows.flatten()).tolist(), mc.all_reduce(rows.sum()).item()))
            out[f"seen_{name}"] = seen
    model = mc.setup(linear())  # the trainer's evaluate, exact with an empty batch (one row a batch, 3 samples)
    loader = mc.setup_dataloader(DataLoader(data(3), 1), train=False)
    out["evaluate"] = evaluate(mc, model, lambda o, y: torch.stack([F.mse_loss(o, y), o.sum()]), loader)


def cuts(mc: Multicard, out: dict) -> None:
    """2. mc.local and mc.randn_local give this process the rows of the samples the loader dealt it."""
    dataset = TensorDataset(torch.arange(11.0))  # batch 2N: whole batches, then an uneven last one
    loader = mc.setup_dataloader(DataLoader(dataset, 2 * mc.world_size, shuffle=True,
                                            generator=torch.Generator().manual_seed(4)))
    plain = DataLoader(dataset, 2 * mc.world_size, shuffle=True, generator=torch.Generator().manual_seed(4))
    pairs = zip(loader, plain, strict=True)
    out["local_is_dealt"] = [torch.equal(mine, mc.local(whole)) for (mine,), (whole,) in pairs]
    torch.manual_seed(5)
    ids = mc.local(torch.arange(7))
    out["noise"] = mc.gather_in_order((ids, mc.randn_local(7, 3)))  # each sample's noise, as one process's


def summed(mc: Multicard, out: dict) -> None:
    """3. a loss summed over the rows: mc.backward(loss, reduction="sum") takes one process's gradient."""
    for n in (6, 5):
        model = mc.setup(linear())
        x, y = data(n).tensors
        mc.backward(F.mse_loss(model(mc.local(x)), mc.local(y), reduction="sum"), reduction="sum")
        out[f"sum_grad{n}"] = model.module.weight.grad.clone()
    model = mc.setup(linear())
    loader = mc.setup_dataloader(DataLoader(data(29), 12, shuffle=True, generator=torch.Generator().manual_seed(1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        out["sum_loader"] = sgd(model, optimizer, loader, "sum", lambda loss: mc.backward(loss, reduction="sum"))


def stale(mc: Multicard, out: dict) -> None:
    """4. a weight belongs to the forwards on its split: not to the script's own batches after it."""
    x, y = data(4 * mc.world_size, 1).tensors
    own = [(x[4 * mc.rank: 4 * mc.rank + 4], y[4 * mc.rank: 4 * mc.rank + 4])] * 5  # each process's own 4 rows
    for line in (False, True):
        model = mc.setup(linear())
        if line:  # evaluation rows that do not split evenly (2 and 1 on 2 processes), under no_grad
            with torch.no_grad():
                model(mc.local(data(mc.world_size + 1).tensors[0]))
        out[f"own_batches{line}"] = sgd(model, torch.optim.SGD(model.parameters(), lr=0.1), own)
    model = mc.setup(linear())  # a teacher's no_grad forward on the split, then the student's: still weighted
    rows = mc.local(torch.arange(5.0).repeat(4, 1).t())
    with torch.no_grad():
        model(rows)
    model(rows).mean().backward()
    out["after_no_grad"] = model.module.weight.grad.clone()
    try:
        mc.local({"x": torch.zeros(4, 2), "y": torch.zeros(3)})
    except UsageError as e:
        out["fields"] = str(e)


def sampler_draws(mc: Multicard, out: dict) -> None:
    """5. minGPT's endless stream: RandomSampler(replacement=True, num_samples=...) read whole, dealt out."""
    torch.manual_seed(3407)  # minGPT's set_seed, in every process
    dataset = TensorDataset(torch.arange(50.0))
    loader = mc.setup_dataloader(DataLoader(dataset, 2 * mc.world_size, shuffle=False,
                                            sampler=RandomSampler(dataset, replacement=True, num_samples=10**9)))
    stream = iter(loader)
    out["stream"] = [mc.gather_in_order(next(stream)[0]) for _ in range(3)]
    loader = mc.setup_dataloader(DataLoader(data(16 * mc.world_size), 8 * mc.world_size), train=False)
    model = mc.setup(ByBatchArgument(8 * mc.world_size))  # its forward views by the global batch
    try:
        model(next(iter(loader))[0])
    except RuntimeError as e:
        out["view_notes"] = getattr(e, "__notes__", [])


def ema(mc: Multicard, out: dict) -> None:
    """7. an EMA of the set-up model (AveragedModel deep-copies it) is a plain model of the user's class."""
    model = mc.setup(Buffered())
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    out["copies"] = [type(averaged.module).__name__, type(copy.deepcopy(model)).__name__]
    loader = mc.setup_dataloader(DataLoader(data(24), 6))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        sgd(model, optimizer, [(x, y)])
        averaged.update_parameters(model)
    if out["copies"] == ["Buffered", "Buffered"] and mc.rank == 0:  # evaluated on rank 0 alone
        out["ema_eval"] = averaged(torch.ones(2, 4))
    out["ema"] = weights(averaged.module)
    mc.barrier()


def resumed(mc: Multicard, out: dict, path: str) -> None:
    """8. a resumed loader whose first batches the script skips itself (after mc.load put it back): said once."""
    dataset = data(12 * mc.world_size)

    def run(stop: int | None, skip: int = 0) -> str:
        model = mc.setup(linear())
        loader = mc.setup_dataloader(DataLoader(dataset, 2 * mc.world_size, shuffle=True,
                                                generator=torch.Generator().manual_seed(0)))
        state = {"model": model, "loader": loader, "step": 0}
        with contextlib.redirect_stderr(io.StringIO()) as err:
            if stop is None:
                mc.load(path, state)
            for step, (x, y) in enumerate(itertools.islice(loader, skip, None), state["step"] + skip):
                F.mse_loss(model(x), y).backward()
                if step + 1 == stop:
                    state["step"] = stop
                    mc.save(path, state)
                    break
        return err.getvalue()

    run(stop=3)
    out["resumed"] = run(stop=None)  # the docs' way: mc.load puts the loader back at its place
    out["skipped_again"] = run(stop=None, skip=3)


def habits_job(mc: Multicard, folder: str) -> list[dict]:
    out: dict = {}
    for part in (evaluation, cuts, summed, stale, sampler_draws, ema, resumed):
        try:  # each item on its own: one that fails leaves the others their say
            part(mc, out, f"{folder}/ckpt.pt") if part is resumed else part(mc, out)
        except Exception as e:
            out[f"failed {part.__name__}"] = repr(e)
    return mc.gather(out)


def said(ranks: list[dict], part) -> None:
    assert all(f"failed {part.__name__}" not in r for r in ranks), ranks[0].get(f"failed {part.__name__}")


@pytest.fixture(scope="module", params=[1, 2, pytest.param(3, marks=pytest.mark.slow)])
def ranks(request, tmp_path_factory) -> list[dict]:
    folder = str(tmp_path_factory.mktemp(f"habits_{request.param}"))
    return multicard.launch(habits_job, folder, strategy="ddp", devices=f"cpu:{request.param}", timeout=300)


def test_every_process_gets_as_many_evaluation_batches_and_each_sample_once(ranks):
    said(ranks, evaluation)
    world = len(ranks)
    for name, size in (("tensor", 4 * world + 1), ("dict", 13)):
        counts = ranks[0][f"counts_{name}"]
        assert len(set(counts)) == 1 and counts[0][0] == counts[0][1], counts
        for r in ranks:
            ids = sorted(i for batch, _ in r[f"seen_{name}"] for i in batch)
            assert ids == list(range(size))  # each sample once, through a gather per batch
            assert sum(total for _, total in r[f"seen_{name}"]) == sum(range(size))  # and an all_reduce per batch
    x, y = data(3).tensors
    expected = F.mse_loss(linear()(x), y).item()
    for r in ranks:
        assert r["evaluate"]["test_samples"] == 3
        assert r["evaluate"]["test_loss"] == pytest.approx(expected, rel=1e-6)


def test_mc_local_and_randn_local_give_the_rows_the_loader_dealt(ranks):
    said(ranks, cuts)
    torch.manual_seed(5)
    noise = torch.randn(7, 3)
    for r in ranks:
        assert r["local_is_dealt"] == [True] * -(-11 // (2 * len(ranks)))
        ids, drawn = r["noise"]
        assert ids.tolist() == list(range(7)) and torch.equal(drawn, noise)


def test_a_summed_loss_takes_one_process_gradient(ranks):
    said(ranks, summed)
    for n in (6, 5):
        model = linear()
        x, y = data(n).tensors
        F.mse_loss(model(x), y, reduction="sum").backward()
        for r in ranks:
            torch.testing.assert_close(r[f"sum_grad{n}"], model.weight.grad, rtol=1e-5, atol=1e-6)
    model = linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    plain = DataLoader(data(29), 12, shuffle=True, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        expected = sgd(model, optimizer, plain, "sum")
    for r in ranks:
        for name, value in expected.items():
            torch.testing.assert_close(r["sum_loader"][name], value, rtol=1e-5, atol=1e-6)


def test_an_uneven_weight_ends_where_its_rows_end(ranks):
    said(ranks, stale)
    rows = torch.arange(5.0).repeat(4, 1).t()
    model = linear()
    model(rows).mean().backward()
    for r in ranks:
        for name, value in r["own_batchesFalse"].items():
            assert torch.equal(r["own_batchesTrue"][name], value), name  # the no_grad line changes nothing
        torch.testing.assert_close(r["after_no_grad"], model.weight.grad, rtol=1e-6, atol=1e-6)
        assert r["fields"] == ("the batch's fields hold different numbers of rows along dim 0 (['x']: 4, ['y']: 3): "
                               "a global batch holds one row per sample in every field; cut each field with its own "
                               "mc.local")


def test_a_samplers_own_draws_are_read_whole_and_dealt_out(ranks):
    said(ranks, sampler_draws)
    world = len(ranks)
    torch.manual_seed(3407)
    dataset = TensorDataset(torch.arange(50.0))
    plain = DataLoader(dataset, 2 * world, sampler=RandomSampler(dataset, replacement=True, num_samples=10**9))
    expected = [batch for (batch,) in itertools.islice(plain, 3)]
    for r in ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["stream"], expected, strict=True))
        if world > 1:  # the global batch in the view's shape: said under torch's message
            assert r["view_notes"] == [f"multicard: {8 * world} is the global batch (the DataLoader's batch_size, "
                                       f"split over the processes): this process holds 8 of its rows; shape by the "
                                       f"rows a batch holds (x.size(0)), or by mc.local_batch({8 * world})"]


def one_process_ema() -> AveragedModel:
    """The EMA one process keeps of Buffered over data(24) in batches of 6: what N processes must end with."""
    model = Buffered()
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(data(24), 6):
        sgd(model, optimizer, [(x, y)])
        averaged.update_parameters(model)
    return averaged


def test_an_ema_of_the_set_up_model_is_a_plain_copy_that_runs_on_rank_0_alone(ranks):
    said(ranks, ema)
    averaged = one_process_ema()
    assert ranks[0]["copies"] == ["Buffered", "Buffered"]
    torch.testing.assert_close(ranks[0]["ema_eval"], averaged(torch.ones(2, 4)), rtol=1e-5, atol=1e-6)
    for r in ranks:
        for name, value in weights(averaged.module).items():
            torch.testing.assert_close(r["ema"][name], value, rtol=1e-5, atol=1e-6)


def test_a_resumed_loader_skipped_again_by_the_script_is_said_once_on_rank_0(ranks):
    said(ranks, resumed)
    line = (f"multicard: this loader was put back at its place by mc.load ({6 * len(ranks)} samples into epoch 1) "
            f"and its first batches are passed over with no forward of the set-up model")
    for r in ranks:
        assert line not in r["resumed"]
        assert r["skipped_again"].count(line) == (r is ranks[0]), r["skipped_again"]


def fsdp_ema(mc: Multicard) -> tuple[str, torch.Tensor]:
    """7 under fsdp: a copy of shards is one line; the EMA built before setup and set up too is the way."""
    plain = Buffered()
    averaged = AveragedModel(plain, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    model, averaged = mc.setup(plain), mc.setup(averaged)
    try:
        copy.deepcopy(model)
    except UsageError as e:
        refused = str(e)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in mc.setup_dataloader(DataLoader(data(24), 6)):
        sgd(model, optimizer, [(x, y)])
        averaged.update_parameters(model)
    with torch.no_grad():
        return refused, averaged(torch.ones(2, 4))  # every rank


@pytest.mark.slow  # two fsdp processes: ~15 s on 2 loaded cores
def test_an_ema_under_fsdp_is_set_up_with_the_model_and_a_copy_of_shards_is_one_line():
    refused, out = multicard.launch(fsdp_ema, strategy="fsdp", devices="cpu:2", timeout=300)
    assert refused.startswith("copy.deepcopy / AveragedModel of a model set up under fsdp: its parameters are this "
                              "process's shards")
    torch.testing.assert_close(out, one_process_ema()(torch.ones(2, 4)), rtol=1e-5, atol=1e-6)


# 5. a script that shapes by its batch argument in its test function (pytorch/examples' vae), run as a script
VIEW_SCRIPT = """
import torch, multicard
from torch.utils.data import DataLoader, TensorDataset
mc = multicard.Multicard()
batch_size = 8
test_loader = mc.setup_dataloader(DataLoader(TensorDataset(torch.zeros(16, 4)), batch_size), train=False)
for data, in test_loader:
    comparison = data.view(batch_size, 2, 2)
"""


@pytest.mark.slow  # a script under multicard run: its error reaches the excepthook (~13 s on 2 loaded cores)
def test_a_shape_by_the_global_batch_is_said_in_one_line(tmp_path):
    script = tmp_path / "vae.py"
    script.write_text(VIEW_SCRIPT)
    result = run_cli("run", "--devices", "cpu:2", str(script))
    assert result.returncode == 1
    assert ("multicard: 8 is the global batch (the DataLoader's batch_size, split over the processes): this process "
            "holds 4 of its rows; shape by the rows a batch holds (x.size(0)), or by mc.local_batch(8)"
            ) in result.stderr


def test_a_shape_error_that_names_the_global_batch_gains_one_line():
    habits = Habits()
    habits.dealt(128, 64)  # set up: a global batch of 128, 64 rows in this process
    shaped = [lambda: torch.zeros(64, 784).view(128, 1, 28, 28), lambda: torch.zeros(128) + torch.zeros(64),
              lambda: F.cross_entropy(torch.zeros(128, 10), torch.zeros(64, dtype=torch.long)),
              lambda: torch.zeros(3, 5) @ torch.zeros(4, 2)]  # the last names no batch: left as torch says it
    notes = []
    for make in shaped:
        with pytest.raises((RuntimeError, ValueError)) as error:
            make()
        habits.explain(error.value)
        notes.append(getattr(error.value, "__notes__", []))
    line = ("multicard: 128 is the global batch (the DataLoader's batch_size, split over the processes): this process "
            "holds 64 of its rows; shape by the rows a batch holds (x.size(0)), or by mc.local_batch(128)")
    assert notes == [[line]] * 3 + [[]]


# issue 33's two in these files, and the trainer's evaluate on an empty batch
def test_a_dim_the_batch_lacks_and_numpy_seeds_are_one_line_or_taken():
    mc = Multicard("single", "cpu")
    with pytest.raises(UsageError, match=r"dim=5: the batch has 2 dimensions \(shape \(4, 3\)\)"):
        mc.local(torch.zeros(4, 3), dim=5)
    with pytest.raises(UsageError, match="has no dimension 3"):
        mc.randn_local(4, 2, dim=3)
    assert mc.local(torch.arange(6).view(2, 3), dim=-1).tolist() == [[0, 1, 2], [3, 4, 5]]

    def made(seed) -> Dataset:
        loader = shard(DataLoader(Ids(), 4), train=True, rank=0, world=1, device=torch.device("cpu"),
                       local_batch=lambda b, k=1: b, seed_per_sample=seed)
        return loader.inner.dataset

    assert made(numpy.int64(3)).seed == 3 and made(True).seed == torch.initial_seed() % 2**63
    for wrong in (numpy.bool_(True), -1, numpy.int64(-2), 2.5):
        with pytest.raises(UsageError, match="give True .* or a seed >= 0"):
            made(wrong)


def test_the_trainers_evaluate_stays_exact_over_an_empty_batch():
    loader = shard(DataLoader(data(3), 1), train=False, rank=1, world=2, device=torch.device("cpu"),
                   local_batch=None)
    assert [len(x) for x, _ in loader] == [1, 0]  # one process of two: sample 1, then no rows left
    mc = types.SimpleNamespace(device=torch.device("cpu"), all_reduce=lambda sums: sums)
    result = evaluate(mc, linear(), lambda o, y: torch.stack([F.mse_loss(o, y), o.sum()]), loader)
    x, y = data(3).tensors
    assert result["test_samples"] == 1
    assert result["test_loss"] == pytest.approx(F.mse_loss(linear()(x[1:2]), y[1:2]).item(), rel=1e-6)

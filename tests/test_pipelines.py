"""A user's script, bit for bit: the plain DataLoader's own data order and random draws on one process, the same
steps on N; pipelines read whole by every process (iterables, batch samplers, hand-made batches); random tensors
drawn globally and cut into parts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, TensorDataset

import multicard
from conftest import HUNG_S, ROOT
from multicard.data.parts import part, samples


class Pairs(Dataset):
    """A map-style dataset that is not a TensorDataset: the set-up loader takes the DataLoader path."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Stream(IterableDataset):
    """An iterable of (x, y) samples, the same in every process."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __iter__(self):
        return zip(self.x, self.y, strict=True)


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(120, 4, generator=g)
    return x, x @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(120, 1, generator=g)


def make_loader(kind: str, generator: bool) -> DataLoader:
    x, y = regression_data()
    g = torch.Generator().manual_seed(42) if generator else None
    if kind == "tensors":
        return DataLoader(TensorDataset(x, y), 24, shuffle=True, generator=g)
    if kind == "samples":
        return DataLoader(Pairs(x, y), 24, shuffle=True, generator=g)
    if kind == "iterable":
        return DataLoader(Stream(x, y), 24)
    if kind == "batch_sampler":  # batches of varying size, drawn by the user's sampler
        sizes = BatchSampler(RandomSampler(range(120), generator=g), 30, drop_last=False)
        return DataLoader(Pairs(x, y), batch_sampler=sizes, generator=g)
    sampler = BatchSampler(RandomSampler(range(120), generator=g), 24, drop_last=False)  # batch_size=None
    return DataLoader(TensorDataset(x, y), batch_size=None, sampler=sampler, generator=g)


def regression(mc: multicard.Multicard | None, kind: str, generator: bool, reseed: int = 0) -> dict:
    """The plain loop (mc None), or the same loop with multicard's lines; what it ends with. The global RNG is
    seeded with `reseed` after the model is built (a loader without a generator draws its order from it)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    torch.manual_seed(reseed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader(kind, generator)
    if mc is not None:
        model, optimizer = mc.setup(model, optimizer)
        loader = mc.setup_dataloader(loader)
    steps = 0
    for _ in range(3):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            mc.backward(loss) if mc is not None else loss.backward()
            optimizer.step()
            steps += 1
    weights = (mc.unwrap(model) if mc is not None else model).state_dict()
    generator = loader.generator.get_state() if loader.generator is not None else None  # the user's own object
    return {"weights": {k: v.detach().clone() for k, v in weights.items()}, "steps": steps,
            "rng": torch.get_rng_state(), "after": torch.rand(3), "generator": generator}


N_PROCESS_CASES = [("tensors", True), ("samples", False), ("iterable", True), ("batch_sampler", True),
                   ("batch_none", True), ("tensors", False)]


def ddp_regressions(mc: multicard.Multicard) -> list[dict]:
    """Every case in one job (a job costs seconds to start)."""
    results = []
    for kind, generator in N_PROCESS_CASES:  # processes whose global RNGs differ still deal out one order
        results.append(regression(mc, kind, generator, reseed=100 + mc.rank))
    refused = []
    try:  # a batch sampler drawing from global RNGs seeded apart: each process would read other batches
        regression(mc, "batch_none", False, reseed=100 + mc.rank)
    except multicard.UsageError as error:
        refused.append(str(error))
    apart = DataLoader(range(48), 12, shuffle=True, generator=torch.Generator().manual_seed(mc.rank))
    try:  # a generator seeded differently in each process
        next(iter(mc.setup_dataloader(apart)))
    except multicard.UsageError as error:
        refused.append(str(error))
    return results, refused


@pytest.mark.parametrize("kind", ["tensors", "samples", "iterable", "batch_sampler", "batch_none"])
@pytest.mark.parametrize("generator", [True, False], ids=["generator", "global-rng"])
def test_one_process_ends_bit_identical_to_the_plain_script(kind, generator):
    plain = regression(None, kind, generator)
    ours = regression(multicard.Multicard("single", "cpu"), kind, generator)
    assert all(torch.equal(plain["weights"][k], ours["weights"][k]) for k in plain["weights"])
    assert plain["steps"] == ours["steps"] and torch.equal(plain["rng"], ours["rng"])  # the global RNG where the
    assert torch.equal(plain["after"], ours["after"])  # plain script leaves it: what it draws next is the same
    assert (plain["generator"] is None and ours["generator"] is None) or \
        torch.equal(plain["generator"], ours["generator"])


def test_the_users_generator_is_the_one_consumed():
    plain, loader = DataLoader(range(10), 4, shuffle=True, generator=torch.Generator().manual_seed(1)), None
    served = [b.tolist() for b in plain]
    mc = multicard.Multicard("single", "cpu")
    loader = mc.setup_dataloader(DataLoader(range(10), 4, shuffle=True, generator=torch.Generator().manual_seed(1)))
    assert [b.tolist() for b in loader] == served
    assert torch.equal(loader.generator.get_state(), plain.generator.get_state())


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_n_processes_take_the_steps_of_the_plain_script(world):
    ours, refused = multicard.launch(ddp_regressions, strategy="ddp", devices=f"cpu:{world}")
    assert "this loader serves each process other batches" in refused[0]
    assert "the DataLoader's generator gives each process another order" in refused[1]
    for (kind, generator), result in zip(N_PROCESS_CASES, ours, strict=True):
        plain = regression(None, kind, generator, reseed=100)  # rank 0's draws: the order every process deals out
        assert result["steps"] == plain["steps"], kind
        for name, value in plain["weights"].items():
            torch.testing.assert_close(result["weights"][name], value, rtol=0, atol=1e-6, msg=kind)


def test_a_short_last_batch_with_fewer_samples_than_processes_is_left_out():
    batches = DataLoader(Stream(*regression_data()), 7)  # 17 batches of 7, then one of 1
    mc = multicard.Multicard("single", "cpu")
    assert [len(x) for x, _ in mc.setup_dataloader(batches)][-2:] == [7, 1]
    from multicard.data.pipelines import Split

    parts = [[len(x) for x, _ in Split(batches, rank, 2)] for rank in range(2)]
    assert parts == [[4] * 17, [3] * 17]


def test_part_deals_every_field_of_a_batch_as_the_loader_deals():
    batch = {"x": torch.arange(10).view(5, 2), "words": ["a", "b", "c", "d", "e"], "pair": (torch.arange(5), "k")}
    first, second = part(batch, 0, 2), part(batch, 1, 2)
    assert first["x"].tolist() == [[0, 1], [4, 5], [8, 9]] and second["words"] == ["b", "d"]
    assert first["pair"][0].tolist() == [0, 2, 4] and second["pair"][1] == "k"
    assert samples(batch) == 5 and samples(("a", "b")) == 2
    columns = torch.arange(12).view(3, 4)  # batchify's layout: the batch along dim 1
    assert part(columns, 1, 2, dim=1).tolist() == [[1, 3], [5, 7], [9, 11]]
    assert part(columns, 1, 2, dim=1).is_contiguous()  # a script's .view(-1) works on its part


def random_parts(mc: multicard.Multicard) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    noise = mc.randn_local(6, 2)
    mine = mc.seed_per_process(5)
    return mc.gather_in_order(noise), torch.tensor(mc.gather((mine, torch.rand(()).item())))


def test_randn_local_cuts_the_noise_one_process_draws_and_seed_per_process_differs():
    noise, seeds = multicard.launch(random_parts, strategy="ddp", devices="cpu:2")
    torch.manual_seed(3)
    assert torch.equal(noise, torch.randn(6, 2))
    assert seeds[:, 0].tolist() == [5, 6] and seeds[0, 1] != seeds[1, 1]


def resumable(mc: multicard.Multicard, kind: str, generator: bool, path, stop: int | None, resume: bool) -> list:
    """A loop with dropout (the global RNG matters) that saves every step; its losses."""
    torch.manual_seed(0)
    model = mc.setup(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = mc.setup_dataloader(make_loader(kind, generator))
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    if resume:
        mc.load(path, state)
    losses = []
    while loader.epoch < 3:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            mc.backward(loss)
            optimizer.step()
            state["step"] += 1
            losses.append(loss.item())
            mc.save(path, state)
            if state["step"] == stop:
                return losses
    return losses


@pytest.mark.parametrize("kind, generator", [("tensors", False), ("samples", False), ("samples", True),
                                             ("batch_sampler", True), ("iterable", False)])
def test_a_run_resumed_mid_epoch_goes_on_exactly(tmp_path, kind, generator):
    whole = resumable(multicard.Multicard("single", "cpu"), kind, generator, tmp_path / "whole.pt", None, False)
    first = resumable(multicard.Multicard("single", "cpu"), kind, generator, tmp_path / "part.pt", 7, False)
    torch.manual_seed(123)  # whatever the streams are now: load puts them back
    rest = resumable(multicard.Multicard("single", "cpu"), kind, generator, tmp_path / "part.pt", None, True)
    assert first + rest == whole


@pytest.mark.slow  # ~5 s a script on 2 idle cores: 3 runs of each
@pytest.mark.parametrize("script", ["stream_loop.py", "word_language_model.py"])
def test_each_example_is_its_one_card_original_on_one_process_and_takes_its_steps_on_two(tmp_path, script):
    path = f"{ROOT}/examples/{script}"
    for name, command in [("plain", [sys.executable, path, "--plain"]), ("one", [sys.executable, path]),
                          ("two", [sys.executable, "-m", "multicard", "run", "--devices", "cpu:2", path])]:
        done = subprocess.run([*command, "--epochs", "1", "--save", str(tmp_path / f"{name}.pt")],
                              capture_output=True, text=True, timeout=HUNG_S, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("epoch 1: train loss") == 1  # rank 0 alone prints
    plain, one, two = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("plain", "one", "two"))
    assert all(torch.equal(plain[k], one[k]) for k in plain)
    for k in plain:
        torch.testing.assert_close(two[k], plain[k], rtol=0, atol=1e-5)


def fsdp_regressions(mc: multicard.Multicard) -> list[dict]:
    results = []
    for kind in ("iterable", "batch_sampler"):
        torch.manual_seed(0)
        model = mc.setup(nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # under fsdp: built over the shards
        loader = mc.setup_dataloader(make_loader(kind, True))
        for _ in range(3):
            for x, y in loader:
                optimizer.zero_grad()
                mc.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
        results.append(mc.state_dict(model))
    return results


def test_read_whole_pipelines_take_the_plain_steps_under_fsdp():
    ours = multicard.launch(fsdp_regressions, strategy="fsdp", devices="cpu:2")
    for kind, weights in zip(("iterable", "batch_sampler"), ours, strict=True):
        plain = regression(None, kind, True)["weights"]
        for name, value in plain.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6, msg=kind)


@pytest.mark.parametrize("make, accumulate, words", [
    (lambda: DataLoader(TensorDataset(torch.arange(8)), batch_size=None), 1, "serves one sample at a time"),
    (lambda: DataLoader(Stream(*regression_data()), 24), 2, "accumulate in your loop"),
])
def test_what_cannot_be_read_whole_is_one_clear_error(make, accumulate, words):
    mc = multicard.Multicard("single", "cpu")
    with pytest.raises(multicard.UsageError, match=words):
        mc.setup_dataloader(make(), accumulate=accumulate)

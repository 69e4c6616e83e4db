"""dp and dp-balanced. On the CPU, dp-balanced runs whole with CPU stand-ins for torch.nn.parallel's primitives
(scatter, replicate, parallel_apply) and is checked against one device: the split, the per-card losses, their
weighted combination, the gradients, the loop. The CUDA tests train a few steps on real cards."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from conftest import assert_same, cuda, run_cli, tiny_images
from multicard import safefs
from multicard.errors import UsageError
from multicard.jobs.devices import Devices
from multicard.jobs.dist import Job
from multicard.models.lenet import LeNet5
from multicard.strategies import STRATEGIES, choose
from multicard.strategies.balanced import Balanced, ParallelCriterion, ParallelModel, PerCard, Primitives, rows, split
from multicard.strategies.dp import DP
from multicard.strategies.single import Single
from multicard.trainer.config import TrainConfig
from multicard.trainer.loop import accuracy
from multicard.trainer.run import worker
from multicard.yourloop.multicard import Multicard


def chunk_sizes(n: int, cards: int) -> list[int]:
    return [len(c) for c in torch.arange(n).chunk(cards)]  # how torch.nn.parallel.scatter cuts dim 0


def scatter_like_torch(inputs, kwargs, devices):
    sizes = chunk_sizes(rows((inputs, kwargs)), len(devices))
    return split(inputs, sizes), split(kwargs, sizes)


def parallel_apply_in_turn(fns, inputs, kwargs, devices):
    return [f(*i, **k) for f, i, k in zip(fns, inputs, kwargs or [{}] * len(fns), strict=True)]


def replicate_as_self(module, devices):  # real replicas send their gradients back to `module`; so does this
    return [module] * len(devices)


CPU = Primitives(scatter=scatter_like_torch, replicate=replicate_as_self, parallel_apply=parallel_apply_in_turn)


def fixed_scatter(*sizes: int) -> Primitives:
    """A split unlike torch.chunk's, to show the targets follow whatever split the inputs got."""
    return Primitives(lambda i, k, d: (split(i, sizes), split(k, sizes)), replicate_as_self, parallel_apply_in_turn)


class Net(nn.Module):
    """Small, with no batch statistics (those differ per chunk under any DataParallel, by design)."""

    def __init__(self, form: str = "tensor"):
        super().__init__()
        self.body, self.head, self.form = nn.Linear(6, 8), nn.Linear(8, 3), form

    def forward(self, x):
        hidden = torch.tanh(self.body(x))
        logits = self.head(hidden)
        return {"tensor": logits, "tuple": (logits, hidden), "list": [logits, hidden],
                "dict": {"logits": logits, "hidden": hidden}}[self.form]


def criterion(form: str):
    ce = nn.CrossEntropyLoss()
    if form == "tensor":
        return ce

    def loss(out, y):  # a per-sample mean, as a criterion must be for the combination to be exact
        if form == "dict":
            return ce(out["logits"], y["label"]) + 0.1 * (out["hidden"].pow(2).mean(1) * y["weight"]).mean()
        return ce(out[0], y) + 0.1 * out[1].pow(2).mean()

    return loss


def batch(n: int, form: str = "tensor"):
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    return x, ({"label": y, "weight": torch.rand(n, generator=g)} if form == "dict" else y)


def both(form: str, n: int, cards: int, primitives: Primitives = CPU):
    """Loss and gradients on one device, and under dp-balanced over `cards` CPU stand-in cards."""
    torch.manual_seed(0)
    one, many = Net(form), Net(form)
    many.load_state_dict(one.state_dict())
    x, y = batch(n, form)
    fn = criterion(form)
    ref = fn(one(x), y)
    ref.backward()
    cpus = ["cpu"] * cards
    model, loss_fn = ParallelModel(many, cpus, primitives), ParallelCriterion(fn, cpus, primitives)
    outputs = model(x)
    loss = loss_fn(outputs, y)
    loss.backward()
    return ref, loss, outputs, one, many


def assert_same_grads(a: nn.Module, b: nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert q.grad is not None, name
        assert_same(q.grad, p.grad, rtol=rtol, atol=atol, what=name)


@pytest.mark.parametrize("n, cards, sizes", [(10, 3, [4, 4, 2]), (2, 3, [1, 1]), (7, 4, [2, 2, 2, 1]),
                                             (5, 4, [2, 2, 1]), (9, 1, [9])])
def test_outputs_stay_per_card_in_torch_chunks(n, cards, sizes):
    _, _, outputs, one, _ = both("tensor", n, cards)
    assert isinstance(outputs, PerCard) and outputs.sizes == sizes
    x, _ = batch(n)
    torch.testing.assert_close(torch.cat(list(outputs)), one(x))


@pytest.mark.parametrize("n, cards", [(10, 3), (2, 3), (7, 4), (64, 2), (9, 1)])
def test_loss_and_gradients_match_one_device(n, cards):
    ref, loss, _, one, many = both("tensor", n, cards)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)
    assert_same_grads(one, many)


def test_per_card_losses_and_their_weights():
    x, y = batch(10)
    net, fn = Net(), nn.CrossEntropyLoss()
    outputs = ParallelModel(net, ["cpu"] * 3, CPU)(x)
    per_card = ParallelCriterion(fn, ["cpu"] * 3, CPU).per_card(outputs, y)
    expected = [fn(net(x[a:b]), y[a:b]) for a, b in [(0, 4), (4, 8), (8, 10)]]
    for got, want in zip(per_card, expected, strict=True):
        torch.testing.assert_close(got, want)
    full = fn(net(x), y)
    assert abs(sum(per_card) / 3 - full) > 1e-3  # the plain average over cards (encoding's) is not the batch mean
    torch.testing.assert_close(sum(loss * n / 10 for loss, n in zip(per_card, [4, 4, 2], strict=True)), full)


def test_targets_follow_the_inputs_split():
    ref, loss, outputs, one, many = both("tensor", 10, 3, fixed_scatter(1, 6, 3))
    assert outputs.sizes == [1, 6, 3]
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)
    assert_same_grads(one, many)


@pytest.mark.parametrize("form", ["tuple", "list", "dict"])
@pytest.mark.parametrize("n, cards", [(10, 3), (2, 3), (5, 1)])
def test_any_output_structure(form, n, cards):
    ref, loss, outputs, one, many = both(form, n, cards)
    assert type(outputs[0]) is {"tuple": tuple, "list": list, "dict": dict}[form]
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)
    assert_same_grads(one, many)


def test_one_card_calls_the_module_itself():
    def no_replicas(module, devices):
        raise AssertionError("one card needs no replica")

    primitives = Primitives(scatter_like_torch, no_replicas, parallel_apply_in_turn)
    ref, loss, outputs, one, many = both("tensor", 6, 1, primitives)
    assert len(outputs) == 1
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)
    assert_same_grads(one, many)


def test_loss_and_accuracy_stack_is_exact():
    x, y = batch(10)
    net, ce = Net(), nn.CrossEntropyLoss()

    def stats(out, t):  # what the loop's evaluate() passes: a stack of batch means
        return torch.stack([ce(out, t).double(), (out.argmax(-1) == t).double().mean()])

    got = ParallelCriterion(stats, ["cpu"] * 3, CPU)(ParallelModel(net, ["cpu"] * 3, CPU)(x), y)
    assert got.shape == (2,)
    torch.testing.assert_close(got, stats(net(x), y), rtol=0, atol=1e-6)


def test_a_plain_output_passes_straight_to_the_criterion():
    x, y = batch(4)
    out, fn = Net()(x), nn.CrossEntropyLoss()
    assert torch.equal(ParallelCriterion(fn, [0, 1], CPU)(out, y), fn(out, y))


class CPUBalanced(Balanced):
    """dp-balanced's own model and criterion, over three "cards" that are the CPU (no CUDA card is reported)."""

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return ParallelModel(model, ["cpu"] * 3, CPU)

    def wrap_loss(self, fn):
        return ParallelCriterion(fn, ["cpu"] * 3, CPU)


def test_the_trainer_learns_what_one_device_learns(tmp_path):
    train, test = tiny_images(96, 0), tiny_images(50, 1)
    config = TrainConfig(epochs=2, batch_size=10, quiet=True, augment=False)  # 10 = 4 + 4 + 2 per step; last 6
    results = []
    for strategy in (Single(Devices("cpu", (0,))), CPUBalanced(Devices("cpu", (0,)))):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 32), nn.ReLU(), nn.Linear(32, 10))
        out = tmp_path / strategy.name
        out.mkdir()
        with safefs.Folder.open(out) as folder:  # the run folder as train() hands it on: made, and held
            summary = Multicard(strategy).launch(worker, model, train, test, nn.CrossEntropyLoss(), accuracy,
                                                 replace(config, out=str(out)), (None, None, "epoch"), folder.made)
        assert summary["strategy"] == strategy.name
        results.append(([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
                        model.state_dict()))
    (h1, w1), (h3, w3) = results
    for a, b in zip(h1, h3, strict=True):
        for key in ("train_loss", "test_loss", "test_accuracy"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
    for key in w1:
        torch.testing.assert_close(w3[key], w1[key], rtol=1e-4, atol=1e-5)


def test_evaluation_joins_the_outputs_on_the_first_card():
    x, _ = batch(10)
    model = ParallelModel(Net(), ["cpu"] * 3, CPU)
    assert isinstance(model(x), PerCard)  # training: left on their cards
    with torch.no_grad():
        torch.testing.assert_close(model(x), model.module(x))  # a test function's outputs.argmax(1) works
    model.eval()
    torch.testing.assert_close(model(x), model.module(x))


@pytest.mark.parametrize("cls", [DP, Balanced])
def test_every_card_is_reported_and_needs_a_sample(cls):
    strategy = cls(Devices("cuda", (0, 1, 2)))  # nothing here touches CUDA
    assert strategy.cards == [0, 1, 2] and strategy.world == 1
    assert strategy.local_batch(3) == 3 and strategy.local_batch(10) == 10
    with pytest.raises(UsageError, match=r"--batch-size 2 is smaller than the 3 cards"):
        strategy.local_batch(2)
    with pytest.raises(UsageError, match="at least 1"):
        strategy.local_batch(0)


def test_unwrap_gives_the_plain_model():
    net = Net()
    assert DP(Devices("cpu", (0,))).unwrap(nn.DataParallel(net)) is net
    assert Balanced(Devices("cpu", (0,))).unwrap(ParallelModel(net, ["cpu"], CPU)) is net


@pytest.mark.parametrize("name", ["dp", "dp-balanced"])
def test_choose_needs_cuda_cards(name):
    assert STRATEGIES[name].name == name
    assert choose(name, Devices("cuda", (0, 1)), Job()) == name
    with pytest.raises(UsageError, match=f"--strategy {name} needs CUDA cards, but this machine has none"):
        choose(name, Devices("cpu", (0,), note="no CUDA card found: training on the CPU"), Job())
    with pytest.raises(UsageError, match="--devices chose the CPU"):
        choose(name, Devices("cpu", (0, 1)), Job())


@pytest.mark.parametrize("name", ["dp", "dp-balanced"])
def test_cli_says_so_in_one_line_without_cards(name, tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", "--strategy", name, "--data", "synthetic", "--synthetic-samples", "8", "--quiet",
                "--out", str(out), env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"multicard: error: --strategy {name} needs CUDA cards")
    assert not out.exists()


def card_sets() -> list[tuple[int, ...]]:
    n = torch.cuda.device_count()
    return [(0,)] + ([tuple(range(n))] if n > 1 else [])


@cuda
@pytest.mark.parametrize("name", ["dp", "dp-balanced"])
def test_cuda_steps_match_one_card(name, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # same arithmetic on both sides
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    for ids in card_sets():
        torch.manual_seed(0)
        ref, model = LeNet5(), LeNet5()
        model.load_state_dict(ref.state_dict())
        one, many = Multicard(Single(Devices("cuda", (0,)))), Multicard(STRATEGIES[name](Devices("cuda", ids)))
        m1, m2 = one.setup(ref), many.setup(model)
        f1, f2 = one.setup_criterion(nn.CrossEntropyLoss()), many.setup_criterion(nn.CrossEntropyLoss())
        o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
        x, y = tiny_images(33, 2)[:]
        for step in range(3):  # 11 samples per step: uneven over 2 or more cards
            xs, ys = x[11 * step: 11 * step + 11].cuda(), y[11 * step: 11 * step + 11].cuda()
            l1, l2 = f1(m1(xs), ys), f2(m2(xs), ys)
            assert_same(l2, l1, rtol=1e-4, atol=1e-5, what="loss")
            for o, loss in ((o1, l1), (o2, l2)):
                o.zero_grad()
                loss.backward()
            assert_same_grads(ref, model, rtol=1e-4, atol=1e-5)
            o1.step()
            o2.step()


@cuda
@pytest.mark.parametrize("name", ["dp", "dp-balanced"])
def test_cuda_run_saves_a_plain_model_and_memory_per_card(name, tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", "--strategy", name, "--devices", "cuda", "--data", "synthetic", "--synthetic-samples", "64",
                "--epochs", "1", "--batch-size", "16", "--quiet", "--out", str(out))
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == name and len(summary["peak_memory_mb"]) == torch.cuda.device_count()
    assert "peak memory MB per card" in r.stdout + r.stderr
    state = torch.load(out / "model.pt", weights_only=True)
    assert state and not any(k.startswith("module.") for k in state)


@cuda
def test_cuda_batch_smaller_than_the_cards_is_an_error(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA cards (dp drives them from one process: a rehearsal on one card is not dp's path)")
    r = run_cli("train", "--strategy", "dp", "--devices", "cuda", "--batch-size", "1", "--quiet",
                "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "is smaller than the" in r.stderr


class OneCard(Balanced):
    """dp-balanced over one "card" (the CPU): nothing to scatter, nothing to combine."""
    cards = ["cpu"]


def test_dp_balanced_on_one_card_is_the_model_itself():
    strategy = OneCard(Devices("cpu", (0,)))
    model, criterion = LeNet5(), nn.CrossEntropyLoss()
    assert strategy.wrap_model(model) is model and strategy.wrap_loss(criterion) is criterion
    assert isinstance(CPUBalanced(Devices("cpu", (0,))).wrap_model(model), ParallelModel)

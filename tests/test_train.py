"""The training loop through the library API on tiny data: it learns, it reports, it saves a loadable model, and
it takes a user's own model, criterion and datasets."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import multicard
import multicard.trainer.run
from conftest import shown, tiny_images
from multicard.errors import UsageError
from multicard.models import LeNet5
from multicard.trainer.config import TrainConfig

EPOCH_KEYS = {"epoch", "train_loss", "test_loss", "test_accuracy", "lr", "samples_per_s", "seconds"}
SUMMARY_KEYS = {"strategy", "world_size", "devices", "epochs", "global_batch_size", "test_accuracy", "test_samples",
                "train_samples_per_s", "wall_s", "peak_memory_mb"}
# 192 bright-square images, Adam 4e-3 halved every epoch: 100% test accuracy in 3 epochs for every seed tried
RECIPE = dict(strategy="single", devices="cpu", epochs=3, batch_size=16, lr=4e-3, scheduler="step", lr_step=1,
              lr_gamma=0.5,
              augment=False, quiet=True, seed=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on 2 shared cores, more threads only wait on each other (and results stay bitwise
    repeatable within this module)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_lenet(out, **overrides) -> dict:
    torch.manual_seed(0)
    return multicard.train(LeNet5(), tiny_images(192, 0), tiny_images(50, 1), out=str(out), **{**RECIPE, **overrides})


def read_metrics(out) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return train_lenet(out), out


def test_learns_the_tiny_set(run):
    summary, out = run
    assert summary["test_accuracy"] >= 0.95
    metrics = read_metrics(out)
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]


def test_metrics_has_one_record_per_epoch(run):
    _, out = run
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert EPOCH_KEYS <= m.keys()
        assert m["test_samples"] == 50
        assert 0 <= m["test_accuracy"] <= 1 and m["seconds"] > 0 and m["samples_per_s"] > 0
        assert all(math.isfinite(m[k]) for k in ("train_loss", "test_loss"))


def test_lr_follows_steplr(run):
    _, out = run
    assert [m["lr"] for m in read_metrics(out)] == pytest.approx([4e-3, 2e-3, 1e-3])


def test_summary(run):
    summary, out = run
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["strategy"] == "single" and summary["world_size"] == 1 and summary["devices"] == ["cpu"]
    assert summary["epochs"] == 3 and summary["global_batch_size"] == 16 and summary["test_samples"] == 50
    assert summary["test_accuracy"] == read_metrics(out)[-1]["test_accuracy"]
    assert isinstance(summary["peak_memory_mb"], list) and len(summary["peak_memory_mb"]) == 1
    assert summary["peak_memory_mb"][0] > 0 and summary["wall_s"] > 0 and summary["train_samples_per_s"] > 0
    assert summary["config"]["lr"] == 4e-3 and summary["model"] == "LeNet5"
    assert summary["cpu_threads"] == [torch.get_num_threads()]  # the run was this process: its threads
    assert list(shown(out)) == ["curves.png", "metrics.jsonl", "model.pt", "summary.json"]


def test_saved_model_reloads_with_the_same_accuracy(run):
    summary, out = run
    state = torch.load(out / "model.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state)
    model = LeNet5()
    model.load_state_dict(state)
    test = tiny_images(50, 1)
    x, y = test[list(range(len(test)))]
    with torch.no_grad():
        accuracy = (model.eval()(x).argmax(1) == y).double().mean().item()
    assert accuracy == pytest.approx(summary["test_accuracy"], abs=1e-9)
    assert accuracy >= 0.95


def test_same_seed_same_run(run, tmp_path):
    _, first = run
    train_lenet(tmp_path)
    keys = ("train_loss", "test_loss", "test_accuracy", "lr")
    assert [[m[k] for k in keys] for m in read_metrics(tmp_path)] == [[m[k] for k in keys] for m in read_metrics(first)]
    a, b = torch.load(first / "model.pt", weights_only=True), torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_another_seed_shuffles_differently(run, tmp_path):
    _, first = run
    train_lenet(tmp_path, epochs=1, seed=1)
    assert read_metrics(tmp_path)[0]["train_loss"] != read_metrics(first)[0]["train_loss"]


def test_a_rerun_replaces_the_files(tmp_path):
    train_lenet(tmp_path, epochs=2)
    train_lenet(tmp_path, epochs=1)
    assert len(read_metrics(tmp_path)) == 1
    assert json.loads((tmp_path / "summary.json").read_text())["epochs"] == 1


def test_config_object_with_overrides(tmp_path):
    config = TrainConfig(**{**RECIPE, "epochs": 2, "out": str(tmp_path / "ignored")})
    torch.manual_seed(0)
    summary = multicard.train(LeNet5(), tiny_images(32, 0), tiny_images(20, 1), config, epochs=1, out=str(tmp_path))
    assert summary["epochs"] == 1 and len(read_metrics(tmp_path)) == 1
    assert not (tmp_path / "ignored").exists()
    assert config.epochs == 2  # the caller's config is not changed


# -- bad input fails before anything is written -------------------------------------------------------------------

@pytest.mark.parametrize("overrides, words", [
    (dict(devices="cpu:2"), "--strategy single trains on one device"),
    (dict(batch_size=0), "--batch-size 0: must be at least 1"),
    (dict(strategy="ddp", devices="cpu:2", batch_size=15), "--batch-size 15 does not split over 2 processes"),
    (dict(devices="banana"), "--devices banana: not understood"),
    (dict(devices="0"), "no CUDA card"),
])
def test_bad_input_writes_nothing(tmp_path, overrides, words):
    if "no CUDA card" in words and torch.cuda.is_available():
        pytest.skip("this machine has a card")
    with pytest.raises(UsageError, match=words):
        train_lenet(tmp_path / "out", **overrides)
    assert not (tmp_path / "out").exists()


# -- a user's own model, criterion and data ----------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, features: int = 8, classes: int = 3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x):
        return self.net(x)


def blobs(n: int, seed: int, features: int = 8, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Well-separated Gaussian blobs: a linear model gets them all right."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.eye(classes, features) * 6
    y = torch.randint(0, classes, (n,), generator=g)
    return centers[y] + torch.randn(n, features, generator=g), y


class Samples(Dataset):
    """A plain Dataset (not a TensorDataset): one (vector, int label) per index, collated by the DataLoader."""

    def __init__(self, n: int, seed: int):
        self.x, self.y = blobs(n, seed)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i: int):
        assert isinstance(i, int), "a plain Dataset is indexed one sample at a time"
        return self.x[i], int(self.y[i])


def test_own_model_criterion_and_tensor_dataset(tmp_path, capsys):
    torch.manual_seed(0)
    calls = []

    class CountingLoss(nn.CrossEntropyLoss):
        def forward(self, outputs, targets):
            calls.append(len(targets))
            return super().forward(outputs, targets)

    summary = multicard.train(MLP(), TensorDataset(*blobs(200, 0)), TensorDataset(*blobs(60, 1)),
                              criterion=CountingLoss(), strategy="single", devices="cpu", epochs=2, batch_size=32,
                              lr=2e-2, out=str(tmp_path), quiet=False, eval_batch_size=25)  # 1e-2: 83-95% by order
    assert summary["test_accuracy"] >= 0.95 and summary["test_samples"] == 60 and summary["model"] == "MLP"
    assert calls[:7] == [32] * 6 + [8]  # 200 training samples: 6 full batches and one of 8, the user's criterion
    printed = capsys.readouterr().out
    assert "epoch 1/2" in printed and "epoch 2/2" in printed  # not quiet: a line per epoch
    model = MLP()
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    x, y = blobs(60, 1)
    assert (model(x).argmax(1) == y).double().mean().item() == pytest.approx(summary["test_accuracy"])


def test_plain_dataset_goes_through_sample_collation(tmp_path, capsys):
    torch.manual_seed(0)
    test = Samples(45, 1)
    summary = multicard.train(MLP(), Samples(150, 0), test, strategy="single", devices="cpu", epochs=2,
                              batch_size=16, eval_batch_size=20, lr=2e-2, out=str(tmp_path), quiet=True)  # learns
    assert summary["test_samples"] == 45  # every test sample counted once, the last batch short
    assert summary["test_accuracy"] >= 0.95
    assert "epoch 1/2" not in capsys.readouterr().out  # quiet: no per-epoch lines
    assert len(read_metrics(tmp_path)) == 2


def test_own_metric_is_reported(tmp_path):
    torch.manual_seed(0)
    summary = multicard.train(MLP(), TensorDataset(*blobs(64, 0)), TensorDataset(*blobs(30, 1)),
                              metric=lambda outputs, targets: torch.tensor(0.25), strategy="single", devices="cpu",
                              epochs=1, batch_size=16, out=str(tmp_path), quiet=True)
    assert summary["test_accuracy"] == pytest.approx(0.25)


def test_without_test_data(tmp_path):
    torch.manual_seed(0)
    summary = multicard.train(MLP(), TensorDataset(*blobs(64, 0)), strategy="single", devices="cpu", epochs=2,
                              batch_size=16, out=str(tmp_path), quiet=True)
    assert "test_accuracy" not in summary and "test_samples" not in summary
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 2 and all("test_accuracy" not in m and "train_loss" in m for m in metrics)
    assert (tmp_path / "model.pt").is_file()


@pytest.mark.parametrize("override", [{"epochs": 0}, {"lr": -1.0}, {"eval_batch_size": 0}])
def test_the_library_refuses_what_the_cli_refuses(tmp_path, override):
    with pytest.raises(UsageError):
        multicard.train(LeNet5(), tiny_images(32), None, out=str(tmp_path), **override)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_diverging_run_is_one_clear_error_and_keeps_the_earlier_run(tmp_path):
    train_lenet(tmp_path, epochs=1)
    earlier = shown(tmp_path)
    with pytest.raises(UsageError, match=r"epoch 1: the training loss is nan: training diverged; try a smaller --lr"):
        train_lenet(tmp_path, lr=1e9)
    assert shown(tmp_path) == earlier


class Flat(nn.Module):
    """A user's conv model that flattens with .view(): it would fail on channels-last activations."""

    def __init__(self):
        super().__init__()
        self.conv, self.conv2, self.fc = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3), nn.Linear(4 * 26 * 26, 10)

    def forward(self, x):
        x = self.conv2(self.conv(x))
        return self.fc(x.view(len(x), -1))


@pytest.mark.parametrize("model, given, used", [(LeNet5, None, True), (LeNet5, False, False), (Flat, None, False)])
def test_channels_last_is_on_for_the_built_in_conv_models_only(tmp_path, monkeypatch, model, given, used):
    formats = []
    real = multicard.trainer.run.make_optimizer

    def spy(params, *rest):
        formats.extend(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
                       for p in params if p.dim() == 4 and p.shape[1] > 1)  # (one channel: both layouts agree)
        return real(params, *rest)

    monkeypatch.setattr(multicard.trainer.run, "make_optimizer", spy)
    torch.manual_seed(0)
    trained = model()
    summary = multicard.train(trained, tiny_images(64, 0), tiny_images(20, 1), out=str(tmp_path),
                              **{**RECIPE, "epochs": 1, "channels_last": given})
    assert formats and all(f == used for f in formats)
    assert summary["config"]["channels_last"] is used and summary["config"]["device_data"] is False
    fresh = model()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # plain weights either way
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), trained.state_dict().values(),
                                                     strict=True))


def test_compile_mode_reaches_torch_compile(tmp_path, monkeypatch):
    modes = []

    def compiled(model, mode="default"):  # what torch.compile would return, minus the minutes of compiling
        modes.append(mode)
        return model

    monkeypatch.setattr(torch, "compile", compiled)
    train_lenet(tmp_path, epochs=1, compile=True, compile_mode="reduce-overhead")
    assert modes == ["reduce-overhead"]
    with pytest.raises(UsageError, match="--compile-mode fast: choose one of default, reduce-overhead"):
        train_lenet(tmp_path, compile=True, compile_mode="fast")

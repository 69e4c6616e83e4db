"""Checkpoints: plain state_dicts (no "module." prefix), atomic writes, safe reads with one-line errors."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from conftest import bounded
from multicard.checkpoints import files as checkpoint
from multicard.errors import UsageError
from multicard.models import LeNet5


class Wrapper(nn.Module):
    """What DataParallel / DistributedDataParallel look like from outside: the model is `.module`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def lenet(seed: int = 0) -> LeNet5:
    torch.manual_seed(seed)
    return LeNet5()


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()  # on the CPU: where there is a card, DataParallel moved one there
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


def one_line_error(model: nn.Module, path) -> str:
    with pytest.raises(UsageError) as e:
        checkpoint.load(model, path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.mark.parametrize("wrap", [lambda m: m, Wrapper, lambda m: Wrapper(Wrapper(m)), nn.DataParallel],
                         ids=["plain", "wrapper", "wrapped-twice", "DataParallel"])
def test_save_writes_a_plain_state_dict(tmp_path, wrap):
    model = lenet(1)
    wrapped = wrap(model)
    if wrapped is not model:
        assert all(k.startswith("module.") for k in wrapped.state_dict())
    path = checkpoint.save(wrapped, tmp_path / "model.pt")
    assert path == tmp_path / "model.pt"
    state = torch.load(path, weights_only=True)
    assert list(state) == list(model.state_dict())
    assert not any("module." in k for k in state)
    fresh = lenet(2)
    assert not same_weights(fresh, model)
    fresh.load_state_dict(state)
    assert same_weights(fresh, model)
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temporary file left


def test_save_creates_the_folder_and_replaces_an_old_file(tmp_path):
    path = tmp_path / "a" / "b" / "model.pt"
    checkpoint.save(lenet(1), path)
    checkpoint.save(lenet(2), path)
    loaded = checkpoint.load(lenet(3), path)
    assert same_weights(loaded, lenet(2))
    assert os.listdir(path.parent) == ["model.pt"]


def test_load_round_trip(tmp_path):
    model = lenet(1)
    checkpoint.save(model, tmp_path / "model.pt")
    fresh = lenet(5)
    assert checkpoint.load(fresh, tmp_path / "model.pt") is fresh
    assert same_weights(fresh, model)
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(fresh.eval()(x), model.eval()(x))


@pytest.mark.parametrize("prefix", ["module.", "module.module."])
def test_load_accepts_prefixed_keys(tmp_path, prefix):
    model = lenet(1)
    torch.save({prefix + k: v for k, v in model.state_dict().items()}, tmp_path / "ddp.pt")
    fresh = checkpoint.load(lenet(4), str(tmp_path / "ddp.pt"))
    assert same_weights(fresh, model)


def test_load_into_a_wrapped_model_is_not_needed_but_a_dataparallel_state_loads(tmp_path):
    model = lenet(1)
    torch.save(nn.DataParallel(model).state_dict(), tmp_path / "dp.pt")
    assert same_weights(checkpoint.load(lenet(4), tmp_path / "dp.pt"), model)


# -- errors -----------------------------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    assert "no such file" in one_line_error(lenet(), tmp_path / "nothing.pt")


def test_a_folder_is_not_a_checkpoint(tmp_path):
    assert "no such file" in one_line_error(lenet(), tmp_path)


@pytest.mark.parametrize("content", [b"", os.urandom(256), b"hello, I am a text file\n", b"PK\x03\x04" + b"\0" * 40],
                         ids=["empty", "random", "text", "broken-zip"])
def test_not_a_checkpoint(tmp_path, content):
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    assert "not a readable PyTorch checkpoint" in one_line_error(lenet(), path)


def test_a_pickled_whole_model_is_refused_without_running_its_pickle(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(lenet(), path)  # the whole module: weights_only loading refuses it
    assert "not a readable PyTorch checkpoint" in one_line_error(lenet(), path)


@pytest.mark.parametrize("obj", [[torch.zeros(2)], {"weight": 3}, {"epoch": 3, "state": {"w": torch.zeros(1)}}],
                         ids=["list", "dict-of-int", "nested"])
def test_a_file_holding_no_state_dict(tmp_path, obj):
    path = tmp_path / "model.pt"
    torch.save(obj, path)
    assert "holds no state_dict of tensors" in one_line_error(lenet(), path)


def test_a_checkpoint_of_another_shape(tmp_path):
    torch.save(LeNet5(classes=5).state_dict(), tmp_path / "five.pt")
    message = one_line_error(LeNet5(), tmp_path / "five.pt")
    assert "does not fit the model" in message and "classifier.5.weight" in message and "(5, 84)" in message
    assert "(10, 84)" in message


def test_a_checkpoint_of_another_model(tmp_path):
    torch.save(nn.Linear(4, 2).state_dict(), tmp_path / "linear.pt")
    message = one_line_error(LeNet5(), tmp_path / "linear.pt")
    assert "does not fit the model" in message and "10 missing, 2 unexpected" in message


def test_a_checkpoint_with_one_extra_key(tmp_path):
    state = lenet().state_dict()
    state["head.bias"] = torch.zeros(3)
    torch.save(state, tmp_path / "extra.pt")
    message = one_line_error(lenet(), tmp_path / "extra.pt")
    assert "0 missing, 1 unexpected" in message and "head.bias" in message


def test_a_failed_load_leaves_the_model_unchanged(tmp_path):
    torch.save(LeNet5(classes=5).state_dict(), tmp_path / "five.pt")
    model, before = lenet(1), lenet(1)
    with pytest.raises(UsageError):
        checkpoint.load(model, tmp_path / "five.pt")
    assert same_weights(model, before)


# -- atomic save --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()], ids=["OSError", "KeyboardInterrupt"])
def test_a_failed_save_keeps_the_old_file(tmp_path, monkeypatch, error):
    path = tmp_path / "model.pt"
    checkpoint.save(lenet(1), path)
    old = path.read_bytes()
    seen = []

    def broken_save(obj, f, *args, **kwargs):
        seen.extend(p.name for p in tmp_path.glob("*.part"))  # the temporary file exists by now
        f.write(b"half a checkpoint")
        raise error

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(type(error)):
        checkpoint.save(lenet(2), path)
    assert seen, "save did not write through a temporary file"
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
    monkeypatch.undo()
    assert same_weights(checkpoint.load(lenet(3), path), lenet(1))


def test_a_failed_first_save_leaves_nothing(tmp_path, monkeypatch):
    def broken_save(obj, f, *args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(RuntimeError, match="boom"):
        checkpoint.save(lenet(), tmp_path / "model.pt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_checkpoint_write_stopped_by_a_file_size_limit_is_one_line(tmp_path):
    from multicard.checkpoints import files as checkpoint

    done = bounded("import resource, torch\nfrom multicard.checkpoints import files as checkpoint\n"
                   "from multicard.errors import UsageError\n"
                   "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
                   f"try:\n    checkpoint.write_atomic({{'w': torch.zeros(100000)}}, {str(tmp_path / 'state.pt')!r})\n"
                   "except UsageError as e:\n    print(e)")
    assert f"cannot write {tmp_path / 'state.pt'}" in done.stdout, done.stderr
    assert list(tmp_path.iterdir()) == [] and checkpoint is not None  # no temporary left

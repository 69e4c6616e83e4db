"""Deterministic mode (Multicard(deterministic=True), multicard train / run --deterministic): it reaches torch in
every rank, the cuBLAS setting is in every rank's environment, and an op without a deterministic version is one
line naming it, from the forward, from backward, and from a spawned rank through the CLI."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from torch import nn

import multicard
from conftest import run_cli
from multicard.errors import UsageError
from multicard.yourloop import determinism

WORKSPACE = determinism.WORKSPACE


pytestmark = pytest.mark.usefixtures("restored")  # conftest: deterministic mode put back after each test


def settings(mc: multicard.Multicard) -> list:
    """What each rank's torch and environment say."""
    return mc.gather((mc.deterministic, torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
                      torch.backends.cudnn.deterministic, os.environ.get(determinism.CUBLAS)))


def test_every_rank_runs_deterministic():
    assert multicard.launch(settings, devices="cpu:2", deterministic=True) == [(True, True, False, True, WORKSPACE)] * 2


def test_off_by_default_and_a_bad_value_of_the_variable_is_one_line(monkeypatch):
    with multicard.Multicard(devices="cpu") as mc:
        assert not mc.deterministic and not torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv(determinism.ENV, "yes")
    with pytest.raises(UsageError, match="^MULTICARD_DETERMINISTIC=yes: set it to 1"):
        multicard.Multicard(devices="cpu")


def test_a_cublas_setting_of_the_users_own_is_kept(monkeypatch):
    monkeypatch.setenv(determinism.CUBLAS, ":16:8")
    multicard.Multicard(devices="cpu", deterministic=True)
    assert os.environ[determinism.CUBLAS] == ":16:8" and determinism.environment()[determinism.CUBLAS] == ":16:8"


class Unpooled(nn.Module):
    """MaxUnpool2d has no deterministic version, on the CPU too."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4 * 4, 10)

    def forward(self, x):
        pooled, where = nn.functional.max_pool2d(x[:, :, :4, :4], 2, return_indices=True)
        return self.fc(nn.functional.max_unpool2d(pooled, where, 2).flatten(1))


class PutInBackward(torch.autograd.Function):
    """The identity, whose backward writes with put_ (no deterministic version without accumulate)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.clone().put_(torch.tensor([0]), torch.tensor([1.0]))


def test_an_op_without_a_deterministic_version_is_one_line_naming_it():
    mc = multicard.Multicard(devices="cpu", deterministic=True)
    model = mc.setup(Unpooled())
    with pytest.raises(UsageError, match=r"^max_unpooling2d_forward_out has no deterministic version") as e:
        model(torch.randn(2, 1, 28, 28))
    assert "\n" not in str(e.value) and e.value.__suppress_context__
    weight = nn.Parameter(torch.ones(3))
    with pytest.raises(UsageError, match=r"^put_ has no deterministic version"):
        mc.backward(PutInBackward.apply(weight).sum())
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):  # other errors as they were
        mc.setup(nn.Linear(3, 2))(torch.randn(2, 4))


MODEL = "from torch import nn\n\n\n" + inspect.getsource(Unpooled)  # the same model, as a file of its own


@pytest.mark.slow
def test_train_deterministic_in_spawned_ranks_says_the_op_in_one_line(tmp_path):
    (tmp_path / "unpooled.py").write_text(MODEL)
    r = run_cli("train", "--model", f"{tmp_path / 'unpooled.py'}:Unpooled", "--data", "synthetic",
                "--synthetic-samples", "64", "--epochs", "1", "--batch-size", "32", "--devices", "cpu:2",
                "--deterministic", "--quiet", "--out", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith(
        "multicard: error: max_unpooling2d_forward_out has no deterministic version")


SCRIPT = """
import os, sys
import torch
import multicard

mc = multicard.Multicard(devices="cpu:2")
line = f"{mc.rank} {mc.deterministic} {torch.are_deterministic_algorithms_enabled()} {os.environ.get(sys.argv[1])}"
sys.stdout.write(line + "\\n")
"""


@pytest.mark.slow
def test_run_deterministic_reaches_the_scripts_multicard_through_the_environment(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    r = run_cli("run", "--deterministic", "--devices", "cpu:2", str(tmp_path / "job.py"), determinism.CUBLAS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == [f"{rank} True True {WORKSPACE}" for rank in (0, 1)]

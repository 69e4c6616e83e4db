"""What stays each process's own when N processes take one process's steps (issue 34.3): BatchNorm's statistics
without sync_batchnorm are said at setup, in one line on rank 0, once."""

from __future__ import annotations

import pytest
from torch import nn

import multicard
from conftest import run_cli
from multicard.strategies import syncbn

SCRIPT = """import torch, multicard
from torch import nn
mc = multicard.Multicard(sync_batchnorm={sync})
torch.manual_seed(0)
cnn = mc.setup(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4)))
mlp = mc.setup(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))  # a second model: nothing said again
mc.backward(cnn(torch.randn(4, 1, 8, 8)).sum() + mlp(torch.randn(4, 4)).sum())
"""
LINE = "BatchNorm layers and trains on 2 processes"


@pytest.mark.parametrize("sync", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_batchnorm_left_per_process_is_one_line_on_rank_0_once(tmp_path, sync):
    (tmp_path / "bn.py").write_text(SCRIPT.format(sync=sync))
    result = run_cli("run", "--devices", "cpu:2", str(tmp_path / "bn.py"), env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "BatchNorm" in line]
    if sync:
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith(f"multicard: Sequential has 2 {LINE}"), result.stderr
        assert "Multicard(sync_batchnorm=True)" in said[0] and "--sync-bn" in said[0]


def test_one_process_or_a_model_without_batchnorm_says_nothing(capsys):
    mc = multicard.Multicard("single", "cpu")
    mc.setup(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    said = set()  # what the job said once
    syncbn.say_unsynced(nn.Sequential(nn.Linear(4, 4), nn.Dropout()), 2, True, said)
    syncbn.say_unsynced(nn.BatchNorm1d(4), 2, False, said)  # not rank 0
    assert "BatchNorm" not in capsys.readouterr().err
    syncbn.say_unsynced(nn.BatchNorm1d(4), 3, True, said)
    assert "BatchNorm1d has 1 BatchNorm layer and trains on 3 processes" in capsys.readouterr().err

"""One line, not torch's traceback (issue 40.9): an op with no deterministic version in the loss or in a
DataLoader worker under deterministic mode; mc.print with print's keywords; an evaluation batch with no rows
that the script's code cannot take, on some ranks only. On 1 and 2 gloo processes (3 in the slow suite) where
they differ."""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import multicard
from conftest import run_cli
from multicard.errors import UsageError
from multicard.yourloop.multicard import Multicard


def unpooled(x: torch.Tensor) -> torch.Tensor:
    """MaxUnpool2d has no deterministic version, on the CPU too."""
    pooled, where = nn.functional.max_pool2d(x, 2, return_indices=True)
    return nn.functional.max_unpool2d(pooled, where, 2)


class Unpooling(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return unpooled(torch.ones(1, 4, 4)).flatten()


def refused_job(mc: Multicard, where: str) -> None:
    model = mc.setup(nn.Linear(16, 1))
    if where == "loss":
        out = model(mc.local(torch.ones(6, 16)))
        mc.backward(unpooled(out.sum().view(1, 1, 1, 1).expand(1, 1, 2, 2)).mean())
    else:
        next(iter(mc.setup_dataloader(DataLoader(Unpooling(), batch_size=6, num_workers=1))))


REFUSED = r"^max_unpooling2d_forward_out{} has no deterministic version, and deterministic algorithms are on"


SLOW = pytest.mark.slow  # the 2-process worker case takes the loss's path to the line (and 3 processes)


@pytest.mark.parametrize("devices, where", [("cpu", "loss"), ("cpu", "worker"), ("cpu:2", "loss"),
                                            pytest.param("cpu:2", "worker", marks=SLOW),
                                            pytest.param("cpu:3", "loss", marks=SLOW),
                                            pytest.param("cpu:3", "worker", marks=SLOW)])
def test_an_op_refused_in_the_loss_or_a_worker_is_one_line(restored, devices, where):
    said = r" \(in a DataLoader worker\)" if where == "worker" else ""
    with pytest.raises(UsageError, match=REFUSED.format(said)):
        multicard.launch(refused_job, where, devices=devices, deterministic=True)


SCRIPT = """
import sys
import torch
import multicard
from torch import nn
from torch.utils.data import DataLoader
from test_one_line import Unpooling, unpooled

mc = multicard.Multicard()
model = mc.setup(nn.Linear(16, 1))
if sys.argv[1] == "loss":
    mc.backward(unpooled(model(mc.local(torch.ones(6, 16))).sum().view(1, 1, 1, 1).expand(1, 1, 2, 2)).mean())
else:
    for batch in mc.setup_dataloader(DataLoader(Unpooling(), batch_size=2, num_workers=1)):
        pass
"""


@pytest.mark.slow
@pytest.mark.parametrize("devices", ["cpu", "cpu:2"])
def test_multicard_run_deterministic_says_a_refused_op_in_one_line(tmp_path, devices):
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {"PYTHONPATH": os.path.dirname(__file__)}
    for where, said in (("loss", ""), ("worker", " (in a DataLoader worker)")):
        out = run_cli("run", "--quiet", "--deterministic", "--devices", devices, str(tmp_path / "job.py"), where,
                      env=env)
        assert out.returncode == 2 and out.stderr.startswith(
            f"multicard: error: max_unpooling2d_forward_out{said} has no deterministic version"), out.stderr
        assert len(out.stderr.splitlines()) == 1, out.stderr


def printed(mc: Multicard) -> list[str]:
    out = io.StringIO()
    mc.print("a", 1, sep="-", end="|", file=out, flush=True)
    mc.print("b", file=out, flush=False)
    return mc.gather(out.getvalue())


def test_print_takes_prints_keywords_on_rank_0(capsys):
    with Multicard("single", "cpu") as mc:
        assert printed(mc) == ["a-1|b\n"]
        mc.print("c", end="")
    assert capsys.readouterr().out == "c"  # on 2 processes: test_inside_the_model_each_rank_without_rows_says_why


class Flat(nn.Module):
    """Shapes its input by the rows it holds: x.reshape(len(x), -1) cannot take an empty batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x.reshape(len(x), -1))


class Stream(IterableDataset):
    def __iter__(self):
        yield from torch.ones(5, 2, 2)


def empty_job(mc: Multicard, outside: bool = True) -> list:
    model = mc.setup(Flat())
    said = [printed(mc)]
    shards = DataLoader(TensorDataset(torch.ones(mc.world_size + 1, 2, 2)), batch_size=mc.world_size)
    streamed = DataLoader(Stream(), batch_size=mc.world_size * 2)  # read whole: its last batch of 1 row
    for loader in (shards, streamed):
        try:
            with torch.no_grad():
                for batch in mc.setup_dataloader(loader, train=False):
                    model(batch[0] if isinstance(batch, (list, tuple)) else batch)
            said.append("taken")
        except UsageError as e:
            said.append(str(e))
    said = mc.gather(said)
    for x in mc.setup_dataloader(shards, train=False) if outside else ():  # in the script's own code
        x[0].reshape(len(x[0]), -1)
    return said


@pytest.mark.slow
def test_an_empty_evaluation_batch_in_the_scripts_own_code_names_the_rank_and_why():
    with pytest.raises(UsageError, match=r"^rank 1's evaluation batch 2 of 2 has no rows \(the 3 samples dealt "
                                         r"over 2 processes leave it 1, one a batch: .*cannot reshape tensor of 0 "
                                         r"elements.*or give the loader a batch_size of 4 or more"):
        multicard.launch(empty_job, devices="cpu:2")


@pytest.mark.slow
def test_an_empty_evaluation_batch_on_three_processes():
    with pytest.raises(UsageError, match=r"^rank [12]'s evaluation batch 2 of 2 has no rows \(the 4 samples"):
        multicard.launch(empty_job, devices="cpu:3")


def test_inside_the_model_each_rank_without_rows_says_why():
    said = multicard.launch(empty_job, False, devices="cpu:2")  # rank 0's gather of what every rank said
    assert [said[0][0], said[1][0]] == [["a-1|b\n", ""]] * 2  # mc.print with print's keywords, rank 0 alone
    said = [part[1:] for part in said]
    assert said[0] == ["taken", "taken"], said
    assert said[1][0].startswith("rank 1's evaluation batch 2 of 2 has no rows (the 3 samples dealt over 2 "
                                 "processes leave it 1, one a batch: one batch fewer than rank 0's, and every "
                                 "process gets as many), and the code that took it failed (cannot reshape")
    assert said[1][1].startswith("rank 1's evaluation batch 2 has no rows (the loader's batch holds 1, fewer than "
                                 "the 2 processes, row t going to process t % 2), and the code that took it failed")
    assert "drop_last=True" in said[1][1] and all("\n" not in line for line in said[1])

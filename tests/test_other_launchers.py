"""A script started by torchrun or SLURM rather than `multicard run` (issue 51.5 and 51.6): a rank's one line (a
bad input, the replica check's verdict) is what torchrun's summary shows as the root cause; the processes of one
machine divide its cores whatever the launcher told each (two "nodes" of one process rehearsed on one machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from conftest import HUNG_S, ROOT
from multicard.errors import UsageError
from multicard.jobs import failures
from multicard.jobs.devices import usable_cores
from multicard.jobs.launcher import free_port

PARTED = "after mc.setup: the replicas parted: the optimizer's lr (param group 0) is 0.1 on rank 0, 0.2 on rank 1"


def test_a_one_line_error_is_written_as_torchs_error_handler_writes_it(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv(failures.ERROR_FILE, str(path))
    failures.tell_torchrun(RuntimeError("a traceback's error: torch's own @record writes it, if the script asks"))
    assert not path.exists()
    failures.tell_torchrun(UsageError("--data nowhere: no such folder"))
    assert json.loads(path.read_text())["message"]["message"] == "UsageError: --data nowhere: no such folder"
    summary = str(ChildFailedError("script.py", {1: ProcessFailure(1, 4242, 1, str(path))}))  # torchrun's reading
    assert "traceback : UsageError: --data nowhere: no such folder" in summary
    monkeypatch.delenv(failures.ERROR_FILE)
    failures.tell_torchrun(UsageError("outside torchrun: nothing written"))  # no file named: nothing to do


PARTS = """import os
import torch
from torch import nn
import multicard
mc = multicard.Multicard("ddp", "cpu")
model = nn.Linear(4, 2)
model, optimizer = mc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1 * (1 + mc.rank)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("started", ["script", "cli"])
def test_under_torchrun_the_ranks_one_line_is_the_root_cause(tmp_path, started):
    script = tmp_path / "parted.py"
    script.write_text(PARTS)
    what = [str(script)] if started == "script" else \
        ["-m", "multicard", "train", "--devices", "cpu", "--data", "synthetic", "--batch-size", "3", "--quiet",
         "--out", str(tmp_path)]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), *what], capture_output=True, text=True, timeout=HUNG_S, cwd=ROOT)
    assert out.returncode != 0
    line = f"ReplicasParted: {PARTED}" if started == "script" else \
        "UsageError: --batch-size 3 does not split over 2 processes; use a multiple of 2 (e.g. 2 or 4)"
    root = out.stderr.split("Root Cause (first observed failure):")[-1]
    assert f"traceback : {line}" in root, out.stderr[-3000:]


THREADS = """import torch
import multicard
mc = multicard.Multicard("ddp", "cpu")
mc.barrier()
print(torch.get_num_threads())
mc.close()
"""


def two_nodes_of_one(omp: str | None) -> list[subprocess.CompletedProcess]:
    """Two ranks of one job on this machine, each told it is the only process on its node (torchrun --nnodes 2
    --nproc-per-node 1 sets these variables; SLURM's 2 nodes x 1 task read alike)."""
    port = str(free_port())
    clean = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    ranks = [subprocess.Popen([sys.executable, "-c", THREADS], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**clean, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                              "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                              **({"OMP_NUM_THREADS": omp} if omp else {})}) for r in (0, 1)]
    return [subprocess.CompletedProcess(p.args, p.wait(HUNG_S), *p.communicate()) for p in ranks]


def test_two_nodes_of_one_on_one_machine_divide_its_cores():
    ranks = two_nodes_of_one(None)
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr[-2000:] + ranks[1].stderr[-2000:]
    assert [int(r.stdout) for r in ranks] == [max(1, usable_cores() // 2)] * 2
    assert "threads on its" not in ranks[0].stderr + ranks[1].stderr


@pytest.mark.slow
def test_threads_the_user_asked_for_are_kept_and_more_than_the_cores_is_one_line():
    cores = usable_cores()
    ranks = two_nodes_of_one(str(cores))  # each asks for every core: twice the cores in all
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr[-2000:] + ranks[1].stderr[-2000:]
    assert [int(r.stdout) for r in ranks] == [cores] * 2
    said = f"multicard: 2 processes on this machine run {2 * cores} threads on its {cores} cores " \
           f"(OMP_NUM_THREADS={cores}): each waits on the others; set OMP_NUM_THREADS={max(1, cores // 2)}"
    assert said in ranks[0].stderr and "threads on its" not in ranks[1].stderr

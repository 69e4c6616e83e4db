"""One object owns a job's state (yourloop/job_state.py): made when a Multicard joins its job, closed with it. Two
jobs one after the other in one process (a notebook kernel running a cell twice, a test file) start clean: what is
said once is said again for the new job, counts start at zero, nothing of the first job's hooks is left; two
multicard.launch calls from one parent behave as each alone (the count of module-level state: test_layers.py)."""

from __future__ import annotations

import contextlib
import io
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multicard
from multicard.jobs import progress

G = torch.Generator().manual_seed(0)
DATA = TensorDataset(torch.randn(24, 4, generator=G), torch.randn(24, 1, generator=G))  # alike in every process


def a_job(path: Path, strategy: str = "single", devices: str = "cpu") -> dict:
    before = len(progress.open_jobs())  # Multicards other tests left open in this process
    """A short loop that saves, then resumes and skips the resumed batches itself (said once a job), on a Multicard
    closed at the end: what it said, the steps it counted, and the hooks left open after it."""
    with multicard.Multicard(strategy, devices) as mc:
        torch.manual_seed(0)
        model = mc.setup(nn.Linear(4, 1))
        optimizer = mc.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        loader = mc.setup_dataloader(DataLoader(DATA, 4, shuffle=True, generator=torch.Generator().manual_seed(0)))
        state = {"model": model, "loader": loader}
        for step, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            if step == 1:
                mc.save(path, state)
                break
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            mc.load(path, state)
            for _ in itertools.islice(loader, 2, 3):  # the script skips what mc.load skipped already
                pass
        steps, open_jobs = mc._job_state.steps, len(progress.open_jobs()) - before
    return {"said": said.getvalue(), "steps": steps, "open_during": open_jobs,
            "open_after": len(progress.open_jobs()) - before,
            "weight": model.weight.detach().clone()}


def test_two_jobs_one_after_the_other_in_one_process_each_behave_as_alone(tmp_path):
    first, second = a_job(tmp_path / "a.pt"), a_job(tmp_path / "b.pt")
    assert "its first batches are passed over with no forward" in first["said"]
    assert second["said"] == first["said"]  # said once a job: said again for the new one
    assert (first["open_during"], first["open_after"]) == (1, 0)
    assert (second["steps"], second["open_during"], second["open_after"]) == (first["steps"], 1, 0)
    assert torch.equal(first["weight"], second["weight"])


def launched(mc) -> dict:
    """On 2 processes: an optimizer nobody set up warned of once a job, a step count, and a stray line."""
    torch.manual_seed(0)
    model = mc.setup(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # over the set-up model: the job's steps
    stray = nn.Linear(4, 1)
    stray_optimizer = torch.optim.SGD(stray.parameters(), lr=0.1)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        for x, y in mc.setup_dataloader(DataLoader(DATA, 8)):
            for m, o in ((model, optimizer), (stray, stray_optimizer)):
                o.zero_grad()
                F.mse_loss(m(x), y).backward()
                o.step()
    return {"said": mc.gather(said.getvalue()), "steps": mc.gather(mc._job_state.steps),
            "weight": model.module.weight.detach().clone()}


def test_two_launches_from_one_parent_each_behave_as_alone():
    runs = [multicard.launch(launched, strategy="ddp", devices="cpu:2", replica_check="warn") for _ in range(2)]
    assert runs[0]["said"][0].count("that no set-up model holds") == 1 and runs[0]["said"][1] == ""
    assert runs[0]["steps"] == [3, 3]
    assert runs[1]["said"] == runs[0]["said"] and runs[1]["steps"] == runs[0]["steps"]
    assert torch.equal(runs[0]["weight"], runs[1]["weight"])

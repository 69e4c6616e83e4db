"""`multicard check script.py`: a user's own script run on one process and on two, what it trains compared step by
step; scripts that keep one process's steps pass, those that part fail naming the step, the weight and the cause;
bad input is one line."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import run_cli
from multicard.cli import main
from multicard.tools.check_script import compare

IMAGES = """
import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import multicard

parser = argparse.ArgumentParser()
parser.add_argument("--seed-by-rank", action="store_true")
args = parser.parse_args()
mc = multicard.Multicard()
torch.manual_seed(mc.rank if args.seed_by_rank else 0)
x, y = torch.randn(256, 1, 8, 8), torch.randint(0, 4, (256,))
model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
model, optimizer = mc.setup(model, optimizer)
loader = mc.setup_dataloader(DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
for inputs, labels in loader:
    optimizer.zero_grad()
    mc.backward(nn.functional.cross_entropy(model(inputs), labels))
    optimizer.step()
mc.print("trained")
"""

LANGUAGE = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import multicard

VOCAB = 32


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens):
        return self.head(self.norm(torch.tanh(self.mix(self.embed(tokens)))))


def main():
    mc = multicard.Multicard()
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (128, 13))
    model = TinyLM()
    decayed = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embed")]
    kept = [p for n, p in model.named_parameters() if p.dim() < 2 or n.startswith("embed")]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": kept, "weight_decay": 0.0}],
                                  lr=3e-3)
    model, optimizer = mc.setup(model, optimizer)
    loader = mc.setup_dataloader(DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=16,
                                            shuffle=True), accumulate=2)
    for epoch in range(2):
        for x, y in loader:
            with mc.no_backward_sync(model, enabled=not loader.step_ends):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                mc.backward(loss * loader.share)
            if loader.step_ends:
                optimizer.step()
                optimizer.zero_grad()


if __name__ == "__main__":
    main()
"""

DROPOUT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import multicard

mc = multicard.Multicard()
torch.manual_seed(0)
x, y = torch.randn(256, 10), torch.randn(256, 1)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = mc.setup(model, optimizer)
loader = mc.setup_dataloader(DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
for inputs, targets in loader:
    optimizer.zero_grad()
    mc.backward(nn.functional.mse_loss(model(inputs), targets))
    optimizer.step()
"""


def written(tmp_path, text: str, name: str = "train.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def verdict(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("check "))


@pytest.mark.slow
def test_an_image_classifier_seeded_alike_passes(tmp_path):
    r = run_cli("check", written(tmp_path, IMAGES))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert re.search(r": 8 optimizer steps on 1 process \(cpu\) and on 2 processes \(ddp, cpu:2\), .*: the largest "
                     r"difference \d\.\d\de-\d\d .*; tolerance 1e-04: PASS$", verdict(r.stdout))
    assert r.stdout.count("trained") == 2  # the script ran whole, once on each side (rank 0 prints)
    assert "possible cause" not in r.stdout


@pytest.mark.slow
def test_a_script_seeded_by_rank_fails_naming_the_step_the_weight_and_the_seeds(tmp_path):
    r = run_cli("check", "--steps", "2", written(tmp_path, IMAGES), "--seed-by-rank")
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    line = verdict(r.stdout)  # rank 1 made its own data: the first step's gradients are not one process's
    assert re.search(r": 2 optimizer steps on .*: the runs part at step 1: (0|4)\.(weight|bias) differs by "
                     r"\S+ \(tolerance 1e-04\): FAIL$", line), line
    assert "trained" not in r.stdout  # --steps 2 ended the script there, on each side
    assert "possible cause: the processes are seeded apart (torch.initial_seed() 0, 1 on ranks 0..1" in r.stdout


@pytest.mark.slow
def test_a_language_model_with_decay_groups_and_accumulation_passes(tmp_path):
    r = run_cli("check", "--tolerance", "1e-5", written(tmp_path, LANGUAGE))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert re.search(r": 16 optimizer steps on .*: PASS$", verdict(r.stdout))  # 2 epochs of 4 steps of 2 x 16
    one, two = map(float, re.search(r"step 1: (\S+) on one process, (\S+) on 2 processes", r.stdout).groups())
    assert one == pytest.approx(two, abs=1e-5) and one > 3  # ln 32 = 3.47: the loss each side passed


@pytest.mark.slow
def test_a_loop_with_dropout_parts_at_the_first_step_and_dropout_is_named(tmp_path):
    r = run_cli("check", written(tmp_path, DROPOUT))
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert re.search(r": the runs part at step 1: \S+ differs by \S+ \(tolerance 1e-04\): FAIL$", verdict(r.stdout))
    assert "possible cause: dropout in Sequential (2): each process draws the masks of its own rows" in r.stdout


def record(*steps: dict[str, float], models: int = 1) -> list[dict]:
    """One rank's records, as recorder.py writes them: each step's weights (filled with one value) and loss."""
    info = [dict(name="Net", dropout=[], batchnorm=[], precision="fp32", sync_batchnorm=False, strategy="ddp",
                 world=2, seed=0, random="r")] * models
    return [dict(models=info, steps=[dict(weights={(0, k): torch.full((3,), v) for k, v in s.items()},
                                          losses=[(1.0, "mean")], random="r") for s in steps])]


def test_the_verdict_names_the_first_step_and_weight_beyond_the_tolerance():
    one = record({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0})
    two = record({"a": 1.0, "b": 2.0 + 5e-5}, {"a": 1.0 + 1e-5, "b": 2.0 + 3e-4}, {"a": 1.1, "b": 2.0 + 3e-4})
    v = compare("s.py", one, two, "1 process (cpu)", "2 processes (ddp, cpu:2)", 1e-4)
    assert not v.ok and v.parted[:2] == (2, "b") and v.parted[2] == pytest.approx(3e-4, rel=1e-3)
    assert v.lines()[0].endswith("the runs part at step 2: b differs by 3.00e-04 (tolerance 1e-04): FAIL")
    assert v.lines()[-1] == ("possible cause: none seen; look for code that depends on the rank or the number of "
                             "processes")
    assert compare("s.py", one, two, "one", "two", 1e-3).parted[:2] == (3, "a")  # b is within it: a is the first
    loose = compare("s.py", one, two, "one", "two", 0.2)
    assert loose.ok and loose.worst_at == (3, "a") and loose.lines()[0].endswith("tolerance 2e-01: PASS")


def test_runs_that_take_other_numbers_of_steps_fail_though_their_steps_agree():
    one, two = record({"a": 1.0}, {"a": 1.0}), record({"a": 1.0})
    v = compare("s.py", one, two, "1 process (cpu)", "2 processes (ddp, cpu:2)", 1e-4)
    assert not v.ok and v.steps == 1
    assert "the runs took different numbers of optimizer steps: 2 on one process, 1 on 2 processes" in v.lines()


@pytest.mark.parametrize("argv, line", [
    (["check", "missing.py"], "multicard: error: check: no such script missing.py"),
    (["check", "--model", "lenet5", "SCRIPT"], "multicard: error: check SCRIPT: --model belongs to the built-in "
                                               "check (no script): your script builds its own model and data"),
    (["check", "--strategy", "fsdp", "SCRIPT"], "multicard: error: check SCRIPT: --strategy fsdp: the check compares "
                                                "whole weights, under ddp, dp, dp-balanced"),
    (["check", "--devices", "cpu", "SCRIPT"], "multicard: error: check SCRIPT: --devices cpu: parity needs 2 or more "
                                              "devices, e.g. cpu:2 or 0,1"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, argv, line, capfd):
    script = written(tmp_path, DROPOUT)
    assert main([script if a == "SCRIPT" else a for a in argv]) == 2  # said before any process starts
    assert capfd.readouterr() == ("", line.replace("SCRIPT", script) + "\n")


def test_a_script_that_sets_up_no_model_is_one_line(tmp_path, capfd):
    script = written(tmp_path, "import multicard\nmc = multicard.Multicard()\nmc.print('hello')\n")
    assert main(["check", script]) == 2
    out, err = capfd.readouterr()
    assert out == "hello\n" and err.splitlines() == [
        f"multicard: check: running {script} on one process",
        f"multicard: error: check: {script} set up no model (mc.setup): the check compares the models a script sets "
        f"up, as written for multicard run"]


def test_a_script_that_fails_shows_its_own_error_once_then_one_line(tmp_path, capfd):
    script = written(tmp_path, "import multicard\nmc = multicard.Multicard()\nraise ValueError('my own bug')\n")
    assert main(["check", script]) == 2
    err = capfd.readouterr().err
    assert err.count("ValueError: my own bug") == 1
    assert "recorder.py" not in err  # the traceback starts in the script, as python script.py shows it
    assert err.splitlines()[-1] == (f"multicard: error: check: {script} failed on one process: rank 0 failed with exit "
                                    f"code 1 (its output is above)")

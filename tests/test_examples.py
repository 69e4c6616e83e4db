"""The examples in examples/ run as a user would run them: under python, multicard run and torchrun."""

import difflib
import re
import subprocess
import sys

import pytest
import torch

from conftest import HUNG_S, ROOT, where_measured
from test_figures import example

EXAMPLES = f"{ROOT}/examples"
BIN = sys.executable.rsplit("/", 1)[0]


def run(*command: str, cwd) -> subprocess.CompletedProcess:
    out = subprocess.run(list(command), capture_output=True, text=True, timeout=HUNG_S, cwd=cwd)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_own_model_example(tmp_path):
    out = run(sys.executable, f"{EXAMPLES}/own_model.py", "--strategy", "single", "--devices", "cpu", "--epochs", "2",
              cwd=tmp_path)
    accuracy = float(out.stdout.strip().splitlines()[-1].split()[-1].rstrip("%"))
    assert accuracy > 90


def code_lines(path: str) -> list[str]:
    """The file's lines without its module docstring and blank lines."""
    text = open(path).read()
    body = text.split('"""', 2)[2]
    return [line for line in body.splitlines() if line.strip()]


def test_your_loop_differs_from_the_one_card_script_by_at_most_10_lines():
    one, mine = code_lines(f"{EXAMPLES}/mnist_one_card.py"), code_lines(f"{EXAMPLES}/mnist_your_loop.py")
    changed = [line for line in difflib.ndiff(one, mine) if line.startswith("+ ")]
    assert 0 < len(changed) <= 10, changed


@pytest.mark.slow
def test_your_loop_on_two_processes_learns_and_counts_every_test_digit_once(tmp_path, monkeypatch):
    """And gives the README's digits where they were measured (tests/test_figures.py)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the launcher's own choice: cores // 2 each
    out = run(f"{BIN}/multicard", "run", "--devices", "cpu:2", f"{EXAMPLES}/mnist_your_loop.py", "--epochs", "1",
              "--save-model", cwd=tmp_path)
    tests = re.findall(r"Accuracy: (\d+)/(\d+)", out.stdout)
    assert len(tests) == 1 and tests[0][1] == "1000"  # printed by rank 0 alone, over the whole test set
    threads = int(re.search(r"(\d+) threads? each", out.stderr)[1])  # run's start line
    if where_measured() and (2, threads) in example():
        assert int(tests[0][0]) == example()[2, threads]
    assert int(tests[0][0]) >= 850
    assert out.stdout.count("Train Epoch: 1 [0/4000 (0%)]") == 1
    monkeypatch.syspath_prepend(EXAMPLES)
    from mnist_one_card import Net  # the one-card script's own Net loads the saved weights as they are

    Net().load_state_dict(torch.load(tmp_path / "mnist_cnn.pt", weights_only=True))


@pytest.mark.slow
def test_your_loop_under_python_and_torchrun(tmp_path):
    alone = run(sys.executable, f"{EXAMPLES}/mnist_your_loop.py", "--epochs", "1", "--dry-run", cwd=tmp_path)
    started = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  f"{EXAMPLES}/mnist_your_loop.py", "--epochs", "1", "--dry-run", cwd=tmp_path)
    for out in (alone, started):
        assert len(re.findall(r"Accuracy: \d+/1000", out.stdout)) == 1


@pytest.mark.slow
def test_accumulation_example(tmp_path):
    out = run(f"{BIN}/multicard", "run", "--devices", "cpu:2", f"{EXAMPLES}/accumulate.py", "--epochs", "1",
              cwd=tmp_path)
    steps, accuracy = re.search(r"(\d+) steps of 64 samples, test accuracy (\d+)/1000", out.stdout).groups()
    assert int(steps) == 62 and int(accuracy) >= 700


def test_the_readme_shows_the_real_diff():
    readme = open(f"{ROOT}/README.md").read()
    block = readme.split("```diff\n", 1)[1].split("```", 1)[0].splitlines()
    one, mine = code_lines(f"{EXAMPLES}/mnist_one_card.py"), code_lines(f"{EXAMPLES}/mnist_your_loop.py")
    assert sorted(line[1:] for line in block if line[0] == "-") == sorted(set(one) - set(mine))
    assert sorted(line[1:] for line in block if line[0] == "+") == sorted(set(mine) - set(one))

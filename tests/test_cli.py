"""The command line, each run in a fresh interpreter: help, a small end-to-end run, env, and bad input answered with
exit code 2 and one line (never a traceback, never a damaged --out folder); Ctrl-C while the command line is read."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from conftest import HUNG_S, ROOT, run_cli, shown
from multicard.cli import main
from multicard.models import LeNet5
from multicard.tools.bench_report import cpu_name
from multicard.trainer.config import FLAG_GROUPS, TrainConfig

FAST = {"OMP_NUM_THREADS": "1"}  # 2 shared cores: one thread per run is quicker
CHEAP_DATA = ("--data", "synthetic", "--synthetic-samples", "64", "--quiet")  # a case's own --data comes later


def test_help_is_fast_and_lists_the_commands():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert "train" in result.stdout and "env" in result.stdout and result.stderr == ""
    examples = result.stdout.split("examples:\n", 1)[1]  # commands to copy, and where the docs are
    assert "  multicard run --devices cpu:2 my_script.py " in examples and "docs/cli.md" in examples


def test_every_command_says_what_it_does_in_its_help(capsys):
    for command in ("train", "check", "run", "env", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        usage, description = capsys.readouterr().out.split("\n\n")[:2]
        assert usage.startswith(f"usage: multicard {command}") and description[0].isupper(), (command, description)


def test_train_help_lists_the_flags_in_groups():
    result = run_cli("train", "--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--batch-size", "--strategy", "--devices", "--out", "--epochs", "--data", "--data-dir", "--download",
                 "--lr", "--seed", "--quiet"):
        assert flag in result.stdout
    assert "dp-balanced" in result.stdout  # the strategy choices are shown
    titles = re.findall(r"^(\w+):$", result.stdout, re.M)
    assert titles == ["options", "data", "model", "optimization", "strategy", "checkpoints", "output"]
    grouped = [name for names in FLAG_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in fields(TrainConfig))  # each flag in one group
    strategy = result.stdout.split("\nstrategy:\n", 1)[1].split("\ncheckpoints:\n")[0]
    assert "--devices" in strategy and "--lr" not in strategy


def test_the_documented_way_to_load_a_model_runs_as_written(tmp_path):
    """docs/outputs.md: `multicard.models.build(...)` after a bare `import multicard` (the subpackage loads on use:
    `multicard --help` still imports no torch)."""
    line = re.search(r"`(model = multicard\.models\.build.*?)`", Path(ROOT, "docs/outputs.md").read_text(), re.S)[1]
    (tmp_path / "runs" / "train").mkdir(parents=True)
    torch.save(LeNet5().state_dict(), tmp_path / "runs" / "train" / "model.pt")
    code = f"import torch\nimport multicard\n{line.replace(chr(10), ' ')}\nprint(type(model).__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=HUNG_S)
    assert result.returncode == 0 and result.stdout == "LeNet5\n", result.stderr


def test_importing_the_cli_does_not_import_torch():
    code = ("import sys, multicard, multicard.cli; multicard.cli.parser(); multicard.TrainConfig; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=HUNG_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_env():
    result = run_cli("env", env=FAST)
    assert result.returncode == 0, result.stderr
    assert f"torch {torch.__version__}" in result.stdout and "CUDA available" in result.stdout
    assert "gloo" in result.stdout and "launcher" in result.stdout
    # the CPU model and the threads: what moves a result's last digits (OMP_NUM_THREADS=1 here: 1 everywhere)
    assert f"CPU: {cpu_name()}; torch threads: 1 in one process, 1 in each of 2 (cpu:2); OMP_NUM_THREADS=1 here" \
        in result.stdout.splitlines()


def test_train_end_to_end(tmp_path):
    out = tmp_path / "run"
    result = run_cli("train", "--epochs", "1", "--data", "synthetic", "--synthetic-samples", "256", "--out", str(out),
                     "--quiet", env=FAST)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    lines = (result.stdout + result.stderr).splitlines()  # quiet: what ran and how it ended, nothing per epoch
    assert len(lines) == 2 and "training LeNet5" in lines[0] and lines[1].startswith("multicard: done: "), lines
    assert list(shown(out)) == ["curves.png", "metrics.jsonl", "model.pt", "summary.json"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["epoch"] == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 1 and summary["strategy"] == "single" and summary["test_samples"] == 1024
    assert summary["config"]["data"] == "synthetic" and summary["config"]["synthetic_samples"] == 256
    state = torch.load(out / "model.pt", weights_only=True)
    from multicard.models import LeNet5

    LeNet5().load_state_dict(state)  # strict: every key and shape fits


# -- bad input: exit 2, one line, out folder untouched ------------------------------------------------------------

def write_idx_set(folder: Path, corrupt: str | None = None) -> None:
    """Four valid, tiny MNIST IDX files (gzipped); `corrupt` names one to cut short."""
    folder.mkdir(parents=True)
    for images, labels, n in (("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 10),
                              ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 5)):
        files = {images: (2051).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (n, 28, 28))
                 + bytes(n * 784),
                 labels: (2049).to_bytes(4, "big") + n.to_bytes(4, "big") + bytes(i % 10 for i in range(n))}
        for name, raw in files.items():
            (folder / (name + ".gz")).write_bytes(gzip.compress(raw[:-7] if name == corrupt else raw))


# name -> (arguments, words the error line must hold); {empty} and {corrupt} are data folders made once
BAD = {
    "devices-ids-no-cards": (["--devices", "0,1"], "--devices 0,1: this machine has no CUDA card"),
    "devices-cpu-0": (["--devices", "cpu:0"], "--devices cpu:0: the number of CPU processes must be at least 1"),
    "devices-garbage": (["--devices", "banana"], "--devices banana: not understood"),
    "batch-not-divisible": (["--strategy", "ddp", "--devices", "cpu:2", "--batch-size", "63"],
                            "--batch-size 63 does not split over 2 processes; use a multiple of 2 (e.g. 62 or 64)"),
    "data-dir-empty": (["--data", "mnist", "--data-dir", "{empty}"], "not found in {empty}; put the four IDX"),
    "data-dir-missing": (["--data", "mnist", "--data-dir", "{empty}/nowhere"], "--data-dir {empty}/nowhere: no such"),
    "data-dir-corrupt": (["--data", "mnist", "--data-dir", "{corrupt}"],
                         "{corrupt}/t10k-images-idx3-ubyte.gz: size"),
    "data-unknown": (["--data", "nope"], "--data nope: unknown; choose one of mnist-5k"),
    "model-unknown": (["--model", "nope"], "--model nope: unknown; choose one of"),
    "model-file-missing": (["--model", "{empty}/net.py:Net"], "--model {empty}/net.py:Net: no such file"),
    "model-not-a-module": (["--model", "os:getcwd"], "--model os:getcwd: gave a str, not a torch.nn.Module"),
    "model-no-such-class": (["--model", "multicard.models.lenet:Nope"], "multicard.models.lenet has no Nope"),
    "epochs-0": (["--epochs", "0"], "--epochs 0: must be at least 1"),
    "batch-0": (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    "synthetic-0": (["--data", "synthetic", "--synthetic-samples", "0"], "--synthetic-samples 0: must be at least 1"),
    "lr-step-0": (["--lr-step", "0"], "--lr-step 0: must be at least 1"),
    "lr-negative": (["--lr", "-1"], "--lr -1.0: must be a positive number"),
    "lr-nan": (["--lr", "nan"], "--lr nan: must be a positive number"),
    "lr-inf": (["--lr", "inf"], "--lr inf: must be a positive number"),
    "lr-gamma-negative": (["--lr-gamma", "-3"], "--lr-gamma -3.0: must be a positive number"),
    "workers-negative": (["--workers", "-1"], "--workers -1: must be at least 0"),
    "momentum-1": (["--optimizer", "sgd", "--momentum", "1"], "--momentum 1.0: must be at least 0 and below 1"),
    "nesterov-adam": (["--nesterov"], "--nesterov needs --optimizer sgd and a --momentum above 0"),
    "accumulate-0": (["--accumulate", "0"], "--accumulate 0: must be at least 1"),
    "accumulate-split": (["--batch-size", "64", "--accumulate", "3"], "--batch-size 64 does not split over 3 "
                         "micro-batches x 1 processes; use a multiple of 3 (e.g. 63 or 66)"),
    "clip-negative": (["--clip-grad-norm", "-1"], "--clip-grad-norm -1.0: must be a number of 0 or more"),
    "warmup-too-long": (["--epochs", "2", "--warmup-epochs", "3"], "--warmup-epochs 3: longer than the run"),
    "weight-decay-nan": (["--weight-decay", "nan"], "--weight-decay nan: must be a number of 0 or more"),
}
OLD_FILES = {"model.pt": b"an earlier run's model\x00\x01", "metrics.jsonl": b'{"epoch": 1}\n', "summary.json": b"{}\n"}


# these also run in fresh interpreters (the others only in this one, where they cost no torch import):
# parsing --devices, splitting the batch, reading data, and cmd_train's own check
FRESH = ("devices-ids-no-cards", "batch-not-divisible", "data-dir-corrupt", "epochs-0")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    made = {"empty": root / "empty", "corrupt": root / "corrupt"}
    made["empty"].mkdir()
    write_idx_set(made["corrupt"], corrupt="t10k-images-idx3-ubyte")
    return made


def prepare(name: str, root: Path, folders: dict[str, Path]) -> tuple[list[str], str, Path]:
    """The case's full argument list, the words its error must hold, and its --out holding an earlier run."""
    args, words = BAD[name]
    out = root / "out" / name
    out.mkdir(parents=True)
    for file, raw in OLD_FILES.items():
        (out / file).write_bytes(raw)
    argv = ["train", *CHEAP_DATA, *[a.format(**folders) for a in args], "--out", str(out)]
    return argv, words.format(**folders), out


def check_error(returncode: int, stdout: str, stderr: str, words: str, out: Path) -> None:
    assert returncode == 2, (stdout, stderr)
    assert "Traceback" not in stderr + stdout
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("multicard: error: ")
    assert words in lines[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == OLD_FILES  # the earlier run is untouched, and no
    # lock file or run folder is left behind


def skip_without_cards_only(name: str) -> None:
    if name == "devices-ids-no-cards" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA cards")


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_in_process(name, tmp_path, folders, capsys, monkeypatch):
    skip_without_cards_only(name)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # what select() sets: undone after the test
    argv, words, out = prepare(name, tmp_path, folders)
    from multicard.cli import main

    returncode = main(argv)
    captured = capsys.readouterr()
    check_error(returncode, captured.out, captured.err, words, out)


@pytest.fixture(scope="module")
def fresh_runs(tmp_path_factory, folders):
    """The FRESH cases as `python -m multicard`, two at a time (each mostly waits for torch to import)."""
    root = tmp_path_factory.mktemp("fresh")

    def one(name: str):
        argv, words, out = prepare(name, root, folders)
        return run_cli(*argv, env=FAST), words, out

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(FRESH, pool.map(one, FRESH), strict=True))


@pytest.mark.parametrize("name", FRESH)
def test_bad_input_in_a_fresh_interpreter(fresh_runs, name):
    skip_without_cards_only(name)
    result, words, out = fresh_runs[name]
    check_error(result.returncode, result.stdout, result.stderr, words, out)


@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_an_out_that_cannot_be_a_folder_is_one_line(where, tmp_path, capsys):
    blocker = tmp_path / "notes.txt"
    blocker.write_bytes(b"the user's own file")
    out = blocker if where == "a-file" else blocker / "run"
    from multicard.cli import main

    returncode = main(["train", *CHEAP_DATA, "--out", str(out)])
    err = capsys.readouterr().err
    assert returncode == 2 and err.count("\n") == 1 and err.startswith(f"multicard: error: --out {out}: "), err
    assert blocker.read_bytes() == b"the user's own file"


def test_ctrl_c_while_the_command_line_is_read_is_one_line():
    code = ("from multicard import cli\n"
            "def parser():\n    raise KeyboardInterrupt\n"
            "cli.parser = parser\ncli.entry()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HUNG_S, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    assert (out.returncode, out.stderr) == (130, "multicard: interrupted\n")

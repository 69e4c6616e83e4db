"""Every code block in README.md and docs/*.md runs as written: each shell command is run here (CPU-sized), or
shown to fail in one line where it needs what this machine lacks (cards), or skipped for a reason written below;
each Python block runs (a fragment inside a small harness); the flags of every multicard command parse and
validate (the fast part, in the default suite)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HUNG_S, ROOT, where_measured
from test_seams import SEAMS

DOCS = [Path(ROOT, "README.md"), *sorted(Path(ROOT, "docs").glob("*.md"))]
BIN = Path(sys.executable).parent

# A command is skipped only for one of these reasons (the first rule that matches decides)
SKIP = [
    (r"^make ", "sets up .venv (pip installs torch): minutes and the network; CI runs make test itself"),
    (r"^tensorboard ", "a server that runs until it is stopped"),
    (r"--nnodes|^srun |^#!|^benchmarks/on_a_card\.sh", "needs two machines, SLURM or a CUDA card"),
    (r"--nproc-per-node [3-9]", "one process per card on a machine with 4 or 8 cards; the README's torchrun line "
                                "runs the same path with 2 processes on the CPU"),
    (r"--download", "downloads from the network"),
    (r"^multicard bench", "a sweep of every strategy: minutes; tests/test_bench.py runs a small one"),
    (r"^(python|torchrun|multicard run --devices cpu).*examples/mnist_your_loop\.py$",
     "its 14 epochs (minutes on 2 CPU cores); the same commands with --epochs 1 run from the README"),
]
# needs CUDA cards (or a data folder) that this machine does not have: one line naming what is missing
FAILS = [
    (r"--devices (0,1|0,0|2|4)\b", "this machine has no CUDA card"),
    (r"--data-dir ~/mnist", "mnist"),
]


def blocks() -> list[tuple[str, str, str]]:
    """(where, language, text) of every fenced block."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].startswith("```"):
                end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
                found.append((f"{doc.name}:{i + 1}", lines[i][3:].strip(), "\n".join(lines[i + 1:end])))
                i = end
            i += 1
    return found


def commands(text: str) -> list[str]:
    """A shell block's commands: continuations joined, comments dropped."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line and not (line.startswith("#") and not line.startswith("#!")):
            out.append(re.sub(r"\s+", " ", line))
    return out


SHELL = [(where, c) for where, lang, text in blocks() if lang in ("", "bash", "sh") for c in commands(text)]
PYTHON = [(where, text) for where, lang, text in blocks() if lang == "python"]


def verdict(command: str) -> tuple[str, str]:
    for pattern, why in SKIP:
        if re.search(pattern, command):
            return "skip", why
    for pattern, words in FAILS:
        if re.search(pattern, command):
            return "fails", words
    if re.match(r"(multicard|python|torchrun) ", command) or command == "multicard train":
        return "run", ""
    return "unknown", ""


def multicard_argv(command: str) -> list[str] | None:
    """The arguments a command hands to multicard (directly, or through torchrun or srun), ~ and $VARS expanded."""
    words = [os.path.expanduser(os.path.expandvars(w)) for w in shlex.split(command)]
    for i, word in enumerate(words):
        if word.endswith("multicard") and (i == 0 or words[i - 1] == "-m" or "/" in word):
            return words[i + 1:]
    return None


def test_every_command_in_the_docs_is_run_failed_or_skipped_for_a_reason():
    assert len(SHELL) > 30 and len(PYTHON) >= 4
    unknown = [(where, c) for where, c in SHELL if verdict(c)[0] == "unknown"]
    assert not unknown, f"commands the docs show that this test does not know how to check: {unknown}"


def test_the_readme_puts_its_commands_on_path_before_its_first_bare_command():
    """Its blocks use bare python, multicard and torchrun: .venv's, once activated."""
    readme = Path(ROOT, "README.md").read_text()
    first = min(m.start() for m in re.finditer(r"^(python|multicard|torchrun) ", readme, re.M))
    assert ". .venv/bin/activate" in readme[:first]


def test_no_command_hands_flags_to_a_script_that_reads_none():
    """my_script.py (the README's own loop) has no command line: a flag after it would be silently ignored."""
    assert "argv" not in readme_own_loop() and "argparse" not in readme_own_loop()
    handed = [(where, c) for where, c in SHELL if re.search(r"my_script\.py \S", c)]
    assert not handed, handed


@pytest.mark.parametrize("where, command", [(w, c) for w, c in SHELL if multicard_argv(c) is not None])
def test_the_flags_of_every_multicard_command_parse_and_validate(where, command):
    from multicard.cli import Parser, given, parser
    from multicard.trainer.config import TrainConfig

    assert isinstance(parser(), Parser)
    argv = multicard_argv(command)
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: {command}: argparse refused {argv} ({e})")
    if argv and argv[0] == "train":
        TrainConfig(**given(args)).validate()


def workdir(tmp_path: Path) -> dict[str, str]:
    """A fresh folder to run the docs' commands in, as a user would at the repository's root: examples/ and
    benchmarks/ are there, `python` is this interpreter, and my_script.py is the README's own loop."""
    (tmp_path / "examples").symlink_to(Path(ROOT, "examples"))
    (tmp_path / "benchmarks").symlink_to(Path(ROOT, "benchmarks"))
    (tmp_path / "my_script.py").write_text(readme_own_loop())
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a link would leave the venv
    (bin_dir / "python").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.path.join(ROOT, "src")}


def readme_own_loop() -> str:
    return next(text for where, text in PYTHON if where.startswith("README") and "multicard.Multicard()" in text)


def shell(command: str, cwd: Path, env: dict, timeout: float = HUNG_S) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


FAILING = [(w, c) for w, c in SHELL if verdict(c)[0] == "fails"]


@pytest.mark.parametrize("where, command", FAILING)
def test_what_needs_cards_or_data_fails_in_one_line(where, command, tmp_path, monkeypatch, capsys):
    """The first as a user types it; the others through the same CLI in this process (each fresh interpreter costs
    seconds, and the line is said before any process starts)."""
    env = workdir(tmp_path)
    if (where, command) == FAILING[0]:
        result = shell(command, tmp_path, env, timeout=HUNG_S)
        code, err = result.returncode, result.stderr
    else:
        from multicard.cli import main
        from multicard.jobs.devices import PASSIVE

        monkeypatch.chdir(tmp_path)
        for name, value in {**dict.fromkeys(PASSIVE, ""), "CUDA_DEVICE_ORDER": "", **env}.items():
            monkeypatch.setenv(name, value)  # and back after the test: what the CLI sets in its process stays there
        try:
            code = main(multicard_argv(command))
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
    assert code != 0, f"{where}: {command} ran here"
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert verdict(command)[1] in err, err


@pytest.mark.slow
@pytest.mark.parametrize("where", sorted({w for w, c in SHELL if verdict(c)[0] == "run"}))
def test_each_block_of_commands_runs_in_order(where, tmp_path):
    """In a fresh folder, in the order a user types them; a command shown before in another block runs once."""
    env = workdir(tmp_path)
    earlier = {c for w, c in SHELL[:next(i for i, (w, _) in enumerate(SHELL) if w == where)]}
    for command in [c for w, c in SHELL if w == where and verdict(c)[0] == "run" and c not in earlier]:
        result = shell(command, tmp_path, env)
        assert result.returncode == 0, f"{where}: {command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr, f"{where}: {command}\n{result.stderr[-3000:]}"


def test_the_readmes_own_loop_runs_as_a_script(tmp_path):
    (tmp_path / "script.py").write_text(readme_own_loop())
    result = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=workdir(tmp_path), capture_output=True,
                            text=True, timeout=HUNG_S)
    assert result.returncode == 0, result.stderr
    accuracies = [float(a) for a in re.findall(r"test accuracy ([\d.]+)%", result.stdout)]
    assert len(accuracies) == 2 and accuracies[-1] > 50  # 10 classes: learning, not chance (80.1% here)
    assert (tmp_path / "ckpt.pt").is_file()


def fragment_names(mc) -> dict:
    """What a fragment of docs/ takes as given: a model, its optimizer and schedule, data, a loader, and `mc`, the
    Multicard it runs on."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import multicard

    torch.manual_seed(0)  # the same data and weights in every process
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(512, 1, 28, 28), torch.randint(0, 10, (512,)))
    return dict(torch=torch, nn=nn, DataLoader=DataLoader, multicard=multicard, mc=mc, model=model,
                optimizer=optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1), data=data,
                criterion=nn.CrossEntropyLoss(), train_loader=mc.setup_dataloader(DataLoader(data, 48, shuffle=True)),
                epochs=1, resuming=False)


@pytest.mark.parametrize("where", [w for w, text in PYTHON if not re.search(r"^import ", text, re.M)])
def test_each_python_fragment_runs_in_a_harness(where, tmp_path, monkeypatch):
    import multicard

    monkeypatch.chdir(tmp_path)
    text = dict(PYTHON)[where]
    exec(compile(text, where, "exec"), fragment_names(multicard.Multicard("single", "cpu")))


def amp_port() -> tuple[str, str]:
    """your-loop.md's port of a loop with its own autocast, GradScaler and clip_grad_norm_, and the original it
    shows: the lines marked `# +` left out, each `# - line` put back in place of the line after it."""
    port = next(text for where, text in PYTHON if where.startswith("your-loop") and "GradScaler" in text)
    original = [re.sub(r"^(\s*)# - ", r"\1", line) for line in port.splitlines() if not re.search(r"# \+( |$)", line)]
    return port, "\n".join(original)


def losses(stdout: str) -> list[float]:
    return [float(v) for v in re.findall(r"loss over the whole set ([\d.]+)", stdout)]


@pytest.fixture(scope="module")
def amp_original(tmp_path_factory) -> list[float]:
    folder = tmp_path_factory.mktemp("original")
    (folder / "original.py").write_text(amp_port()[1])
    result = shell("python original.py", folder, workdir(folder))
    assert result.returncode == 0 and "multicard" not in amp_port()[1], result.stderr
    return losses(result.stdout)


# The blocks that use `mc` without starting processes of their own (a loop, a loader read through), each run as
# written in every process of `multicard run --devices cpu:N`: a fragment with the names above, a whole script as
# the script it is. One job runs them all, in the order of the docs.
ON_N = [where for where, text in PYTHON if re.search(r"\bmc\.", text) and "devices=" not in text]
HARNESS = f"""import re, sys
sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
import multicard
from test_docs import PYTHON, fragment_names

for where, text in PYTHON:
    if where in sys.argv[1:]:
        whole = re.search(r"^import ", text, re.M)
        names = {{"__name__": "__main__"}} if whole else fragment_names(multicard.Multicard())
        exec(compile(text, where, "exec"), names)
        sys.stdout.write(f"ran {{where}}\\n")  # one write: the ranks' lines never interleave
        sys.stdout.flush()
"""


@pytest.mark.parametrize("nprocs", [pytest.param(1, marks=pytest.mark.slow), 2,
                                    pytest.param(3, marks=pytest.mark.slow)])  # 1 and 3 in the slow suite
def test_each_block_that_uses_mc_runs_on_1_2_and_3_processes(nprocs, amp_original, tmp_path):
    """Every such block runs; the port of a loop with its own AMP and clipping prints the original's numbers
    exactly on one process, and on 2 and 3 the same to bf16's rounding (each process's rows pass through bf16 on
    their own)."""
    assert len(ON_N) >= 6, ON_N
    (tmp_path / "harness.py").write_text(HARNESS)
    result = shell(shlex.join(["multicard", "run", "--devices", f"cpu:{nprocs}", "harness.py", *ON_N]), tmp_path,
                   workdir(tmp_path))
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert result.stdout.count("ran ") == len(ON_N) * nprocs, result.stdout
    assert not [line for line in SEAMS if line in result.stderr], result.stderr  # the docs' loops are correct
    assert len(amp_original) == 3 and amp_original[-1] < amp_original[0]  # learning
    if nprocs == 1:
        assert losses(result.stdout) == amp_original
    else:
        assert losses(result.stdout) == pytest.approx(amp_original, abs=1e-3), result.stdout
    if where_measured():  # the figures your-loop.md gives, with 1 thread per process (workdir's OMP_NUM_THREADS)
        assert f"{losses(result.stdout)[-1]:.4f}" == amp_figures()[nprocs - 1], result.stdout


def amp_figures() -> list[str]:
    """your-loop.md's last losses of the AMP port on 1, 2 and 3 processes."""
    text = Path(ROOT, "docs", "your-loop.md").read_text()
    return list(re.search(r"\(([\d.]+), ([\d.]+), ([\d.]+) after 3 epochs with 1 thread per process", text).groups())


@pytest.mark.slow
@pytest.mark.parametrize("where", [w for w, text in PYTHON if re.search(r"^import ", text, re.M)])
def test_each_whole_python_block_runs_as_a_script(where, tmp_path):
    (tmp_path / "block.py").write_text(dict(PYTHON)[where])
    result = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, env=workdir(tmp_path), capture_output=True,
                            text=True, timeout=HUNG_S)
    assert result.returncode == 0, f"{where}\n{result.stderr[-3000:]}"


def test_every_diff_shown_is_the_readmes():
    """tests/test_examples.py holds the README's diff to the real one; the same diff shown elsewhere is the same."""
    diffs = [(where, text) for where, lang, text in blocks() if lang == "diff"]
    readme = next(text for where, text in diffs if where.startswith("README"))
    assert all(text == readme for where, text in diffs), [where for where, text in diffs if text != readme]


def test_the_accelerate_page_maps_every_call_to_what_multicard_has():
    """docs/from-accelerate.md: every `mc.NAME` it names is the object's, with the keywords it gives; every loader
    attribute its port reads is the set-up loader's; every Accelerate call its Accelerate loop makes has a row."""
    import inspect

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import multicard

    text = Path(ROOT, "docs", "from-accelerate.md").read_text()
    named = set(re.findall(r"\bmc\.(\w+)", text))
    assert {"setup", "is_main", "barrier", "gather_in_order"} <= named
    assert {n for n in named if not hasattr(multicard.Multicard, n)} == set()
    for name, inside in re.findall(r"\bmc\.(\w+)\(([^()]*)\)", text):
        given = set(re.findall(r"\b(\w+)=", inside))
        assert given <= set(inspect.signature(getattr(multicard.Multicard, name)).parameters), (name, given)
    options = {k for inside in re.findall(r"Multicard\(([^()]*)\)", text) for k in re.findall(r"\b(\w+)=", inside)}
    assert options and options <= set(inspect.signature(multicard.Multicard).parameters), options
    port = next(t for where, t in PYTHON if where.startswith("from-accelerate") and "mc.setup" in t)
    loader = multicard.Multicard("single", "cpu").setup_dataloader(DataLoader(TensorDataset(torch.zeros(8, 1)), 4),
                                                                    accumulate=2)
    read = set(re.findall(r"\btrain_dl\.(\w+)", port))
    assert {"step_ends", "share", "epoch"} <= read and {n for n in read if not hasattr(loader, n)} == set()
    accelerate = next(t for where, lang, t in blocks() if lang == "python accelerate")
    table = "\n".join(line for line in text.splitlines() if line.startswith("| `"))
    assert set(re.findall(r"accelerator\.(\w+)", accelerate)) <= set(re.findall(r"accelerator\.(\w+)", table))

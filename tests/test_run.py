"""`multicard run script.py`: the launcher for a user's own script; a script that starts its own processes; the rank
that failed named once (a bad input said once, not once per rank), and ranks of a user's loop that part ways (one
leaves, one reads more, one stops); a user's model class named on the command line, and one that fails to import or
build said in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import HUNG_S, clean_env, run_cli
from multicard import models
from multicard.cli import main
from multicard.errors import UsageError
from multicard.jobs.devices import usable_cores
from multicard.tools.script import misplaced

SCRIPT = """
import sys
import multicard

mc = multicard.Multicard(devices=sys.argv[1])
rank = mc.rank  # first use: joins the job (or, in a plain process that needs more, starts them)
print(f"rank {rank} of {mc.world_size} {mc.strategy} {mc.launcher} args {sys.argv[2:]}", flush=True)
if "fail" in sys.argv and rank == 1:
    raise ValueError("rank one broke")
mc.barrier()
"""


def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return str(path)


def ranks_said(stdout: str) -> list[str]:
    """What each rank printed (two processes writing to one pipe may interleave their lines)."""
    return sorted(re.findall(r"rank \d of \d \w+ \w+ args \[[^\]]*\]", stdout))


@pytest.mark.parametrize("nprocs", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_run_starts_every_process_with_the_scripts_arguments_and_says_so(tmp_path, nprocs):
    """A line as the job starts (the strategy, processes, devices, threads: OMP_NUM_THREADS, cores // processes,
    where this shell does not set it), one as it ends well; on stderr: the script's stdout stays its own."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = run_cli("run", "--devices", f"cpu:{nprocs}", script(tmp_path), "auto", "--epochs", "3", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ranks_said(out.stdout) == [f"rank {r} of {nprocs} ddp multicard args ['--epochs', '3']"
                                      for r in range(nprocs)]
    threads = max(1, usable_cores() // nprocs)
    lines = [line for line in out.stderr.splitlines() if line.startswith("multicard: ")]
    assert lines[0] == (f"multicard: running {script(tmp_path)}: strategy ddp, {nprocs} processes on the CPU, "
                        f"{threads} thread{'s' * (threads > 1)} each (each runs the whole script: mc.print prints on "
                        f"rank 0 alone, mc.save writes one file)")
    assert re.fullmatch(rf"multicard: done: {re.escape(script(tmp_path))} ended well on {nprocs} processes in "
                        r"[\d.]+ s \(exit status 0\)", lines[-1]) and len(lines) == 2
    assert "multicard:" not in out.stdout


def test_a_flag_of_runs_own_after_the_script_goes_to_the_script_and_is_said(tmp_path):
    """`multicard run job.py --devices cpu:2`: the flag is the script's (it may have its own --devices); the job
    runs one process, and a line says where the flag went and where it goes for run."""
    out = run_cli("run", script(tmp_path), "auto", "--devices", "cpu:2", "--deterministic")
    assert out.returncode == 0, out.stderr[-3000:]
    assert ranks_said(out.stdout) == ["rank 0 of 1 single multicard args ['--devices', 'cpu:2', '--deterministic']"]
    assert out.stderr.splitlines()[0] == (
        f"multicard: --devices cpu:2 came after {script(tmp_path)}, so it went to the script and this job runs 1 "
        f"process; for multicard run, put it first: multicard run --devices cpu:2 {script(tmp_path)}")
    assert out.stderr.splitlines()[1].startswith(f"multicard: running {script(tmp_path)}: strategy single, 1 "
                                                 f"process on the CPU, ")


def test_the_flags_run_says_went_to_the_script(tmp_path):
    own = {"--devices": True, "--strategy": True, "--deterministic": False}
    assert misplaced("job.py", ["--lr", "1", "--strategy=ddp"], own) == (
        "--strategy ddp came after job.py, so it went to the script and this job runs 1 process; for multicard run, "
        "put it first: multicard run --strategy ddp job.py")
    assert misplaced("job.py", ["--deterministic", "x"], own).startswith("--deterministic came after job.py")
    assert misplaced("job.py", ["--devicesx", "--lr", "--devices"], own).startswith("--devices came after")
    assert misplaced("job.py", ["--epochs", "3"], own) == ""


def test_run_stops_the_job_at_the_first_failure_and_names_the_rank(tmp_path):
    out = run_cli("run", "--quiet", "--devices", "cpu:2", script(tmp_path), "auto", "fail")
    assert out.returncode == 1
    assert "ValueError: rank one broke" in out.stderr
    assert out.stderr.rstrip().splitlines()[-1] == ("multicard: rank 1 failed with exit code 1 (its output is above); "
                                                    "the other ranks were stopped")
    assert "multicard: running" not in out.stderr  # --quiet: the failure's line alone


def test_a_plain_python_script_that_needs_two_processes_starts_them(tmp_path):
    out = subprocess.run([sys.executable, script(tmp_path), "cpu:2", "x"], capture_output=True, text=True,
                         timeout=HUNG_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ranks_said(out.stdout) == [f"rank {r} of 2 ddp multicard args ['x']" for r in (0, 1)]


def test_run_refuses_what_it_cannot_start(tmp_path, capsys):
    for args, words in ((["run"], "name the script to run"), (["run", "nothere.py"], "no such script nothere.py"),
                        (["run", "--devices", "cpu:0", script(tmp_path)], "run: --devices cpu:0: the number of CPU")):
        assert main(args) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("multicard: error: run") and words in lines[0]


NET = """
from torch import nn

class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))

    def forward(self, x):
        return self.body(x)
"""


@pytest.mark.slow
def test_train_takes_a_model_class_from_a_file_into_every_process(tmp_path):
    (tmp_path / "mynets.py").write_text(NET)
    out = run_cli("train", "--model", f"{tmp_path}/mynets.py:TinyNet", "--strategy", "ddp", "--devices", "cpu:2",
                  "--data", "synthetic", "--synthetic-samples", "64", "--epochs", "1", "--batch-size", "16",
                  "--quiet", "--out", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["model"], summary["world_size"]) == ("TinyNet", 2)


def test_train_takes_a_model_class_by_module_path(tmp_path):
    assert main(["train", "--model", "multicard.models.lenet:LeNet5", "--devices", "cpu", "--data", "synthetic",
                 "--synthetic-samples", "32", "--epochs", "1", "--quiet", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["model"] == "LeNet5"


@pytest.mark.parametrize("spec", [":Net", "x.py:", "multicard.models:"])
def test_a_model_spec_without_its_module_or_class_is_one_line(spec):
    with pytest.raises(UsageError, match=f"^--model {spec}: name both the file"):
        models.build(spec)


@pytest.mark.parametrize("top", ["import sys\nsys.exit(0)\n",
                                 "import argparse\nargparse.ArgumentParser().parse_args()\n"])
def test_a_model_module_that_ends_the_program_at_import_is_one_line(tmp_path, monkeypatch, top):
    module = tmp_path / "ends_here.py"
    module.write_text(top + "import torch\n\n\ndef Net():\n    return torch.nn.Linear(2, 2)\n")
    monkeypatch.setattr(sys, "argv", ["multicard", "train", "--model", f"{module}:Net"])
    monkeypatch.syspath_prepend(str(tmp_path))
    if top.startswith("import argparse"):  # it sees no flags of ours: the model is built
        assert isinstance(models.build(f"{module}:Net"), torch.nn.Linear)
    else:
        with pytest.raises(UsageError, match=r"ends_here.py ended the program \(exit 0\); run its script part only"):
            models.build(f"{module}:Net")
    assert sys.argv == ["multicard", "train", "--model", f"{module}:Net"]
    sys.modules.pop("ends_here", None)


@pytest.mark.parametrize("body, words", [
    ("x = 1 / 0\n", r"importing .*net\.py failed: ZeroDivisionError: division by zero \(at .*net\.py:1\)$"),
    ("def broken(:\n", r"importing .*net\.py failed: SyntaxError: .* \(at .*net\.py:1\)$"),
    ("import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
     "        self.layer = torch.nn.Linear(3, 'wide')\n",
     r"building it failed: TypeError: .* \(at .*net\.py:5\)$"),
    ("import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n        raise RuntimeError('my own')\n",
     r"building it failed: RuntimeError: my own \(at .*net\.py:4\)$"),
], ids=["import", "syntax", "init-typeerror", "init"])
def test_a_model_file_that_fails_shows_the_users_error_in_one_line(tmp_path, body, words, monkeypatch, request):
    import re

    from multicard import models

    name = f"net_{request.node.callspec.id.replace('-', '_')}_{os.getpid()}"  # a module name of its own
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(UsageError) as caught:
        models.build(f"{tmp_path / name}.py:Net")
    assert "\n" not in str(caught.value)
    assert re.search(words.replace("net\\.py", f"{name}\\.py"), str(caught.value)), str(caught.value)


# -- the rank that failed, named once ---------------------------------------------------------------------------------
JOB_HEAD = "import sys\nimport multicard\nmc = multicard.Multicard(timeout=20)\n"


def multicard_run(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(JOB_HEAD + body)
    return run_cli("run", "--devices", "cpu:2", str(script), env=clean_env(), timeout=HUNG_S)


@pytest.mark.slow
def test_under_multicard_run_the_rank_that_failed_is_named_with_its_code(tmp_path):
    out = multicard_run(tmp_path, "mc.barrier()\nif mc.rank == 1:\n    sys.exit(3)\nmc.all_reduce(1.0)\n")
    assert out.returncode == 3
    lines = out.stderr.splitlines()
    assert lines[-1] == "multicard: rank 1 failed with exit code 3 (its output is above); the other ranks were stopped"
    assert "Traceback" not in out.stderr  # rank 0's lost connection is one line, not gloo's traceback
    assert lines[0].startswith("multicard: running ")  # the job's start line
    assert lines[1:-1] == []  # rank 0 only lost rank 1: the launcher names rank 1 alone


@pytest.mark.slow
def test_under_multicard_run_a_bad_input_on_one_rank_is_the_one_line(tmp_path):
    out = multicard_run(tmp_path, "from multicard.errors import UsageError\nmc.barrier()\nif mc.rank == 1:\n"
                                  "    raise UsageError('rank 1 alone saw a bad input')\nmc.all_reduce(1.0)\n")
    started, *said = out.stderr.splitlines()  # rank 0, which lost rank 1, adds no line of its own
    assert out.returncode == 2 and said == ["multicard: error: rank 1 alone saw a bad input"], out.stderr


def test_under_multicard_run_a_bad_input_is_said_once(tmp_path):
    out = multicard_run(tmp_path, "mc.local_batch(7)\n")
    assert out.returncode == 2
    started, *said = out.stderr.splitlines()  # the job's start line, then the bad input once (not once per rank)
    assert started.startswith("multicard: running ") and said == [
        "multicard: error: batch size 7 does not split over 2 processes; use a multiple of 2 (e.g. 6 or 8)"]


# -- ranks of a user's loop that part ways ----------------------------------------------------------------------------
def run_job(tmp_path, body: str, timeout_s: float = 10) -> subprocess.CompletedProcess:
    """`multicard run --devices cpu:2` of a script made of `body`, its collectives waiting at most timeout_s."""
    script = tmp_path / "job.py"
    script.write_text("import sys, time\nimport torch\nimport multicard\n"
                      f"mc = multicard.Multicard(timeout={timeout_s})\n" + textwrap.dedent(body))
    return run_cli("run", "--devices", "cpu:2", str(script), env=clean_env(), timeout=HUNG_S)


def test_a_rank_that_leaves_inside_rank_zero_first_is_the_one_named(tmp_path):
    done = run_job(tmp_path, """
        with mc.rank_zero_first():
            if mc.rank == 0:
                sys.exit(0)  # rank 1 is left waiting at the barrier
    """)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith("multicard: rank 0 ended (exit code 0) while rank 1 still waited "
                                                   "for it in a collective"), done.stderr


@pytest.mark.slow
def test_an_iterable_dataset_serving_one_rank_more_batches_names_both_counts(tmp_path):
    done = run_job(tmp_path, """
        from torch.utils.data import DataLoader, IterableDataset

        class Stream(IterableDataset):
            def __iter__(self):
                for i in range(4 * (12 if mc.rank == 1 else 10)):
                    yield torch.full((3,), float(i))

        model = mc.setup(torch.nn.Linear(3, 1))
        for x in mc.setup_dataloader(DataLoader(Stream(), batch_size=4)):
            mc.backward(model(x).sum())
        print("total", mc.all_reduce(1.0))  # what a loop does after its pass: met by rank 1's gradients
    """)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "multicard: rank 1 read 11 batches, rank 0 read 10 and its loader ended there: a loader that every process "
        "reads whole (an IterableDataset, a batch sampler) must serve each process as many batches"), done.stderr


@pytest.mark.slow
def test_a_collective_timeout_the_user_catches_names_the_rank_that_stopped(tmp_path):
    done = run_job(tmp_path, """
        mc.barrier()
        if mc.rank == 1:
            time.sleep(60)
        try:
            mc.all_reduce(1.0)
        except RuntimeError:
            sys.exit(1)  # caught, and ended otherwise: no traceback reaches multicard
    """, timeout_s=3)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith("multicard: rank 1 stopped making progress"), done.stderr
    assert "rank 0 timed out waiting for it after 3 s" in done.stderr


# -- multicard train inside a script under multicard run --------------------------------------------------------------
@pytest.mark.slow
def test_multicard_train_inside_a_script_under_multicard_run_runs_on_its_own(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import subprocess, sys\nimport multicard\nmc = multicard.Multicard(timeout=300)\nmc.barrier()\n"
        "if mc.rank == 0:\n"
        "    subprocess.run([sys.executable, '-m', 'multicard', 'train', '--data', 'synthetic', '--synthetic-samples',"
        " '64', '--epochs', '1', '--quiet', '--timeout', '5', '--out', sys.argv[1]], check=True, timeout=60)\n"
        "mc.barrier()\n")
    out = run_cli("run", "--devices", "cpu:2", str(script), str(tmp_path / "out"), env=clean_env(), timeout=HUNG_S)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / "model.pt").is_file()

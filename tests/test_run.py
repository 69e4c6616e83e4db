"""`multicard run script.py`: the launcher for a user's own script; a script that starts its own processes; and a
user's model class named on the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import HUNG_S, run_cli
from multicard.cli import main
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

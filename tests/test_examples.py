"""The examples in examples/ run as a user would run them."""

import subprocess
import sys

from conftest import ROOT


def test_own_model_example(tmp_path):
    out = subprocess.run([sys.executable, f"{ROOT}/examples/own_model.py", "--strategy", "single", "--devices", "cpu",
                          "--epochs", "2"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    accuracy = float(out.stdout.strip().splitlines()[-1].split()[-1].rstrip("%"))
    assert accuracy > 90

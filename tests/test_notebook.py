"""From a notebook: multicard.launch in a real Jupyter kernel (nbclient + ipykernel), and from `python -` and
`python -c` (docs/notebooks.md). One kernel serves the tests that need one; the example notebook gets its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from conftest import HUNG_S, ROOT, cuda


def kernel_manager(folder) -> KernelManager:
    """A kernel of this test run's Python (the venv's), whatever kernels Jupyter has installed elsewhere."""
    spec = folder / "multicard-test"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "multicard test", "language": "python"}))
    return KernelManager(kernel_name="multicard-test", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(folder)]))


class Kernel:
    """One live kernel: `run(source)` executes a cell in it and returns the cell, outputs included."""

    def __init__(self, client: NotebookClient):
        self.client = client

    def run(self, source: str, timeout: float = 90):
        cell = new_code_cell(textwrap.dedent(source))
        self.client.nb.cells.append(cell)
        self.client.timeout = timeout
        return self.client.execute_cell(cell, len(self.client.nb.cells) - 1)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kernel")
    km = kernel_manager(folder)
    client = NotebookClient(new_notebook(), km=km, allow_errors=True, resources={"metadata": {"path": str(folder)}})
    with client.setup_kernel():
        kernel = Kernel(client)
        kernel.run("import multicard, os, time, torch\nfrom torch import nn")
        yield kernel
    km.shutdown_kernel(now=True)


def text(cell, name: str = "stdout") -> str:
    return "".join(o["text"] for o in cell.outputs if o["output_type"] == "stream" and o["name"] == name)


def error(cell) -> dict | None:
    return next((o for o in cell.outputs if o["output_type"] == "error"), None)


def result(cell) -> str:
    return next(o["data"]["text/plain"] for o in cell.outputs if o["output_type"] == "execute_result")


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not ended (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_the_example_notebook_runs_and_two_processes_match_one(tmp_path):
    nb = nbformat.read(os.path.join(ROOT, "examples", "notebook.ipynb"), as_version=4)
    nb.cells.append(new_code_cell("import json; print(json.dumps({'gap': gap, 'one': one['correct'], "
                                  "'two': two['correct']}))"))
    NotebookClient(nb, km=kernel_manager(tmp_path), timeout=HUNG_S,
                   resources={"metadata": {"path": os.path.join(ROOT, "examples")}}).execute()
    launched = next(c for c in nb.cells if c.cell_type == "code" and 'devices="cpu:2"' in c.source)
    assert "2 process(es): test loss" in text(launched)  # what rank 0 printed shows in the cell
    numbers = json.loads(text(nb.cells[-1]))
    assert numbers["gap"] < 1e-4 and numbers["one"] == numbers["two"] > 800


@pytest.mark.slow
def test_a_kernel_that_used_torch_launches_and_gets_the_weights_of_one_process(kernel):
    kernel.run("""
        torch.manual_seed(0)
        class Tiny(nn.Module):  # defined in a cell: goes to the processes by value
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear(8, 2)
            def forward(self, x):
                return self.layer(x)
        model = Tiny()
        x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
        model(x).sum().backward()  # torch at work in the kernel before any launch
        model.zero_grad()

        def fit(mc, model, x, y):
            for i in range(3):
                print(f"rank {mc.rank} line {i}")
            model = mc.setup(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            for step in range(5):
                optimizer.zero_grad()
                mine = slice(mc.rank * 64 // mc.world_size, (mc.rank + 1) * 64 // mc.world_size)
                nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
                optimizer.step()
            return mc.unwrap(model).cpu()
    """)
    cell = kernel.run("""
        import copy
        one = multicard.launch(fit, copy.deepcopy(model), x, y, devices="cpu")  # in this kernel
        two = multicard.launch(fit, model, x, y, devices="cpu:2")
        print(isinstance(two, Tiny), max((a - b).abs().max().item() for a, b in zip(one.parameters(),
                                                                                     two.parameters())))
    """)
    assert error(cell) is None, error(cell)
    out = text(cell)
    for rank, runs in ((0, 2), (1, 1)):  # each rank's lines show in the cell, in the order it printed them
        lines = [line for line in out.splitlines() if line.startswith(f"rank {rank} line")]
        assert lines == [f"rank {rank} line {i}" for i in range(3)] * runs
    same_class, gap = out.splitlines()[-1].split()
    assert same_class == "True" and float(gap) < 1e-6


@pytest.mark.slow
def test_a_failing_rank_shows_its_traceback_once_and_the_kernel_goes_on(kernel):
    cell = kernel.run("""
        def fails_on_one(mc):
            if mc.rank == 1:
                raise ValueError("rank one says no")
            time.sleep(60)
        multicard.launch(fails_on_one, devices="cpu:2")
    """)
    shown = "\n".join(error(cell)["traceback"]) + text(cell) + text(cell, "stderr")
    assert shown.count("Traceback (most recent call last)") == 1
    assert shown.count("ValueError: rank one says no") == 1
    assert 'raise ValueError("rank one says no")' in shown  # the cell's own line, as a one-process error shows it
    assert error(cell)["traceback"][-1].startswith("RankFailed: rank 1 failed")
    again = kernel.run("multicard.launch(lambda mc: mc.rank + 41, devices='cpu:2')")  # a second launch works
    assert result(again) == "41"


def test_an_interrupt_stops_every_rank_and_leaves_no_process(kernel, tmp_path):
    client = kernel.client
    msg_id = client.kc.execute(textwrap.dedent(f"""
        def sleeper(mc):
            with open(os.path.join({str(tmp_path)!r}, f"rank{{mc.rank}}"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(300)
        multicard.launch(sleeper, devices="cpu:2")
    """), stop_on_error=False)  # as nbclient sends with allow_errors: the kernel aborts no request that follows it
    deadline = time.monotonic() + 60
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.2)  # the files are written: each rank is in fn now
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    start = time.monotonic()
    client.km.interrupt_kernel()  # the notebook's stop button
    while (reply := client.kc.get_shell_msg(timeout=30))["parent_header"].get("msg_id") != msg_id:
        pass
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "Stopped"
    assert time.monotonic() - start < 100  # the stop's grace (3 s) and SIGKILL's 5 s, not the ranks' 300 s sleep
    assert not any(alive(pid) for pid in pids)
    assert result(kernel.run("6 * 7")) == "42"  # the kernel still answers


def test_a_multicard_used_directly_in_a_cell_is_one_error_that_says_to_launch(kernel):
    cell = kernel.run("mc = multicard.Multicard(devices='cpu:2')\nmc.rank")
    assert error(cell)["ename"] == "UsageError"
    [line] = error(cell)["traceback"]
    assert "put the loop in a function fn(mc) and call multicard.launch(fn" in line


def test_what_cannot_be_sent_is_one_error_naming_it_before_any_rank_starts(kernel, tmp_path):
    mark = tmp_path / "ran"
    cell = kernel.run(f"""
        import threading
        def touches(mc, *args):
            open({str(mark)!r}, "w").close()
        for bad in (open(os.devnull), threading.Lock(), (i for i in range(3))):
            try:
                multicard.launch(touches, 1, bad, devices="cpu:2")
            except multicard.UsageError as e:
                print(e)
    """)
    lines = text(cell).splitlines()
    assert [line.split(" cannot be sent")[0] for line in lines] == [
        "argument 2 (a TextIOWrapper)", "argument 2 (a lock)", "argument 2 (a generator)"]
    assert not mark.exists()


@pytest.mark.slow
def test_train_takes_a_model_class_defined_in_a_cell(kernel, tmp_path):
    cell = kernel.run(f"""
        from torch.utils.data import TensorDataset
        class CellNet(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(28 * 28, 10)
            def forward(self, x):
                return self.fc(x.flatten(1))
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g))
        summary = multicard.train(CellNet(), data, data, devices="cpu:2", epochs=1, batch_size=32, augment=False,
                                  quiet=True, out={str(tmp_path)!r})
        print(summary["world_size"], summary["test_samples"])
    """)
    assert error(cell) is None, error(cell)
    assert text(cell).splitlines()[-1] == "2 64"


@cuda
def test_a_kernel_that_used_a_card_still_launches(kernel):
    cell = kernel.run("""
        on_card = torch.ones(1, device="cuda") * 2  # CUDA is initialised in the kernel
        def on_each(mc):
            return torch.ones(1, device="cuda").item() + mc.rank
        print(multicard.launch(on_each, devices="cpu:2"), on_card.item())
    """)
    assert error(cell) is None, error(cell)
    assert text(cell).split() == ["1.0", "2.0"]


SCRIPT = """
import sys
import multicard, torch

class Doubled:  # defined in __main__, which the ranks cannot run again
    def __init__(self, value):
        self.value = value

def job(mc, scale):
    sys.stdout.write(f"rank {mc.rank} of {mc.world_size}\\n")  # one write: unbuffered, print makes two
    return Doubled(torch.tensor([2.0]) * scale)

out = multicard.launch(job, 21, devices="cpu:2")
print(type(out).__name__, type(out) is Doubled, int(out.value))
"""


@pytest.mark.parametrize("how", [pytest.param("-", marks=pytest.mark.slow), "-c"])  # `python -`: the test below
def test_python_dash_and_dash_c_launch(how, tmp_path):
    command = [sys.executable, "-"] if how == "-" else [sys.executable, "-c", SCRIPT]
    done = subprocess.run(command, input=SCRIPT if how == "-" else None, capture_output=True, text=True,
                          timeout=HUNG_S, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sorted(lines[:2]) == ["rank 0 of 2", "rank 1 of 2"] and lines[2] == "Doubled True 42"



WORKERS = """
import multicard, torch
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):  # defined in __main__: the ranks' DataLoader workers must find it too
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([float(i * i)])

def job(mc):
    loader = mc.setup_dataloader(DataLoader(Squares(), batch_size=4, num_workers=2))
    return mc.all_reduce(sum(batch.sum() for batch in loader)).item()

print("total", multicard.launch(job, devices="cpu:2"))
"""


@pytest.mark.slow
def test_a_dataset_class_from_main_reaches_the_ranks_dataloader_workers(tmp_path):
    done = subprocess.run([sys.executable, "-"], input=WORKERS, capture_output=True, text=True, timeout=HUNG_S,
                          cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"total {float(sum(i * i for i in range(8)))}"

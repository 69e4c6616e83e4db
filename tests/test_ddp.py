"""DDP on CPU: gloo over loopback, ports picked free. The same DDP code runs on NCCL with cards."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import multicard
from conftest import HUNG_S, ROOT, sharded, tiny_images
from multicard.jobs import launcher
from multicard.jobs.devices import Devices
from multicard.jobs.dist import Job
from multicard.models import LeNet5
from multicard.strategies.ddp import DDP
from multicard.tools.parity import check
from test_seams import SEAMS

FAST = dict(quiet=True, augment=False, lr=3e-3, scheduler="step", seed=0)


class ThreadCheckedLeNet(LeNet5):
    """Fails loudly if a CPU process runs with more than its share of the cores."""

    def forward(self, x):
        cores = len(os.sched_getaffinity(0))
        share = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        assert torch.get_num_threads() == share, f"{torch.get_num_threads()} threads, share is {share}"
        return super().forward(x)


class FailsOnRank1(LeNet5):
    def forward(self, x):
        if os.environ.get("RANK") == "1":
            raise RuntimeError("boom on rank 1")
        return super().forward(x)


class RefusesOnRank1(LeNet5):
    def forward(self, x):
        if os.environ.get("RANK") == "1":
            raise multicard.UsageError("rank 1 finds this input bad")
        return super().forward(x)


class DropoutNet(LeNet5):
    def __init__(self):
        super().__init__()
        self.classifier.insert(2, torch.nn.Dropout(0.5))


def evaluate_alone(path, test) -> float:
    model = LeNet5()
    model.load_state_dict(torch.load(path, weights_only=True))
    model.eval()
    x, y = test[list(range(len(test)))]
    with torch.no_grad():
        return (model(x).argmax(1) == y).double().mean().item()


def test_training_deals_one_global_permutation_over_ranks():
    data = tiny_images(40)
    one = sharded(data, 8, seed=3)
    two = [sharded(data, 8, rank=r, world=2, seed=3) for r in range(2)]
    for _epoch in (0, 1):  # each pass is the next epoch, in every process
        steps_one = [sorted(y.tolist()) for _, y in one]
        steps_two = [sorted(a.tolist() + b.tolist()) for (_, a), (_, b) in zip(*two, strict=True)]
        assert steps_one == steps_two  # step k on 2 ranks = step k on one process
    one.set_epoch(0)
    first = [y.tolist() for _, y in one]
    assert first != [y.tolist() for _, y in one]  # the next pass reshuffles


def test_loader_workers_serve_the_same_batches_as_in_memory_indexing():
    labels = []
    for workers in (0, 1):
        loader = sharded(tiny_images(40), 8, rank=1, world=2, seed=5, workers=workers)
        loader.set_epoch(2)
        labels.append(torch.cat([y for _, y in loader]))
    assert torch.equal(*labels) and len(labels[0]) == 20


def test_exact_evaluation_shards_count_every_sample_once():
    shards = [list(sharded(tiny_images(1000), 64, train=False, rank=r, world=3).sampler) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(1000))


@pytest.mark.slow  # 2 processes train in the tests below; test_script_habits.py deals the evaluation shards out on 2
def test_three_processes_train_and_evaluate_exactly(tmp_path):
    train, test = tiny_images(96), tiny_images(50, seed=1)  # 50 test samples do not split over 3
    summary = multicard.train(ThreadCheckedLeNet(), train, test, strategy="ddp", devices="cpu:3",
                              epochs=3, batch_size=24, out=str(tmp_path), **FAST)
    assert summary["world_size"] == 3 and summary["strategy"] == "ddp"
    assert summary["test_samples"] == 50
    assert summary["cpu_threads"] == [max(1, len(os.sched_getaffinity(0)) // 3)] * 3  # each its share of the cores
    assert len(summary["peak_memory_mb"]) == 3 and summary["devices"] == ["cpu"] * 3
    assert summary["test_accuracy"] == pytest.approx(evaluate_alone(tmp_path / "model.pt", test), abs=1e-9)
    assert summary["test_accuracy"] > 0.8
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]


def test_a_failing_rank_stops_the_job_and_shows_its_traceback(tmp_path):
    start = time.monotonic()
    with pytest.raises(launcher.RankFailed) as failure:
        multicard.train(FailsOnRank1(), tiny_images(64), None, strategy="ddp", devices="cpu:2",
                        epochs=1, batch_size=16, out=str(tmp_path), timeout=600, **FAST)
    assert failure.value.rank == 1
    assert "boom on rank 1" in failure.value.trace and "Traceback" in failure.value.trace
    assert time.monotonic() - start < 300  # stopped at once: not rank 0 waiting out the timeout (600 s)
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_a_bad_input_seen_only_inside_a_process_stays_one_line(tmp_path):
    with pytest.raises(multicard.UsageError, match="rank 1 finds this input bad"):
        multicard.train(RefusesOnRank1(), tiny_images(32), None, strategy="ddp", devices="cpu:2", epochs=1,
                        batch_size=16, out=str(tmp_path), **FAST)


@pytest.mark.slow
def test_cli_names_the_failing_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\nimport multicard\nfrom multicard.cli import main\nfrom multicard.models import LeNet5\n"
        "@multicard.register('boom')\nclass Boom(LeNet5):\n    def forward(self, x):\n"
        "        if os.environ['RANK'] == '1':\n            raise ValueError('rank one broke')\n"
        "        return super().forward(x)\n"
        "if __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n")
    out = subprocess.run([sys.executable, str(script), "train", "--model", "boom", "--strategy", "ddp",
                          "--devices", "cpu:2", "--data", "synthetic", "--synthetic-samples", "128", "--epochs", "1",
                          "--out", str(tmp_path / "run"), "--quiet"], capture_output=True, text=True, timeout=HUNG_S)
    assert out.returncode == 1
    assert "multicard: rank 1 failed" in out.stderr and "ValueError: rank one broke" in out.stderr
    assert "ChildFailedError" not in out.stderr


@pytest.mark.slow
def test_the_launch_picks_no_port_in_advance(tmp_path, monkeypatch):
    def picked(*args):
        raise AssertionError("a port picked in advance can be taken before rank 0 binds it")

    monkeypatch.setattr(launcher, "free_port", picked)  # the store is held by the launcher, on a port the OS gave
    with socket.socket() as taken:  # and a MASTER_PORT someone holds, left in the shell, is not used either
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        summary = multicard.train(LeNet5(), tiny_images(64), None, strategy="ddp", devices="cpu:2",
                                  epochs=1, batch_size=16, out=str(tmp_path), **FAST)
    assert summary["world_size"] == 2


@pytest.mark.slow
def test_parity_names_dropout_as_the_cause(monkeypatch):
    monkeypatch.setitem(multicard.MODELS, "dropnet", DropoutNet)
    (result,) = check(multicard.TrainConfig(model="dropnet", devices="cpu:2", data="synthetic",
                                            synthetic_samples=256, batch_size=32), steps=6)
    assert not result.ok
    assert any("dropout" in line for line in result.lines())


def free_port() -> str:
    return str(launcher.free_port())


def summary_of(path) -> dict:
    return json.loads((path / "summary.json").read_text())


TRAIN = ["train", "--devices", "cpu", "--data", "synthetic", "--synthetic-samples", "128", "--epochs", "1",
         "--batch-size", "16", "--quiet"]


def test_torchrun_single_node(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "multicard", *TRAIN, "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=HUNG_S, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not [line for line in SEAMS if line in out.stderr], out.stderr  # the trainer sets up all it uses
    summary = summary_of(tmp_path)
    assert (summary["world_size"], summary["launcher"], summary["strategy"]) == (2, "torchrun", "ddp")


@pytest.mark.slow
def test_torchrun_two_nodes_on_localhost(tmp_path):
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                               str(rank), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
                               "-m", "multicard", *TRAIN, "--out", str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [node.communicate(timeout=HUNG_S)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert summary_of(tmp_path)["world_size"] == 2


@pytest.mark.slow  # how SLURM's variables are read: tests/test_dist.py; this is the whole job started that way
def test_slurm_variables(tmp_path):
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    tasks = [subprocess.Popen([sys.executable, "-m", "multicard", *TRAIN, "--out", str(tmp_path)], cwd=ROOT,
                              env={**clean, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NTASKS": "2",
                                   "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_STEP_TASKS_PER_NODE": "2",
                                   "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": port},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = [task.communicate(timeout=HUNG_S)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    summary = summary_of(tmp_path)
    assert (summary["world_size"], summary["launcher"]) == (2, "slurm")


def test_ddp_on_one_process_needs_no_rendezvous(tmp_path, monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    summary = multicard.train(LeNet5(), tiny_images(64), None, strategy="ddp", devices="cpu", epochs=1,
                              batch_size=16, out=str(tmp_path), **FAST)
    assert (summary["strategy"], summary["world_size"]) == ("ddp", 1)
    assert not torch.distributed.is_initialized()  # torn down again


def test_each_process_takes_the_card_of_its_local_rank():
    job = Job(rank=5, world=8, local_rank=1, local_world=4, launcher="torchrun")
    assert DDP(Devices("cuda", (0, 1, 2, 3)), job).device == torch.device("cuda", 1)


def test_a_process_shown_one_card_uses_it_whatever_its_local_rank():
    job = Job(rank=3, world=4, local_rank=3, local_world=4, launcher="slurm")  # srun --gpus-per-task=1
    assert DDP(Devices("cuda", (0,)), job).device == torch.device("cuda", 0)


def test_a_local_rank_beyond_the_cards_is_one_clear_error():
    job = Job(rank=2, world=3, local_rank=2, local_world=3, launcher="torchrun")
    with pytest.raises(multicard.UsageError, match="local rank 2 has no card: 2 visible"):
        DDP(Devices("cuda", (0, 1)), job).start(job)


def test_ddp_with_one_process_pays_for_no_reduction():
    from torch.nn.parallel import DistributedDataParallel

    with multicard.Multicard("ddp", "cpu") as mc:
        model = mc.setup(LeNet5())
        assert mc.strategy == "ddp" and mc.world_size == 1
        assert not isinstance(model.forward_module, DistributedDataParallel)  # nobody to reduce with
        assert mc.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0] and mc.gather({"a": 1}) == [{"a": 1}]
        mc.barrier()

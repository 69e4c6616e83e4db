"""On a card: single, ddp over NCCL (alone and under torchrun), the fast path, memory from torch.cuda and NVML, and a
small bench sweep. These skip without a card (`pytest -m cuda` selects them). The NVML reading and its column in
the bench report are also tested here on the CPU, with torch's NVML call replaced."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, assert_same, cuda, rehearsal, run_cli
from multicard.tools import bench, parity
from multicard.tools.bench_report import markdown, table
from multicard.trainer.config import TrainConfig
from multicard.yourloop import memory

SMALL = ["--data", "synthetic", "--synthetic-samples", "512", "--epochs", "2", "--batch-size", "64", "--quiet"]
HAS_NVML = importlib.util.find_spec("pynvml") is not None


def summary_of(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_one_comparison_for_tensors_that_may_come_from_a_card():
    weights = torch.linspace(0, 1, 6)
    assert_same(weights.clone(), weights)
    assert_same(weights + 1e-5, weights, atol=2e-5)
    with pytest.raises(AssertionError) as e:
        assert_same(weights.to(torch.float64), weights, what="0.weight")  # bit for bit: the dtype too
    with pytest.raises(AssertionError) as close:
        assert_same(weights + 1e-3, weights, atol=1e-4, what="0.bias")
    assert str(e.value).startswith("0.weight: actual (on cpu) and expected (on cpu) differ: ")
    assert str(close.value).startswith("0.bias: actual (on cpu) and expected (on cpu) differ: ")


def test_card_used_reads_nvml_per_card_in_mb(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda card: seen.append(card) or (card + 1) * 3 * 2**20)
    assert memory.card_used_mb([0, 2]) == [3.0, 9.0] and seen == [0, 2]


@pytest.mark.parametrize("error", [ModuleNotFoundError("nvidia-ml-py"), RuntimeError("driver"), OSError("nvml")])
def test_card_used_is_empty_where_nvml_cannot_be_read(monkeypatch, error):
    def fail(card):
        raise error

    monkeypatch.setattr(torch.cuda, "device_memory_used", fail)
    assert memory.card_used_mb([0]) == []
    assert memory.card_used_mb([]) == []


def report(used: list[list[float]]) -> dict:
    def cell(name, mem, nvml):
        return {"strategy": name, "devices": len(mem), "batch_size": 64, "samples_per_s": 1000.0, "ms_per_step": 64.0,
                "scaling_efficiency": 1.0, "speedup_vs_baseline": None, "peak_memory_mb": mem, "card_used_mb": nvml,
                "imbalance": 1.0, "loss": 2.3, "loss_parity": 0.0}

    return {"config": {"model": "lenet5", "samples": 512, "repeats": 1, "fast_batch": 1024, "precision": "fp32",
                       "compile": False},
            "hardware": {"cpu": "x", "cores": 16, "cards": ["NVIDIA H100 80GB HBM3"]}, "torch": "2.x", "command": "c",
            "date": "2026-11-22", "sweep_seconds": 1.0,
            "cells": [cell("single", [137.0], used[0]), cell("ddp", [140.0, 141.0], used[1])]}


def test_the_bench_table_has_an_nvml_column_only_where_nvml_was_read():
    with_nvml = report([[612.0], [700.0, 705.0]])
    assert "NVML MB per card" in table(with_nvml) and "700 / 705" in table(with_nvml)
    assert "NVML: memory in use" in markdown(with_nvml)
    header = next(line for line in markdown(with_nvml).splitlines() if line.startswith("| cell"))
    row = next(line for line in markdown(with_nvml).splitlines() if line.startswith("| ddp"))
    assert header.count("|") == row.count("|")  # the column is in the header and in every row
    without = report([[], []])
    assert "NVML" not in table(without) and "NVML" not in markdown(without)


@cuda
def test_single_on_the_card_reports_memory_from_the_card(tmp_path):
    r = run_cli("train", "--devices", "cuda:0", *SMALL, "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    s = summary_of(tmp_path)
    assert s["devices"][0].startswith("cuda:0 ") and s["world_size"] == 1
    assert len(s["peak_memory_mb"]) == 1 and s["peak_memory_mb"][0] > 0
    if HAS_NVML:  # what the driver sees holds at least what torch allocated, plus the context
        assert len(s["card_used_mb"]) == 1 and s["card_used_mb"][0] > s["peak_memory_mb"][0]
        assert "in use per card (NVML)" in r.stdout + r.stderr


@cuda
def test_ddp_on_one_card_runs_on_nccl_and_learns_what_single_learns(tmp_path):
    runs = {}
    for name in ("single", "ddp"):
        r = run_cli("train", "--strategy", name, "--devices", "cuda:0", "--no-augment", *SMALL,
                    "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr
        runs[name] = summary_of(tmp_path / name)
    assert runs["ddp"]["strategy"] == "ddp" and runs["ddp"]["world_size"] == 1
    assert runs["ddp"]["train_loss"] == pytest.approx(runs["single"]["train_loss"], rel=1e-3)
    state = torch.load(tmp_path / "ddp" / "model.pt", weights_only=True)
    assert state and not any(k.startswith("module.") for k in state)


@cuda
def test_ddp_under_torchrun_on_the_card(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
                        "multicard", "train", "--strategy", "ddp", "--devices", "1", *SMALL, "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    s = summary_of(tmp_path)
    assert (s["launcher"], s["world_size"]) == ("torchrun", 1) and s["devices"][0].startswith("cuda:0 ")


@cuda
@pytest.mark.parametrize("extra", [[], ["--precision", "bf16"],
                                   pytest.param(["--precision", "bf16", "--compile"], marks=pytest.mark.slow)])
def test_fast_path_on_the_card(tmp_path, extra):
    r = run_cli("train", "--devices", "cuda:0", "--device-data", *extra, *SMALL, "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr
    s = summary_of(tmp_path)
    assert math.isfinite(s["train_loss"]) and s["config"]["device_data"] and s["train_samples_per_s"] > 0


CARD_BENCH = ["--samples", "2048", "--batch-size", "256", "--repeats", "1", "--fast-batch", "1024", "--devices", "1"]


def planned(flags: list[str], cards: int) -> list[str]:
    """The strategy of each cell `multicard bench FLAGS` runs on a machine with `cards` cards, as the bench itself
    plans it (never a list copied into a test: the bench grew fsdp once, and its card test kept the old list)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return [name for name, _ in bench.plan(parser.parse_args(flags), cards=cards, cores=16)]


def test_the_card_bench_runs_every_strategy_of_the_one_list():  # on the CPU: the plan needs no card
    assert planned(CARD_BENCH, cards=1) == list(bench.ON_CARDS)


@cuda
@pytest.mark.slow  # a fresh process per cell: with the compile above, most of the CUDA tests' time
def test_bench_on_the_card(tmp_path):
    r = run_cli("bench", "--out", str(tmp_path), *CARD_BENCH, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "bench.json").read_text())
    assert rep["hardware"]["cards"] and [c["strategy"] for c in rep["cells"]] == planned(CARD_BENCH, cards=1)
    for row in [*rep["cells"], rep["baseline"], rep["fast"]]:
        assert row["device_names"][0].startswith("cuda:0 ") and row["peak_memory_mb"][0] > 0
        assert len(row["card_used_mb"]) == (1 if HAS_NVML else 0)
    assert ("NVML MB per card" in r.stdout) == HAS_NVML


@cuda
@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_cuda_fp16_with_accumulation_and_clipping(strategy, tmp_path):
    r = run_cli("train", "--strategy", strategy, "--devices", "cuda:0", "--precision", "fp16", "--accumulate", "2",
                "--clip-grad-norm", "1", "--optimizer", "sgd", "--lr", "0.05", *SMALL, "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = summary_of(tmp_path)
    assert summary["config"]["precision"] == "fp16" and summary["skipped_steps"] >= 0
    assert summary["optimizer_steps"] == 16 and math.isfinite(summary["train_loss"])


@rehearsal
def test_cuda_check_every_strategy_this_machine_runs():
    devices = "cuda" if torch.cuda.device_count() > 1 else "0,0"  # one card: 2 processes rehearse 2 cards on it
    r = run_cli("check", "--devices", devices, "--data", "synthetic", "--synthetic-samples", "256", "--batch-size",
                "32", "--steps", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    expected, _ = parity.runnable(TrainConfig(devices=devices))  # what the check says it runs, not a copy
    assert re.findall(r"one device vs \d+ \(([\w-]+)\)", r.stdout) == expected
    assert all(line.endswith("PASS") for line in r.stdout.splitlines() if line.startswith("parity:"))


@cuda
def test_the_main_job_on_a_card_holds_its_data_there_and_reaches_98(tmp_path):
    r = run_cli("train", "--devices", "1", "--out", str(tmp_path), timeout=300)  # the default recipe, every auto
    assert r.returncode == 0, r.stderr[-3000:]
    s = summary_of(tmp_path)
    assert s["config"]["device_data"] is True and s["config"]["batch_size"] == 256
    assert s["config"]["channels_last"] is False  # auto: not on cards until measured there
    assert s["test_accuracy"] >= 0.975  # one seed; the target (>= 98% mean of 3) is benchmarks/main_job.py --card


@cuda
@pytest.mark.parametrize("strategy", ["ddp", "dp", "dp-balanced"])
def test_one_card_pays_no_strategy_wrapper(strategy):
    from torch.nn.parallel import DistributedDataParallel

    from multicard import Multicard
    from multicard.models import LeNet5
    from multicard.strategies.balanced import ParallelModel

    with Multicard(strategy, "1") as mc:
        model = mc.setup(LeNet5())
        wrapper = model.forward_module
        assert not isinstance(wrapper, (DistributedDataParallel, ParallelModel)), type(wrapper)
        assert strategy == "dp" or wrapper is model.module  # dp keeps DataParallel, which calls the module itself


def test_on_a_card_sh_says_failed_for_a_step_whose_python_raised(tmp_path):
    """The script a card session runs, here on the CPU: its env step's Python line asks for card 0 and raises (it
    once said "exit 0" for that, the exit code of the step's last command); nvidia-smi is a stand-in that works."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho a stand-in\n")
    (fake / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    r = subprocess.run(["bash", "benchmarks/on_a_card.sh", str(out), "env"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable,
                                                   "PATH": f"{fake}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.fullmatch(rf"step env: FAILED \(exit 1\) in \d+ s; see {out}/env.txt\n", r.stdout), r.stdout
    assert "a stand-in" in (out / "env.txt").read_text() and "Error" in (out / "env.txt").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["env.txt", "runs", "steps.txt", "tmp"]  # all of it in OUT


def test_on_a_card_sh_default_fits_one_call_of_under_9_minutes_and_rehearses_first():
    text = open(os.path.join(ROOT, "benchmarks", "on_a_card.sh")).read()
    default = re.search(r"steps=\$\{\*:-([\w -]+)\}", text)[1].split()
    limits = {name: int(seconds) for name, seconds in re.findall(r"^\s+([\w-]+)\) (?:step|bench) \1 (\d+)", text, re.M)}
    assert default[:2] == ["env", "rehearse"] and "cuda-tests" in default
    assert sum(limits[name] for name in default) <= 540, limits  # each step is cut at its limit


@pytest.mark.slow
def test_on_a_card_sh_rehearse_runs_every_part_and_fails_where_one_does(tmp_path):
    """On the CPU the probe's device stage fails (no card), the rehearsal tests skip, run and train say there is no
    card: every part ran, and the step failed."""
    out = tmp_path / "out"
    r = subprocess.run(["bash", "benchmarks/on_a_card.sh", str(out), "rehearse"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 1 and r.stdout.startswith("step rehearse: FAILED (exit 1)"), r.stdout + r.stderr
    log = (out / "rehearse.txt").read_text()
    assert "probe: FAILED at device" in log and log.count("this machine has no CUDA card") == 2, log
    assert re.search(r"\d+ skipped", log) and "== multicard train" in log, log

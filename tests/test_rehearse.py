"""A card named twice (--devices 0,0) rehearses more cards on one: the device planning, the backend it picks, the
refusals, the flag on every command, and the probe of gloo on a shared card. On the CPU: the cards are counted by
a stand-in for NVML (which honours CUDA_VISIBLE_DEVICES, as NVML does), and nothing is spawned on a card: where a
command would start its processes, the stand-in for the launcher says what it was asked to start."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import multicard
from conftest import ROOT
from multicard import cli, strategies
from multicard.errors import UsageError
from multicard.jobs import devices, launcher
from multicard.jobs import dist as jobs_dist
from multicard.jobs.devices import Devices, parse, rehearsal, select
from multicard.jobs.dist import Job, backend_for
from multicard.tools import bench, parity
from multicard.trainer.config import TrainConfig
from multicard.yourloop.strategy_choice import make_strategy
from test_bench import args as bench_args

SHARED = Devices("cuda", (0, 0))


@pytest.fixture
def cards(monkeypatch):
    """cards(n): this process sees n CUDA cards, counted as NVML counts them (through CUDA_VISIBLE_DEVICES, which
    the test leaves as it found it), CUDA never started; the launcher's waiting policy left alone."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "openmp_env", lambda processes, env: {})

    def machine(n: int) -> None:
        def count() -> tuple[int, bool]:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            return (len(shown.split(",")) if shown else n), True

        monkeypatch.setattr(devices, "count_cards", count)

    return machine


class Spawned(Exception):
    """What a command asked the launcher to start, instead of starting it."""

    def __init__(self, processes: int, strategy):
        super().__init__(processes)
        self.processes, self.strategy = processes, strategy


@pytest.fixture
def no_spawn(monkeypatch):
    def spawn(fn, processes, payload, named=(), stop_grace=None):
        raise Spawned(processes, payload[1])  # payload: the Multicard class, then the strategy

    monkeypatch.setattr(launcher, "spawn", spawn)


# -- the planning ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, count, ids", [
    ("0,0", 1, (0, 0)),
    ("cuda:0,cuda:0", 1, (0, 0)),
    ("cuda:0,0", 1, (0, 0)),
    ("0,0,", 1, (0, 0)),
    (" Cuda:1, 1 ", 2, (1, 1)),
    ("1,0,1", 2, (1, 0, 1)),
    ("0,1,0,1", 2, (0, 1, 0, 1)),
    (",".join("0" * 16), 1, (0,) * 16),  # the most processes one card takes
])
def test_a_card_named_twice_is_a_rehearsal_on_it(text, count, ids):
    chosen = parse(text, count)
    assert (chosen.kind, chosen.ids, chosen.shared, chosen.note) == ("cuda", ids, True, "")


def test_cards_named_once_and_cpu_processes_share_nothing():
    assert parse("cuda:0,cuda:1", 2).ids == (0, 1)
    assert not any(d.shared for d in (parse("0,1", 2), parse("cuda", 2), parse("cpu:2", 0), parse("auto", 0)))


def test_select_shows_each_shared_card_once_and_names_the_processes_as_they_see_it(cards):
    cards(2)
    chosen = select("1,1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1" and chosen.ids == (0, 0) and chosen.spec == "cuda:0,0"
    again = select(chosen.spec)  # what a rank that the launcher started reads (it sees one card now)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1" and again.ids == (0, 0)
    os.environ["CUDA_VISIBLE_DEVICES"] = "4,6"  # the user's own narrowing: card 1 is physical card 6
    assert select("1,0,1").ids == (0, 1, 0) and os.environ["CUDA_VISIBLE_DEVICES"] == "6,4"


def test_where_cuda_had_started_the_cards_are_named_again_by_their_ids(monkeypatch):
    monkeypatch.setattr(devices, "count_cards", lambda: (4, False))  # CUDA started: the visible set is frozen
    for text, ids in (("2,3", (2, 3)), ("3,3", (3, 3))):
        chosen = select(text)
        assert chosen.ids == ids and select(chosen.spec).ids == ids  # not "cuda" (all 4 cards)


@pytest.mark.parametrize("chosen, backend", [
    (Devices("cuda", (0, 1)), "nccl"),
    (Devices("cuda", (0,)), "nccl"),
    (SHARED, "gloo"),
    (Devices("cuda", (0, 1, 0, 1)), "gloo"),
    (Devices("cpu", (0, 1)), "gloo"),
])
def test_processes_that_share_a_card_meet_over_gloo(chosen, backend):
    assert backend_for(chosen) == backend


def test_the_rehearsal_line_says_what_differs_from_real_cards():
    assert rehearsal(SHARED).startswith("rehearsal: 2 processes on one card, over gloo (NCCL takes one process per")
    assert "not NCCL, the links between cards, memory per card or speed" in rehearsal(SHARED)
    assert rehearsal(Devices("cuda", (0, 1, 0, 1))).startswith("rehearsal: 4 processes on 2 cards")


def test_a_rehearsal_is_ddp_or_fsdp_and_dp_refuses_it_in_one_line():
    assert strategies.choose("auto", SHARED, Job()) == "ddp"
    assert [strategies.create(n, SHARED, Job()).processes for n in ("ddp", "fsdp")] == [2, 2]
    for name in ("dp", "dp-balanced"):
        with pytest.raises(UsageError) as e:
            strategies.choose(name, SHARED, Job())
        assert str(e.value).startswith(f"--strategy {name} drives every card from one process: it cannot rehearse")
        assert "rehearse with --strategy ddp or fsdp" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError, match="--strategy single trains on one device, but --devices names 2"):
        strategies.choose("single", SHARED, Job())


def test_ddp_on_a_shared_card_joins_over_gloo_and_rank_0_says_it_is_a_rehearsal(monkeypatch, capsys):
    joined = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **kw: joined.append(backend))
    for ids in ((0, 0), (0,)):
        strategy = strategies.create("ddp", Devices("cuda", ids), Job())
        strategy.start(Job())
        assert strategy.device == torch.device("cuda", 0)
        strategy.stop()
    assert joined == ["gloo", "nccl"]
    said = capsys.readouterr().err.splitlines()
    assert said == [f"multicard: {rehearsal(SHARED)}"]  # once, for the shared card only


def test_rank_1_of_a_rehearsal_works_on_the_same_card_and_says_nothing(monkeypatch, capsys):
    joined = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(jobs_dist, "init", lambda job, chosen, timeout_s: joined.append(chosen))
    strategy = strategies.create("ddp", SHARED, Job(1, 2, 1, 2, "torchrun"))
    strategy.start(Job(1, 2, 1, 2, "torchrun"))
    strategy.stop()
    assert joined == [SHARED] and strategy.device == torch.device("cuda", 0) and capsys.readouterr().err == ""


def test_a_group_the_script_joined_over_nccl_cannot_serve_a_shared_card(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for name, value in (("is_initialized", True), ("get_rank", 0), ("get_world_size", 1), ("get_backend", "nccl")):
        monkeypatch.setattr(torch.distributed, name, lambda *a, v=value: v)
    with pytest.raises(UsageError, match="joined a nccl process group, which cannot reduce tensors of a card shared"):
        strategies.create("ddp", SHARED, Job()).start(Job())


# -- the flag on every command -------------------------------------------------------------------------------------

def test_run_starts_one_process_per_entry_and_tells_them_the_shared_card(cards, monkeypatch, tmp_path):
    cards(2)
    started = []
    monkeypatch.setattr(launcher, "run_command", lambda command, processes, env, _: started.append((processes, env)))
    script = tmp_path / "mine.py"
    script.write_text("")
    cli.main(["run", "--devices", "cuda:1,cuda:1", str(script)])
    processes, env = started[0]
    assert processes == 2 and env["MULTICARD_STRATEGY"] == "ddp" and env["MULTICARD_DEVICES"] == "cuda:0,0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("MULTICARD_DEVICES", env["MULTICARD_DEVICES"])  # what rank 1 finds, and makes of it
    monkeypatch.setenv("MULTICARD_STRATEGY", env["MULTICARD_STRATEGY"])
    rank = make_strategy("auto", "auto", "fp32", Job(1, 2, 1, 2, "multicard"), find_unused_parameters=False,
                         fsdp_blocks="", reshard_after_forward=True, timeout=120.0)
    assert (rank.name, rank.devices, rank.device) == ("ddp", SHARED, torch.device("cuda", 0))


def test_run_with_dp_on_a_shared_card_is_one_line(cards, capsys, tmp_path):
    cards(1)
    script = tmp_path / "mine.py"
    script.write_text("")
    assert cli.main(["run", "--strategy", "dp", "--devices", "0,0", str(script)]) == 2
    assert capsys.readouterr().err.startswith("multicard: error: run: --strategy dp drives every card from one")


def test_train_spawns_ddp_on_the_shared_card(cards, no_spawn, tmp_path):
    cards(1)
    with pytest.raises(Spawned) as e:
        cli.main(["train", "--devices", "0,0", "--data", "synthetic", "--synthetic-samples", "64", "--batch-size",
                  "16", "--epochs", "1", "--quiet", "--out", str(tmp_path / "run")])
    assert (e.value.processes, e.value.strategy.name, e.value.strategy.devices) == (2, "ddp", SHARED)


def test_check_compares_one_card_with_processes_sharing_it(cards, no_spawn):
    cards(2)
    assert parity.runnable(TrainConfig(devices="0,1")) == (["ddp", "dp", "dp-balanced"], "cuda:0,1")
    assert parity.runnable(TrainConfig(devices="1,1")) == (["ddp"], "cuda:0,0")
    assert parity.runnable(TrainConfig(devices="cuda:0,cuda:0", strategy="fsdp")) == (["fsdp"], "cuda:0,0")
    with pytest.raises(Spawned) as e:
        cli.main(["check", "--devices", "0,0", "--data", "synthetic", "--synthetic-samples", "64", "--batch-size",
                  "16", "--steps", "2"])
    assert (e.value.processes, e.value.strategy.name, e.value.strategy.devices) == (2, "ddp", SHARED)


def test_check_without_a_rehearsal_keeps_every_strategy_of_the_cards():
    assert parity.runnable(TrainConfig(devices="cpu:2")) == (["ddp"], "cpu:2")


def test_bench_runs_1_and_2_processes_on_the_shared_card(cards, monkeypatch, capsys, tmp_path):
    sweep = bench_args(devices="0,0")
    assert bench.plan(sweep, cards=1, cores=2) == [("single", 1), ("ddp", 1), ("ddp", 2), ("fsdp", 1), ("fsdp", 2)]
    assert [bench.device_spec(n, 1, sweep.rehearsal) for n in (1, 2)] == ["cuda:0", "cuda:0,0"]
    assert bench.plan(bench_args(devices="1,2"), cards=2, cores=2) == [  # counts, as before
        ("single", 1), ("dp", 1), ("dp", 2), ("dp-balanced", 1), ("dp-balanced", 2), ("ddp", 1), ("ddp", 2),
        ("fsdp", 1), ("fsdp", 2)]
    with pytest.raises(UsageError, match="dp drives every card from one process: it cannot rehearse on a card named"):
        bench.plan(bench_args(devices="0,0", strategies="dp"), cards=1, cores=2)
    with pytest.raises(UsageError, match="--devices 0,0: this machine has no CUDA card"):
        bench.plan(bench_args(devices="0,0"), cards=0, cores=2)
    monkeypatch.setattr(bench, "machine", lambda: (1, 2))
    monkeypatch.setattr(bench, "sweep", lambda args, cells, n, cores: (_ for _ in ()).throw(Spawned(len(cells), None)))
    with pytest.raises(Spawned):
        cli.main(["bench", "--devices", "cuda:0,cuda:0", "--out", str(tmp_path)])
    assert capsys.readouterr().out == f"multicard: {rehearsal(SHARED)}\n"


def test_launch_and_multicard_take_a_shared_card(cards, no_spawn):
    cards(1)
    with pytest.raises(Spawned) as e:
        multicard.launch(print, devices="0,0")
    assert (e.value.processes, e.value.strategy.name, e.value.strategy.devices) == (2, "ddp", SHARED)
    mc = multicard.Multicard("fsdp", "cuda:0,cuda:0")
    assert (mc.world_size, mc.strategy) == (2, "fsdp")
    assert launcher.job_choice(mc._strategy) == {"MULTICARD_STRATEGY": "fsdp", "MULTICARD_DEVICES": "cuda:0,0"}
    with pytest.raises(UsageError, match="--strategy dp-balanced drives every card from one process"):
        multicard.Multicard("dp-balanced", "0,0")


SMALL = ["--data", "synthetic", "--synthetic-samples", "64", "--batch-size", "16"]


@pytest.mark.parametrize("command", [["train", *SMALL, "--epochs", "1", "--quiet"], ["check", *SMALL, "--steps", "2"],
                                     ["run"], ["bench"]])
def test_without_a_card_a_rehearsal_is_the_no_card_line(cards, no_spawn, capsys, tmp_path, command):
    cards(0)
    script = tmp_path / "mine.py"
    script.write_text("")
    where = [str(script)] if command == ["run"] else ["--out", str(tmp_path / "out")] * (command[0] != "check")
    assert cli.main([command[0], "--devices", "0,0", *command[1:], *where]) == 2
    assert re.fullmatch(r"multicard: error: (run: )?--devices 0,0: this machine has no CUDA card; use --devices "
                        r"cpu or cpu:N\n", capsys.readouterr().err)
    with pytest.raises(UsageError, match="--devices 0,0: this machine has no CUDA card"):
        multicard.Multicard(devices="0,0")


# -- the probe of gloo on a shared card ----------------------------------------------------------------------------

PROBE = [sys.executable, "benchmarks/rehearse_probe.py", "--devices", "cpu"]


def probe(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PROBE, *flags], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_probe_says_every_stage_and_checks_the_steps_against_one_process():
    r = probe("--nccl")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for stage in ("start", "device", "init", "ddp-build", "ddp-step", "fsdp-build", "fsdp-step", "destroy", "nccl"):
        assert f"probe: {stage} ..." in lines and any(line.startswith(f"probe: {stage} ok in ") for line in lines)
    steps = [line for line in lines if re.match(r"probe: (ddp|fsdp)-step ok in", line)]
    assert len(steps) == 2 and all(re.search(r"5 steps, weights \S+ from one process's", s) for s in steps)
    assert "probe: nccl ok in" in r.stdout and "(skipped: NCCL needs a card)" in r.stdout
    assert lines[-1] == "probe: every stage passed"


@pytest.mark.slow
def test_a_stage_that_hangs_is_named_and_every_process_killed():
    r = probe("--hang-in", "device", "--stage-timeout", "5")  # the first stage after start (which has 120 s)
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"^probe: device hung: ranks? [\d, ]+ still in it after 5 s.*; killing every process$", r.stdout,
                     re.M), r.stdout
    assert r.stdout.splitlines()[-1] == "probe: FAILED at device" and "init ..." not in r.stdout


@pytest.mark.slow
def test_a_stage_that_raises_is_named_with_its_error():
    if torch.cuda.is_available():
        pytest.skip("the error is a CPU-only torch's: asked for a card, it has none")
    r = probe("--devices", "cuda:0")  # the later --devices wins: a card this torch cannot reach
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"^probe: device FAILED on rank \d: \w+", r.stdout, re.M), r.stdout
    assert r.stdout.splitlines()[-1] == "probe: FAILED at device"


@pytest.mark.slow
def test_nccl_is_a_question_the_probe_asks_not_a_stage_to_pass():
    r = probe("--nccl", "--hang-in", "nccl", "--stage-timeout", "30")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^probe: nccl hung: ranks? [\d, ]+ still in it after 30 s", r.stdout, re.M), r.stdout
    assert r.stdout.splitlines()[-1] == "probe: every gloo stage passed; NCCL gave no answer (above)"
